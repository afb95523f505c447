"""Probe (seventeenth session): db from partial column sums written with D
(``logits_tiles.d_tiles_kernel``) per tile shape, through the API (bench method fused_ce),
alternating twice.

    python tools/probe_db_parts.py [--shapes bert8k,bert16k]

Variants: (rows per program, vocabulary tiles of 128 columns per program, warps).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench  # noqa: E402
from fused_ce.kernels import config  # noqa: E402

VARIANTS = [(64, 16, 8), (64, 4, 4), (32, 16, 8), (128, 16, 8), (64, 8, 4)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="bert8k,bert16k")
    args = ap.parse_args()
    opts = argparse.Namespace(warmup_steps=2, rep_ms=200, warmup_ms=50, errors=False)
    for shape in args.shapes.split(","):
        for _ in range(2):
            for rows, tiles, warps in VARIANTS:
                config.GPU["logits_tiles"] = {**config.GPU["logits_tiles"], "db_rows": rows,
                                              "db_tiles": tiles, "db_warps": warps}
                ms = bench.measure("fused_ce", shape, opts)["ms"]
                print(f"{shape} db_rows {rows} db_tiles {tiles} warps {warps}: {ms:.3f} ms",
                      flush=True)


if __name__ == "__main__":
    main()
