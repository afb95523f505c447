"""One device call (thirty-third session, NOTES.md #94): the statistics' and gradients' errors
against fp64 of the epilogue path with and without row references (row_ref.py), bf16, on
random rows and on a trained model's rows (a third at p_t ~ 0.999, a third ~ 0.2), at BERT's
and Gemma-2's hidden sizes; eager bf16's gradient errors beside them.

    python tools/probe_row_ref.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from fused_ce import kernels  # noqa: E402
from fused_ce.kernels import config  # noqa: E402
from test_gpu import _eager_grad_errors, _inputs, _mean_coefs, _oracle, _rel  # noqa: E402


def main():
    n, v = 3000, 10007
    for h in (1024, 2304):
        for rows in ("random", "confident"):
            x, w, b, t = _inputs(n, h, v, torch.bfloat16, seed=h)
            if rows == "confident":
                pull = torch.where(torch.arange(n, device="cuda")[:, None] % 3 == 0, 16.0, 8.0)
                x = (x.float() * 0.5 + pull * w[t.clamp_min(0)].float()).to(torch.bfloat16)
            coefs = _mean_coefs(t, n)
            ref = _oracle(x, w, b, t, coefs)
            eager = _eager_grad_errors(x, w, b, t, None, ref)
            out = [f"H {h} {rows:9s} eager dx {eager['dx']:.3e} dw {eager['dw']:.3e}"]
            for on in (False, True):
                for key in ("gpu", "gpu_wide"):
                    config.CONFIG[key]["logits_tiles"]["row_ref"] = on
                ours = kernels.forward(x, w, b, t, -100, None, None, coefs=coefs, need_dx=True,
                                       need_dw=True, need_db=False)
                out.append(f"{'row_ref' if on else 'd_pass'}: lse {_rel(ours.lse, ref.lse):.2e}"
                           f" nll {_rel(ours.nll, ref.nll):.2e} dx {_rel(ours.dx, ref.dx):.3e}"
                           f" dw {_rel(ours.dw, ref.dw):.3e}")
            print(" | ".join(out), flush=True)


if __name__ == "__main__":
    main()
