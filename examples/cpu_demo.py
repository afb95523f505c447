"""A small CPU demo: the fused loss versus eager PyTorch on one shape -- the same numbers, a
fraction of the memory. Each side runs in its own process so their peak memory is its own.

    python examples/cpu_demo.py [--tokens 4096 --hidden 256 --vocab 30522]
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = ROOT / "tests" / "_memory_probe.py"


def run(mode, args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(PROBE), mode, str(args.tokens), str(args.hidden),
                          str(args.vocab)], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=30522)
    args = p.parse_args()
    rows = [run("eager", args), run("fused", args)]
    print(f"forward+backward, fp32, CPU, N={args.tokens} H={args.hidden} V={args.vocab}")
    print(f"{'':8}{'loss':>12}{'seconds':>10}{'extra peak MiB':>16}")
    for r in rows:
        print(f"{r['mode']:8}{r['loss']:12.6f}{r['seconds']:10.2f}{r['extra_peak_mib']:16.0f}")
    print(f"gradient buffers: {rows[0]['grads_mib']:.0f} MiB; "
          f"logits: {args.tokens * args.vocab * 4 / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
