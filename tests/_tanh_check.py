"""The kernels' tanh (``fused_ce.kernels.logits.tanh``, the softcap's) against fp64
``torch.tanh`` of the same fp32 values, for tests/_kernels_interpret_cases.py (interpreter) and
tests/test_gpu.py (CUDA)."""

import os

import torch
import triton
import triton.language as tl

from fused_ce.kernels import logits


@triton.jit
def _tanh_kernel(u_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    u = tl.load(u_ptr + i, mask=i < n)
    tl.store(out_ptr + i, logits.tanh(u), mask=i < n)


def check_tanh(device, ulps):
    """Within ``ulps`` fp32 ulps of tanh's own value: tiny arguments (where (1 - e) / (1 + e)
    alone loses it to cancellation: what a cap far above the logits feeds), both sides of the
    switch at |u| = 1/4, random ones below 1/2, saturation; exact zeros stay zero, NaN stays
    NaN, +-inf gives +-1."""
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    finite = torch.cat([torch.logspace(-30, 1.5, 400, dtype=torch.float64),
                        torch.rand(200, generator=g, dtype=torch.float64) * 0.5,
                        torch.tensor([0.25, 0.25 - 2**-26, 0.25 + 2**-25, 1e-38, 0.0],
                                     dtype=torch.float64)])
    finite = torch.cat([finite, -finite]).float()
    u = torch.cat([finite, torch.tensor([float("nan"), float("inf"), -float("inf")])]).to(device)
    out = torch.empty_like(u)
    _tanh_kernel[(1,)](u, out, u.numel(), BLOCK=triton.next_power_of_2(u.numel()))
    out = out.cpu()
    want = torch.tanh(finite.double())
    got = out[:finite.numel()].double()
    nonzero = want != 0
    rel = (got - want)[nonzero].abs() / want[nonzero].abs()
    assert rel.max().item() < ulps * 2.0**-23, f"worst relative error {rel.max().item():.2e}"
    assert (got[~nonzero] == 0).all()
    assert out[-3].isnan() and out[-2].item() == 1.0 and out[-1].item() == -1.0
