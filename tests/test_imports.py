"""The block manager and the scheduler are pure standard-library Python: they load on a machine with no GPU stack.

Two checks: a fresh interpreter imports both modules and none of the heavy packages gets loaded; and a static
read (with `ast`) of both source files finds only imports of standard-library modules or of the block manager.
"""
from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PURE = ("block_manager", "scheduler")
HEAVY = ("torch", "triton", "transformers", "numpy")
ALLOWED_FIRST_PARTY = {"nanoserve.block_manager"}


def test_fresh_interpreter_loads_no_heavy_package():
    code = (
        "import sys, json\n"
        "import nanoserve.block_manager, nanoserve.scheduler\n"
        f"heavy = {HEAVY!r}\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in heavy)\n"
        "print(json.dumps({'loaded': loaded, 'file': nanoserve.scheduler.__file__}))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert Path(out["file"]).resolve() == ROOT / "nanoserve" / "scheduler.py"   # the modules under test
    assert out["loaded"] == [], f"importing the pure modules loaded {out['loaded']}"


def imported_modules(source: str, package: str = "nanoserve") -> list[tuple[int, str]]:
    "(line, absolute module name) for every import statement anywhere in `source` (a module of `package`)."
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0: found.append((node.lineno, node.module))
            else:   # relative: resolve against the package (these modules sit at its top level)
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                found.append((node.lineno, f"{base}.{node.module}" if node.module else base))
    return found


def disallowed(source: str) -> list[tuple[int, str]]:
    return [(line, mod) for line, mod in imported_modules(source)
            if mod.split(".")[0] not in sys.stdlib_module_names and mod not in ALLOWED_FIRST_PARTY]


@pytest.mark.parametrize("name", PURE)
def test_only_standard_library_imports(name):
    source = (ROOT / "nanoserve" / f"{name}.py").read_text()
    mods = imported_modules(source)
    assert mods, "no imports found: is the file empty?"
    assert disallowed(source) == [], f"nanoserve/{name}.py imports outside the standard library"


def test_import_checker_catches_offenders():
    "The static check itself: it must flag third-party, nested and relative imports other than the allowed one."
    src = ("import os\nfrom collections import deque\nfrom .block_manager import BlockManager\n"
           "import numpy as np\ndef f():\n    import torch.nn\n    from transformers import AutoTokenizer\n"
           "from . import model\nfrom .kernels import attention\n")
    assert sorted(disallowed(src)) == [(4, "numpy"), (6, "torch.nn"), (7, "transformers"), (8, "nanoserve"),
                                       (9, "nanoserve.kernels")]


def package_imports(source: str) -> set[str]:
    "The package's modules a module's source imports at its top level (not inside functions: those load lazily)."
    tree = ast.parse(source)
    return {n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.level == 1 and n.module}


def test_the_course_table_lists_every_modules_imports():
    """The index's table of how the layers depend on each other (README.md is made from it) says what each module
    imports from the package at its top level, and each import is of a module listed before it: the reading order."""
    index = json.loads((ROOT / "nbs" / "index.ipynb").read_text())
    text = "".join(line for c in index["cells"] if c["cell_type"] == "markdown" for line in c["source"])
    rows = re.findall(r"^\| `(\w+)` \| (.*) \|$", text, flags=re.M)
    assert len(rows) > 20, "the table is gone from the index"
    listed = [m for m, _ in rows]
    for i, (module, deps) in enumerate(rows):
        said = set(re.findall(r"`(\w+)`", deps))
        assert said == package_imports((ROOT / "nanoserve" / f"{module}.py").read_text()), module
        assert said <= set(listed[:i]), f"{module} imports a later chapter: {sorted(said - set(listed[:i]))}"
