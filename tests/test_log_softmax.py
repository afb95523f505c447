"""linear_log_softmax / FusedLinearLogSoftmax against the fp64 oracle."""

import torch
import torch.nn.functional as F

import fused_ce
from fused_ce import reference
from tests.oracle import logits64, rel_err


def test_matches_linear_then_log_softmax(monkeypatch):
    monkeypatch.setattr(reference, "DEFAULT_CHUNK_BYTES", 5 * 301 * 4)  # several row chunks
    torch.manual_seed(torch.seed() % 2**31)
    x = torch.randn(3, 11, 257, requires_grad=True)
    W = torch.randn(301, 257, requires_grad=True)
    b = (torch.randn(301) * 20).requires_grad_()
    got = fused_ce.linear_log_softmax(x, W, b)
    want = logits64(x, W, b).log_softmax(-1)
    assert got.shape == (3, 11, 301) and got.dtype == torch.float32
    assert rel_err(got, want) < 1e-6
    g = torch.randn_like(want)
    for gg, wg in zip(torch.autograd.grad(got, (x, W, b), g.float()), torch.autograd.grad(want, (x, W, b), g)):
        assert rel_err(gg, wg) < 1e-5


def test_module_is_drop_in_for_linear_plus_logsoftmax():
    torch.manual_seed(torch.seed() % 2**31)
    fused = fused_ce.FusedLinearLogSoftmax(64, 97)
    plain = torch.nn.Sequential(torch.nn.Linear(64, 97), torch.nn.LogSoftmax(dim=-1))
    plain[0].load_state_dict(fused.state_dict())
    x = torch.randn(5, 64, dtype=torch.float64)
    fused.double(); plain.double()
    assert torch.allclose(fused(x), plain(x), rtol=0, atol=1e-12)
    no_bias = fused_ce.FusedLinearLogSoftmax(8, 5, bias=False)
    assert no_bias.bias is None
    y = torch.randn(2, 8)
    assert rel_err(no_bias(y), F.linear(y.double(), no_bias.weight.double()).log_softmax(-1)) < 1e-6


def test_autocast_output_dtype():
    x, W = torch.randn(4, 16), torch.randn(10, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused_ce.linear_log_softmax(x, W)
    assert out.dtype == torch.bfloat16
    want = logits64(x.bfloat16(), W.bfloat16()).log_softmax(-1)
    assert rel_err(out, want) < 1e-2


def test_confident_rows_keep_their_digits():
    """A class with nearly all the probability: its log-probability (~ -1e-7) is as close to
    fp64 as eager fp32's, not lost to the rounding of an fp32 lse (~5e-7 at |lse| ~ 5)."""
    from tests.oracle import assert_close

    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    x = torch.randn(64, 5, generator=g)
    W = torch.randn(3, 5, generator=g) * 0.1
    b = torch.tensor([-5.0, -21.0, -22.0]) + 0.3 * torch.rand(3, generator=g)
    want = torch.log_softmax(x.double() @ W.double().t() + b.double(), -1)
    eager = torch.log_softmax(x @ W.t() + b, -1)
    got = fused_ce.linear_log_softmax(x, W, b)
    assert want[:, 0].abs().max() < 1e-5  # the regime of the test
    assert_close(got[:, 0], want[:, 0], eager[:, 0], 2e-5)
    assert_close(got, want, eager, 2e-5)
