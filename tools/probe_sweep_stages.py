"""Probe (fourteenth session): the sweeps' logits tile with 3 or 4 pipeline stages, through the
API (bench methods fused_ce_sweep and fused_ce_lowmem), alternating twice.

    python tools/probe_sweep_stages.py [--shapes bert8k,llama3]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench  # noqa: E402
from fused_ce.kernels import config  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="bert8k,llama3")
    args = ap.parse_args()
    opts = argparse.Namespace(warmup_steps=2, rep_ms=300, warmup_ms=50, errors=False)
    for shape in args.shapes.split(","):
        for _ in range(2):
            for stages in (3, 4):
                for cfg in (config.GPU, config.GPU_WIDE):
                    cfg["logits"] = {**cfg["logits"], "num_stages": stages}
                ms = [bench.measure(m, shape, opts)["ms"]
                      for m in ("fused_ce_sweep", "fused_ce_lowmem")]
                print(f"{shape} stages {stages}: sweep {ms[0]:.2f} ms, low_memory {ms[1]:.2f} ms",
                      flush=True)


if __name__ == "__main__":
    main()
