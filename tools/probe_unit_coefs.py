"""bf16 gradients' error against fp64 where the loss's coefficients share a factor (NOTES.md
#64, #66): 4096 x 1024 x 30522 with exactly 614 valid rows (1/614 is 2.2e-3 from its nearest
bf16), upstream g. Prints dX, dW, db relative (norm) errors of: 'mean'; 'none' with the mean
taken afterwards (the backward's per-row upstream gradient g/614) and 'mean' with low_memory
(its gradients computed in the backward, from the same g/614), each with the backward's
coefficients divided by their largest (kernels._unit_coefs) and, for comparison, left as they
come ("as given"); eager with fp32 logits.

    python tools/probe_unit_coefs.py [--ups 1,0.37] [--seeds 0,1]
"""

import argparse

import torch
import torch.nn.functional as F

import fused_ce
from fused_ce import kernels
from fused_ce.reference import GradCoefs
from probe_upstream import grads, inputs, rel  # (tools/, the script's own folder)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ups", default="1,0.37")
    ap.add_argument("--seeds", default="0,1")
    args = ap.parse_args()
    n, h, v, n_valid = 4096, 1024, 30522, 614
    unit = kernels._unit_coefs
    as_given = lambda p, c: (GradCoefs(*kernels.row_coefs(p, c)),  # noqa: E731
                             torch.ones(1, device=p.device))
    lce = fused_ce.linear_cross_entropy
    methods = {
        "mean": lambda x, w, b, t: lce(x, w, t, linear_bias=b),
        "none/614": lambda x, w, b, t: lce(x, w, t, linear_bias=b, reduction="none").sum() / n_valid,
        "low_memory": lambda x, w, b, t: lce(x, w, t, linear_bias=b, low_memory=True),
        "eager fp32 logits": lambda x, w, b, t: F.cross_entropy(F.linear(x, w, b).float(), t),
    }
    # the backward routes again with kernels._unit_coefs switched off
    methods.update({f"{k} as given": fn for k, fn in list(methods.items())[1:3]})
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for seed in map(int, args.seeds.split(",")):
        x, w, b, t = inputs(n, h, v, 0.0, seed)
        g = torch.Generator(device="cuda").manual_seed(seed)
        t[torch.randperm(n, device="cuda", generator=g)[n_valid:]] = -100
        for up in map(float, args.ups.split(",")):
            exp = grads(lambda x, w, b, t: F.cross_entropy(F.linear(x, w, b), t),
                        x, w, b, t, up, torch.float64)
            for name, fn in methods.items():
                kernels._unit_coefs = as_given if name.endswith("as given") else unit
                got = grads(fn, x, w, b, t, up)
                errs = " ".join(f"{k}={rel(a, e):.3e}" for k, a, e in zip(("dx", "dw", "db"), got, exp))
                print(f"seed {seed} g {up:<5} {name:20s} {errs}")
    kernels._unit_coefs = unit


if __name__ == "__main__":
    main()
