"""One device call: an A/B of two trees of fused_ce in one process, their steps alternating.

    mkdir ab_old && git archive REV fused_ce | tar -x -C ab_old
    python tools/ab_in_process.py --old ab_old [--shapes mlm,mlm_eval] [--rounds 30] [--softcap C]
        [--low-memory]

Separate processes of the same code measured MLM 1.39-1.45 ms on one host and 2.13-2.83 on
another (NOTES.md, twenty-sixth session): the host sets the pace there, and a process's
placement on the host moves it by more than the changes being compared. Here the old tree is
copied with every ``fused_ce`` renamed ``fused_ce_old`` (its custom ops then register as
``fused_ce_old::...``) and imported beside this tree's, and each round times ``--steps``
back-to-back forward + backward steps (``_eval`` shapes: the loss under ``torch.no_grad``) of
each tree in turn on the same inputs (CUDA events; perf_counter on a CPU). Prints per shape
the median ms per step of each tree, the median of the per-round ratios new / old and the
range of those ratios.
"""
import argparse
import importlib
import os
import re
import shutil
import statistics
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
import bench  # noqa: E402
import fused_ce  # noqa: E402

OLD_NAME = "fused_ce_old"


def import_renamed(tree: str):
    """The package ``tree``/fused_ce imported as ``fused_ce_old`` (a renamed copy)."""
    dst = os.path.join(tempfile.mkdtemp(), OLD_NAME)
    shutil.copytree(os.path.join(tree, "fused_ce"), dst,
                    ignore=shutil.ignore_patterns("__pycache__"))
    for root, _, files in os.walk(dst):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                with open(path) as fh:
                    src = fh.read()
                with open(path, "w") as fh:
                    fh.write(re.sub(r"\bfused_ce\b", OLD_NAME, src))
    sys.path.insert(0, os.path.dirname(dst))
    return importlib.import_module(OLD_NAME)


def inputs(shape: str, device: str):
    """(x, w, b, t, kind): bench.py's inputs and kind ("ce" or "eval") of ``shape``."""
    if device == "cuda":
        return (*bench.make_inputs(shape), bench.SHAPES[shape][5])
    n, h, v, frac = 512, 64, 1000, 0.15  # a CPU smoke test of the tool itself
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g, requires_grad=True)
    w = (torch.randn(v, h, generator=g) / h ** 0.5).requires_grad_()
    b = torch.randn(v, generator=g, requires_grad=True)
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) > frac] = -100
    return x, w, b, t, "eval" if shape.endswith("_eval") else "ce"


def stepper(pkg, x, w, b, t, kind: str, softcap=None, low_memory=False):
    """bench.py's step (forward + backward, or the loss under no_grad) of ``pkg``'s loss."""
    params = [p for p in (x, w, b) if p is not None]
    return bench.forward_backward(
        "fused_ce", kind,
        lambda: pkg.linear_cross_entropy(x, w, t, linear_bias=b, softcap=softcap,
                                         low_memory=low_memory), params)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="a folder holding the old tree's fused_ce/")
    ap.add_argument("--shapes", default="mlm,mlm_eval")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--softcap", type=float, default=None,
                    help="the loss's softcap (training then takes the fp32-logits path)")
    ap.add_argument("--low-memory", action="store_true", help="both trees' low_memory=True")
    args = ap.parse_args()
    old = import_renamed(args.old)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for shape in args.shapes.split(","):
        x, w, b, t, kind = inputs(shape, device)
        steps = {name: stepper(pkg, x, w, b, t, kind, args.softcap, args.low_memory)
                 for name, pkg in (("old", old), ("new", fused_ce))}
        for step in steps.values():  # compile and warm up
            bench.ms_per_step(step, 3)
        times = {"old": [], "new": []}
        for r in range(args.rounds):
            for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
                times[name].append(bench.ms_per_step(steps[name], args.steps))
        ratios = sorted(n / o for n, o in zip(times["new"], times["old"]))
        print(f"{shape:10s} old {statistics.median(times['old']):.3f} ms  new "
              f"{statistics.median(times['new']):.3f} ms  new/old median "
              f"{statistics.median(ratios):.3f} (range {ratios[0]:.3f}-{ratios[-1]:.3f}, "
              f"{args.rounds} rounds of {args.steps} steps, {device})", flush=True)


if __name__ == "__main__":
    main()
