"""The lab (kernels/) runs in CI: every script with `--smoke`, on the CPU under the Triton interpreter.

Each script runs in a fresh process (`python kernels/X.py --smoke`, as a reader would run it) with
TRITON_INTERPRET=1, no visible GPU, one thread, and its output folder (NANOSERVE_SMOKE_OUT) in a temporary folder;
it must exit 0 within the timeout and leave figures/data untouched. A script without a `--smoke` mode fails here
by name. The shell scripts beside them are checked for syntax and run with `--smoke` likewise (their tiny CPU
version). And kernels/lab.py's own helpers, in process.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "kernels"
SCRIPTS = sorted(p.name for p in KERNELS.glob("*.py") if p.name != "lab.py")
TIMEOUT_S = 300          # a smoke run takes seconds; two busy cores can make it a minute


def has_smoke(src: str) -> bool:
    "A script has --smoke when it declares the flag itself or builds its arguments with lab.parser."
    return "--smoke" in src or ("from lab import" in src and "parser(" in src)


def data_snapshot() -> dict:
    "figures/data's files with their sizes and modification times."
    data = ROOT / "figures" / "data"
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in data.iterdir()} if data.is_dir() else {}


def test_every_script_is_listed():
    assert SCRIPTS, "no scripts in kernels/"
    missing = [s for s in SCRIPTS if not has_smoke((KERNELS / s).read_text())]
    assert not missing, f"kernels/ scripts without a --smoke mode: {', '.join(missing)}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_smoke(script, tmp_path):
    src = (KERNELS / script).read_text()
    if not has_smoke(src): pytest.fail(f"kernels/{script} has no --smoke mode (parser() from kernels/lab.py adds it)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "MPLBACKEND": "Agg", "NANOSERVE_SMOKE_OUT": str(tmp_path / "out")}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    before = data_snapshot()
    try:
        r = subprocess.run([sys.executable, str(KERNELS / script), "--smoke"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"kernels/{script} --smoke ran past {TIMEOUT_S} s; its output:\n{(e.stdout or '')[-3000:]}")
    assert r.returncode == 0, f"kernels/{script} --smoke exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    assert data_snapshot() == before, f"kernels/{script} --smoke wrote into figures/data"


SHELL_SCRIPTS = sorted(p.name for p in KERNELS.glob("*.sh"))


@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_shell_syntax(script):
    r = subprocess.run(["bash", "-n", str(KERNELS / script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_shell_smoke(script, tmp_path):
    "`bash kernels/X.sh --smoke`: the tiny CPU version (the built-in model, a few requests), output in a temp folder."
    src = (KERNELS / script).read_text()
    if "--smoke" not in src: pytest.fail(f"kernels/{script} has no --smoke mode")
    out = tmp_path / "out"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg",
           "NANOSERVE_SMOKE_OUT": str(out), "PYTHON": sys.executable}
    before = data_snapshot()
    try:
        r = subprocess.run(["bash", str(KERNELS / script), "--smoke"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"kernels/{script} --smoke ran past {TIMEOUT_S} s; its output:\n{(e.stdout or '')[-3000:]}")
    assert r.returncode == 0, f"kernels/{script} --smoke exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert data_snapshot() == before, f"kernels/{script} --smoke wrote into figures/data"
    assert list(out.glob("bench_*.json")), f"kernels/{script} --smoke wrote no benchmark JSON into {out}"


@pytest.fixture(scope="module")
def lab():
    sys.path.insert(0, str(KERNELS))
    try:
        import lab
        yield lab
    finally:
        sys.path.remove(str(KERNELS))


def test_twice_flags_more_than_15_percent(lab):
    values = iter([1.0, 1.1, 1.0, 1.2])
    assert lab.twice(lambda: next(values)) == (1.0, 1.1, False)
    assert lab.twice(lambda: next(values)) == (1.0, 1.2, True)
    assert not lab.disagree(0.0, 0.0) and lab.disagree(0.0, 1.0)


def test_time_cuda_on_the_cpu(lab):
    calls = []
    out = lab.time_cuda(lambda: calls.append(1), reps=5, warmup=2, device="cpu")
    assert len(out) == 5 and len(calls) == 7 and all(t >= 0 for t in out)
    assert len(lab.time_wall(lambda: None, reps=3, warmup=0, device="cpu")) == 3


def test_write_under_smoke_stays_out_of_the_repository(lab, tmp_path, monkeypatch):
    monkeypatch.setattr(lab, "_smoke_dir", None)
    monkeypatch.delenv("NANOSERVE_SMOKE_OUT", raising=False)
    args = lab.parser("a test").parse_args(["--smoke", "--out", str(ROOT / "figures" / "data")])
    assert lab.is_smoke(args) and lab.device_or_skip(args).type == "cpu"
    p = lab.write("lab_test.json", {"x": 1}, args)
    assert ROOT not in p.resolve().parents and not (ROOT / "figures" / "data" / "lab_test.json").exists()
    import json
    data = json.loads(p.read_text())
    assert data["x"] == 1 and data["smoke"] is True and "git_sha" in data["meta"] and data["command"]
    monkeypatch.setattr(lab, "_smoke_dir", None)
    monkeypatch.setenv("NANOSERVE_SMOKE_OUT", str(ROOT / "figures"))
    with pytest.raises(SystemExit, match="outside the repository"):
        lab.out_path("x.json", args)
    monkeypatch.setattr(lab, "_smoke_dir", None)


def test_out_is_a_folder_or_a_json_file(lab, tmp_path):
    folder = lab.parser("t").parse_args(["--out", str(tmp_path)])
    file = lab.parser("t").parse_args(["--out", str(tmp_path / "mine.json")])
    assert lab.out_path("a.json", folder) == tmp_path / "a.json"
    assert lab.out_path("a.json", file) == tmp_path / "mine.json"
