"""The house rules that can be measured, checked on the tree as it is: the course order is the dependency order,
no import loops or hidden (function-local) package imports, no module-level switches, no environment writes at
import, short exported cells, chapters that teach rather than narrate, and a public API at the top."""
from __future__ import annotations

import ast
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG, NBS = ROOT / "nanoserve", ROOT / "nbs"
LAZY_OK = {"cli", "__init__"}          # the command line imports its subcommands lazily; the top level its names
CHAPTERS = sorted(NBS.glob("[0-9]*.ipynb"))
SHA = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
# The experiment switches the package used to have; each is a config field or a parameter now.
OLD_SWITCHES = ("FAST_ARGMAX", "NORM_IN_GEMV", "GEMV_CONFIGS", "FP32_LOGITS", "LOAD_STEP_KERNEL", "ROPE_IN_DECODE",
                "GEMV_MAX_T", "WORDS_RULE", "F16_RULE", "TUNED_GEMV", "GEMV_OVERRIDES", "FEW_ROWS_GEMM", "TUNED_GEMM")


def modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text()) for p in PKG.glob("*.py") if p.stem != "_modidx"}


def package_imports(name: str, tree: ast.Module, top_level: bool) -> list[tuple[int, str]]:
    """(line, module) of the imports of package modules, at the top level of `tree` or inside functions/classes.
    The package's `__version__` (which nbdev writes into `__init__.py`) is not a chapter's."""
    nodes = tree.body if top_level else [n for top in tree.body if not isinstance(top, (ast.Import, ast.ImportFrom))
                                         for n in ast.walk(top)]
    found = []
    for n in nodes:
        if isinstance(n, ast.ImportFrom):
            mod = n.module or ""
            if n.level and mod: found.append((n.lineno, mod.split(".")[0]))
            elif n.level: found += [(n.lineno, a.name) for a in n.names if a.name != "__version__"]
            elif mod.startswith("nanoserve."): found.append((n.lineno, mod.split(".")[1]))
            elif mod == "nanoserve": found += [(n.lineno, a.name) for a in n.names if a.name != "__version__"]
        elif isinstance(n, ast.Import):
            found += [(n.lineno, a.name.split(".")[1]) for a in n.names if a.name.startswith("nanoserve.")]
    return found


def exported_module(nb: Path) -> str | None:
    for c in json.loads(nb.read_text())["cells"]:
        m = re.match(r"#\|\s*default_exp\s+(\S+)", "".join(c["source"]))
        if m: return m.group(1)
    return None


def course_position() -> dict[str, int]:
    return {m: i for i, nb in enumerate(CHAPTERS) if (m := exported_module(nb))}


def test_imports_follow_the_course_order():
    "A module imports only modules of earlier chapters: a DAG, and the reading order is a topological order."
    pos, bad = course_position(), []
    for name, tree in modules().items():
        if name in LAZY_OK: continue
        for line, dep in package_imports(name, tree, top_level=True):
            if dep not in pos: bad.append(f"{name}:{line} imports {dep}, which no chapter exports")
            elif pos[dep] >= pos[name]: bad.append(f"{name}:{line} imports {dep}, a later chapter")
    assert not bad, "\n".join(bad)


def test_no_function_local_package_imports():
    bad = [f"{name}:{line} imports {dep} inside a function" for name, tree in modules().items() if name not in LAZY_OK
           for line, dep in package_imports(name, tree, top_level=False)]
    assert not bad, "\n".join(bad)


def test_import_checker_sees_local_and_relative_imports():
    src = "from .model import x\nimport nanoserve.fused\ndef f():\n    from nanoserve.engine import LLM\n    from . import quant\n"
    tree = ast.parse(src)
    assert package_imports("m", tree, True) == [(1, "model"), (2, "fused")]
    assert package_imports("m", tree, False) == [(4, "engine"), (5, "quant")]


def _module_level_state(tree: ast.Module) -> list[tuple[int, str]]:
    """Module-level names bound to a bool constant (a switch), or public names bound to a mutable container (a table a
    script could patch: freeze it, e.g. a tuple or `types.MappingProxyType`). Private lookup tables are fine."""
    found = []
    for n in tree.body:
        if not isinstance(n, (ast.Assign, ast.AnnAssign)) or n.value is None: continue
        targets = n.targets if isinstance(n, ast.Assign) else [n.target]
        v = n.value
        mutable = isinstance(v, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
            isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id in ("dict", "list", "set"))
        switch = isinstance(v, ast.Constant) and isinstance(v.value, bool)
        if mutable or switch:
            found += [(n.lineno, t.id) for t in targets if isinstance(t, ast.Name) and t.id != "__all__"
                      and (switch or not t.id.startswith("_"))]
    return found


# Lazily filled caches keyed by device: filled on first use, never read as a setting.
CACHES: set = set()


def test_no_module_level_switches():
    bad = [f"{name}:{line} {var}" for name, tree in modules().items()
           for line, var in _module_level_state(tree) if (name, var) not in CACHES]
    assert not bad, "module-level switches or mutable tables (make them config fields or frozen data):\n" + "\n".join(bad)
    names = {t.id for tree in modules().values() for n in ast.walk(tree) if isinstance(n, ast.Name) for t in [n]}
    assert not names & set(OLD_SWITCHES), names & set(OLD_SWITCHES)


def test_switch_checker_catches_offenders():
    tree = ast.parse("A = True\nB: dict = {}\nC = (1, 2)\nD = frozenset()\n_E = []\n_F = False\n__all__ = ['x']\n")
    assert _module_level_state(tree) == [(1, "A"), (2, "B"), (6, "_F")]


def test_importing_changes_no_environment():
    "Every module imports without writing an environment variable (a fresh interpreter, each module in turn)."
    names = sorted(m for m in modules() if m not in ("cli", "__init__"))
    code = ("import os, json, importlib\nbefore = dict(os.environ)\n"
            f"for m in {names!r}: importlib.import_module('nanoserve.' + m)\n"
            "after = dict(os.environ)\n"
            "print(json.dumps(sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == []


def test_public_api_at_the_top():
    code = "from nanoserve import LLM, SamplingParams, EngineConfig; import nanoserve; print(sorted(nanoserve.__all__))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert {"LLM", "SamplingParams", "EngineConfig"} <= set(json.loads(r.stdout.strip().replace("'", '"')))


def _cells(nb: Path):
    for c in json.loads(nb.read_text())["cells"]:
        yield c["cell_type"], "".join(c["source"])


def test_exported_cells_are_short():
    lengths = {(nb.name, i): len(src.splitlines()) for nb in CHAPTERS
               for i, (kind, src) in enumerate(_cells(nb)) if kind == "code" and re.match(r"\s*#\s*\|\s*export", src)}
    long = [f"{nb} cell {i}: {n} lines" for (nb, i), n in lengths.items() if n > 60]
    assert not long, "exported cells over 60 lines:\n" + "\n".join(long)
    assert statistics.median(lengths.values()) <= 15, statistics.median(lengths.values())


@pytest.mark.parametrize("nb", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_prose(nb):
    "At most 6,000 words of prose, no commit hashes in it (provenance lives in the data files)."
    prose = [src for kind, src in _cells(nb) if kind == "markdown"]
    words = sum(len(p.split()) for p in prose)
    assert words <= 6000, f"{nb.name}: {words} words of prose"
    shas = [m for p in prose for m in SHA.findall(p)]
    assert not shas, f"{nb.name}: commit hashes in prose: {shas[:5]}"


def test_every_lab_script_has_a_smoke_mode():
    scripts = [p for p in (ROOT / "kernels").glob("*.py") if p.name != "lab.py"]
    missing = [p.name for p in scripts if "--smoke" not in p.read_text() and "parser(" not in p.read_text()]
    assert scripts and not missing, f"kernels/ scripts without --smoke: {missing}"
