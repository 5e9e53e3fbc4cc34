"""pytest configuration shared by `pytest tests` and `pytest --nbval-lax nbs`.

nbdev_clean sets every execution_count to None but keeps the outputs (clear_all = False: the notebooks are
committed with their outputs, which the write-up site shows). nbval 0.11 fails every such cell with
"Unrun reference cell has outputs". Give those cells a placeholder count before they run: under --nbval-lax the
outputs are then still not compared (only cells marked `# NBVAL_CHECK_OUTPUT` are), and nothing is written back.
"""


def pytest_collection_modifyitems(session, config, items):
    for item in items:
        cell = getattr(item, "cell", None)
        if type(item).__name__ == "IPyNbCell" and cell is not None and cell.get("execution_count", 0) is None \
                and cell.get("outputs"):
            cell["execution_count"] = 1
