"""Methods timed as a training loop runs them: steps back to back, one pair of CUDA events
around each run of steps, the methods alternating round by round in one process.

    python tools/steps_back_to_back.py --shapes llama3 --methods fused_ce,compile --rounds 3

``benchmarks/bench.py`` times each step on its own (``triton.testing.do_bench``: the L2 cache
flushed before every step, one pair of events per step). A loss that waits once on the host
(fused_ce's count of valid rows) leaves the GPU idle for that wait there; back to back, the host
may run ahead of the GPU as in training. Methods and shapes are bench.py's, plus
``fused_ce_prepared``: fused_ce with each step's targets scanned before the timed steps
(``fused_ce.prepare_targets``, as the HF adapter does before a model's forward pass), so that
nothing waits on the host inside a step. Prints, per round, the mean ms per step of each method;
with ``--clocks``, also each method's mean SM clock and power draw over its timed runs (nvidia-smi
sampled every 50 ms in the background): whether a method's per-step time above its GPU busy time
comes from lower clocks.
"""
import argparse
import datetime
import os
import statistics
import subprocess
import sys
import threading

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import bench  # noqa: E402

import fused_ce  # noqa: E402


def prepared_step(kind, x, w, b, t, params, softcap=None):
    """bench.py's fused_ce step taking its targets' scans from a queue that
    ``step.prepare(n)`` fills (n scans, finished before it returns)."""
    queue = []

    def prepare(n: int):
        queue[:] = [fused_ce.prepare_targets(t, w.shape[0]) for _ in range(n)]
        if t.is_cuda:
            torch.cuda.synchronize()

    step = bench.forward_backward(
        "fused_ce", kind,
        lambda: fused_ce.linear_cross_entropy(x, w, t, linear_bias=b, softcap=softcap,
                                              prepared_targets=queue.pop(0)), params)
    step.prepare = prepare
    return step


def make_step(name, kind, x, w, b, t, params, softcap=None):
    if name == "fused_ce_prepared":
        return prepared_step(kind, x, w, b, t, params, softcap)
    return bench.forward_backward(name, kind, bench.method_fn(name, kind, x, w, b, t, softcap),
                                  params)


def timed_steps(step, steps: int) -> float:
    """``bench.ms_per_step``, with a prepared step's scans made before the timed steps."""
    if hasattr(step, "prepare"):
        step.prepare(steps)
    return bench.ms_per_step(step, steps)


class ClockLog:
    """nvidia-smi's samples of GPU 0's SM clock (MHz) and power draw (W) every 50 ms, read in
    a background thread until ``stop``; ``means`` averages them over wall-clock windows."""

    def __init__(self):
        self.lines = []
        self.proc = subprocess.Popen(
            ["nvidia-smi", "-i", "0", "--query-gpu=timestamp,clocks.sm,power.draw",
             "--format=csv,noheader,nounits", "-lms", "50"], stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def stop(self):
        self.proc.terminate()
        self.thread.join(timeout=5)

    def means(self, windows):
        return clock_means(self.lines, windows)


def clock_means(lines, windows):
    """(mean SM MHz, mean W, samples) of nvidia-smi lines "2026/12/07 17:29:03.123, 1980,
    650.3" whose time lies in one of the (start, end) datetime windows; None without any."""
    got = []
    for line in lines:
        parts = [f.strip() for f in line.split(",")]
        try:
            when = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f")
            mhz, watts = float(parts[1]), float(parts[2])
        except (ValueError, IndexError):  # (a header, "[N/A]", a cut line)
            continue
        if any(a <= when <= b for a, b in windows):
            got.append((mhz, watts))
    if not got:
        return None
    return (statistics.fmean(m for m, _ in got), statistics.fmean(w for _, w in got), len(got))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="llama3")
    ap.add_argument("--methods", default="fused_ce,compile")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--clocks", action="store_true",
                    help="also each method's mean SM clock and power over its timed runs")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("steps_back_to_back.py needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    for shape in args.shapes.split(","):
        # a fresh compile per shape, as bench.py's: a second shape in one dynamo cache is
        # recompiled with dynamic sizes (other kernels)
        torch._dynamo.reset()
        x, w, b, t = bench.make_inputs(shape)
        kind = bench.SHAPES[shape][5]
        params = [p for p in (x, w, b) if p is not None]
        steps = {}
        for name in args.methods.split(","):
            steps[name] = make_step(name, kind, x, w, b, t, params, bench.SOFTCAP.get(shape))
            timed_steps(steps[name], args.warmup_steps)  # compile and warm up
        times = {name: [] for name in steps}
        windows = {name: [] for name in steps}
        clocks = ClockLog() if args.clocks else None
        for r in range(args.rounds):
            for name, step in steps.items():
                t0 = datetime.datetime.now()
                times[name].append(timed_steps(step, args.steps))
                windows[name].append((t0, datetime.datetime.now()))
            print(f"{shape} round {r + 1}: "
                  + "  ".join(f"{n} {ts[-1]:.3f}" for n, ts in times.items()), flush=True)
        print(f"{shape} median: "
              + "  ".join(f"{n} {statistics.median(ts):.3f}" for n, ts in times.items()))
        if clocks is not None:
            clocks.stop()
            got = {n: clocks.means(w) for n, w in windows.items()}
            print(f"{shape} clocks: " + "  ".join(
                f"{n} " + ("no samples" if g is None else f"{g[0]:.0f} MHz {g[1]:.0f} W ({g[2]})")
                for n, g in got.items()))


if __name__ == "__main__":
    main()
