"""The clock ramp on the GPU (lie 1 of the measurement chapter, nbs/13_measure.ipynb).

Run on the device machine from the repo root:  PYTHONPATH=. python kernels/clock_ramp_h200.py --out $OUT
Writes clock_ramp_h200.json (raw samples, SM clock readings, git sha, GPU, versions, date); copy it to figures/data/.
Takes about 15 s plus start-up (about 23 s in all on the H200). `--smoke`: the same code on the CPU, tiny
workload and fractions of a second, written to a temporary folder.

One sample = a fixed workload (48 bf16 matmuls of 4096 x 4096, ~10 ms warm on an H200), waited for.
1. cold: one untimed call (cuBLAS sets itself up), then 5 s idle so the clocks drop, then samples back to back
   for 4 s.
2. warm: warm_gpu(3 s) of sustained 8192 x 8192 matmuls, then samples for 2.5 s.
A thread polls nvidia-smi every ~0.2 s throughout (if it works) for the SM clock (MHz), power (W), whether the
software power cap is slowing the clock (1/0) and the temperature (C); `smi_fields` names the columns. Readings
are stored per phase, in seconds relative to that phase's first sample (negative: idle or warm_gpu before it).
"""
import subprocess, sys, threading, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))      # the only sys.path use in the lab
from lab import device_or_skip, is_smoke, parser, write   # first: --smoke must set the interpreter before torch loads

import torch

from nanoserve.measure import clock_ramp, matmul_workload, run_meta, summarize_ramp, warm_gpu

IDLE_S, SAMPLE_S, WARM_S, WARM_SAMPLE_S = 5.0, 4.0, 3.0, 2.5
SIZE, COUNT = 4096, 48
SMOKE = dict(idle=0.05, sample=0.2, warm=0.05, warm_sample=0.1, size=64, count=2)   # --smoke: the CPU, in a second
COMMAND = "PYTHONPATH=. python kernels/clock_ramp_h200.py --out $OUT"


SMI_FIELDS = ("clocks.sm,power.draw.instant,clocks_event_reasons.sw_power_cap,temperature.gpu",
              "clocks.sm,power.draw,clocks_throttle_reasons.sw_power_cap,temperature.gpu",
              "clocks.sm")


def smi_query(gpu_id, fields):
    "Values of `fields` for our GPU from nvidia-smi (floats; power cap 'Active' -> 1.0), or None when it fails."
    cmd = ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"]
    if gpu_id: cmd += ["-i", gpu_id]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=2)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0 or not out.stdout.strip(): return None
    vals = []
    for v in out.stdout.strip().splitlines()[0].split(","):
        v = v.strip()
        if v in ("Active", "Not Active"): vals.append(float(v == "Active"))
        else:
            try: vals.append(float(v))
            except ValueError: vals.append(None)       # "[N/A]"
    return vals


def smi_setup(dev):
    "(gpu id or None, fields) that nvidia-smi answers, or (None, None); (None, None) on a CPU."
    if dev.type != "cuda": return None, None
    gid = gpu_uuid(dev)
    for fields in SMI_FIELDS:
        for g in ((gid, None) if gid else (None,)):
            if smi_query(g, fields) is not None: return g, fields
    return None, None


class ClockPoller(threading.Thread):
    "Polls nvidia-smi in the background; readings are (perf_counter at the middle of the query, MHz, W)."
    def __init__(self, gpu_id, fields, period=0.2):
        super().__init__(daemon=True)
        self.gpu_id, self.fields, self.period = gpu_id, fields, period
        self.readings, self.stop = [], threading.Event()

    def run(self):
        while not self.stop.is_set():
            t0 = time.perf_counter()
            v = smi_query(self.gpu_id, self.fields)
            if v is None: return
            self.readings.append([(t0 + time.perf_counter()) / 2, *v])
            self.stop.wait(self.period)

    def between(self, t_from, t_to, t_zero):
        return [[r[0] - t_zero, *r[1:]] for r in self.readings if t_from <= r[0] <= t_to]


def gpu_uuid(dev):
    u = getattr(torch.cuda.get_device_properties(dev), "uuid", None)
    if u is None: return None
    u = str(u)
    return u if u.startswith("GPU-") else f"GPU-{u}"


def main():
    args = parser(__doc__).parse_args()
    dev = device_or_skip(args)
    idle_s, sample_s, warm_s, warm_sample_s, size, count = (
        tuple(SMOKE.values()) if is_smoke(args) else (IDLE_S, SAMPLE_S, WARM_S, WARM_SAMPLE_S, SIZE, COUNT))
    t_script = time.perf_counter()
    res = {"meta": run_meta(), "command": COMMAND,
           "workload": {"size": size, "count": count, "dtype": "bfloat16", "flops": 2 * size ** 3 * count,
                        "label": f"{count} x mm {size} bf16"},
           "idle_s": idle_s, "sample_s": sample_s, "warm_s": warm_s, "warm_sample_s": warm_sample_s}
    gid, fields = smi_setup(dev)
    res["smi_fields"] = ["t_s"] + fields.split(",") if fields else None     # the columns of each clocks reading
    fn = matmul_workload(dev, size, count)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    t = time.perf_counter(); fn(); sync(); res["first_call_ms"] = (time.perf_counter() - t) * 1e3   # cuBLAS set-up

    poller = ClockPoller(gid, fields)
    if fields: poller.start()
    t_idle = time.perf_counter()
    time.sleep(idle_s)
    t_cold = time.perf_counter()
    cold = clock_ramp(fn, sample_s, sync=sync)
    t_cold_end = time.perf_counter()
    res["cold"] = {"samples": cold, "summary": summarize_ramp(cold)}

    t_warm0 = time.perf_counter()
    res["warm_gpu_iters"] = warm_gpu(warm_s, dev)
    t_warm = time.perf_counter()
    warm = clock_ramp(fn, warm_sample_s, sync=sync)
    t_warm_end = time.perf_counter()
    poller.stop.set()
    if poller.is_alive(): poller.join(timeout=3)
    res["warm"] = {"samples": warm, "summary": summarize_ramp(warm)}
    # the same warm reference for both phases: how far the cold start is from the warmed GPU
    res["cold"]["summary_vs_warm"] = summarize_ramp(cold, warm_ms=res["warm"]["summary"]["warm_ms"])
    res["cold"]["clocks"] = poller.between(t_idle, t_cold_end, t_cold)
    res["warm"]["clocks"] = poller.between(t_warm0, t_warm_end, t_warm)
    res["script_s"] = time.perf_counter() - t_script
    write("clock_ramp_h200.json", res, args)
    for phase in ("cold", "warm"):
        print(phase, res[phase]["summary"], "clock readings:", len(res[phase]["clocks"]), flush=True)
    print("cold vs warm reference:", res["cold"]["summary_vs_warm"], "| warm_gpu iters", res["warm_gpu_iters"],
          "| first call ms", round(res["first_call_ms"], 1), "| script s", round(res["script_s"], 1))


if __name__ == "__main__":
    main()
