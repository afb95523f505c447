"""return_stats: lse, argmax (ties like torch.argmax), correct, accuracy, z-loss term."""

import math

import pytest
import torch

import fused_ce
from fused_ce import reference
from tests.oracle import cross_entropy64, logits64, rel_err


def test_stats_match_explicit_logits():
    torch.manual_seed(torch.seed() % 2**31)
    x = torch.randn(4, 9, 32)
    W = torch.randn(53, 32)
    b = torch.randn(53)
    t = torch.randint(0, 53, (4, 9))
    t[1, :5] = -100
    z = logits64(x, W, b, softcap=7.0)
    t[0, :3] = z[0, :3].argmax(-1)  # some tokens predicted correctly
    s = fused_ce.linear_cross_entropy(x, W, t, linear_bias=b, softcap=7.0, z_loss=1e-3,
                                      return_stats=True)
    valid = t != -100
    assert rel_err(s.loss, cross_entropy64(x, W, t, bias=b, softcap=7.0, z_loss=1e-3)) < 2e-6
    assert rel_err(s.lse[valid], torch.logsumexp(z, -1)[valid]) < 1e-6
    assert (s.lse[~valid] == 0).all()
    assert torch.equal(s.predicted[valid], z.argmax(-1)[valid])
    assert (s.predicted[~valid] == -100).all()
    assert torch.equal(s.correct, (z.argmax(-1) == t) & valid)
    assert s.correct[0, :3].all()
    assert math.isclose(s.accuracy.item(), ((z.argmax(-1) == t) & valid).sum().item() / valid.sum().item(), rel_tol=1e-6)
    zl = (1e-3 * torch.logsumexp(z, -1) ** 2)[valid].mean()
    assert rel_err(s.z_loss, zl) < 1e-6
    assert not s.lse.requires_grad


def test_argmax_ties_break_to_lowest_index():
    x = torch.ones(3, 4)
    W = torch.zeros(6, 4)
    W[2] = W[4] = 1.0  # classes 2 and 4 tie
    t = torch.tensor([4, 2, -100])
    s = fused_ce.linear_cross_entropy(x, W, t, reduction="none", return_stats=True)
    assert s.predicted.tolist() == [2, 2, -100]
    assert s.correct.tolist() == [False, True, False]
    assert s.z_loss is None
    assert math.isclose(s.accuracy.item(), 0.5)


def test_accuracy_is_nan_without_valid_tokens():
    s = fused_ce.linear_cross_entropy(torch.randn(2, 3), torch.randn(4, 3),
                                      torch.full((2,), -100), return_stats=True)
    assert math.isnan(s.accuracy.item()) and math.isnan(s.loss.item())


def test_module_return_stats_and_backward():
    x = torch.randn(6, 8, requires_grad=True)
    W = torch.randn(10, 8, requires_grad=True)
    t = torch.randint(0, 10, (6,))
    s = fused_ce.FusedCrossEntropy(return_stats=True)(x, W, t)
    s.loss.backward()
    want = cross_entropy64(x, W, t)
    assert rel_err(x.grad, torch.autograd.grad(want, x)[0]) < 1e-5


TILES = [(1, 1), (4, 3), (7, 10), (64, 52)]  # (rows per block, vocabulary columns per tile)


@pytest.mark.parametrize("blocks", TILES)
def test_stats_from_vocabulary_tiles(monkeypatch, blocks):
    """low_memory's vocabulary tiles (forced small): the online log-sum-exp with a running max
    that moves (large biases), argmax ties across tiles broken to the first column, the target
    logit found in its tile, the loss and its gradients."""
    monkeypatch.setattr(reference, "block_shape", lambda *args: blocks)
    torch.manual_seed(torch.seed() % 2**31)
    x = torch.randn(11, 6, dtype=torch.float64, requires_grad=True)
    W = torch.randn(53, 6, dtype=torch.float64) * 3
    b = torch.randn(53, dtype=torch.float64) * 40
    W[[31, 5, 49]] = 0.0
    b[[31, 5, 49]] = 400.0  # classes 5, 31 and 49 tie for the max of every row
    t = torch.randint(0, 53, (11,))
    t[2], t[6] = -100, 49
    s = fused_ce.linear_cross_entropy(x, W, t, linear_bias=b, reduction="none", low_memory=True,
                                      return_stats=True)
    z = logits64(x, W, b)
    valid = t != -100
    assert rel_err(s.lse[valid], torch.logsumexp(z, -1)[valid]) < 1e-13
    assert (s.predicted[valid] == 5).all() and (s.predicted[~valid] == -100).all()
    assert not s.correct[6]
    want = cross_entropy64(x, W, t, bias=b, reduction="none")
    assert rel_err(s.loss, want) < 1e-13
    g = torch.rand(11, dtype=torch.float64)
    assert rel_err(torch.autograd.grad(s.loss, x, g)[0], torch.autograd.grad(want, x, g)[0]) < 1e-12


@pytest.mark.parametrize("blocks", TILES)
@pytest.mark.parametrize("column,value", [(12, float("nan")), (40, float("inf")),
                                          (7, float("-inf")), (None, float("-inf"))])
def test_non_finite_logits_in_vocabulary_tiles(monkeypatch, blocks, column, value):
    """A NaN or infinite logit in one tile reaches the row's lse, argmax and loss as in torch
    (column None: every logit is -inf)."""
    monkeypatch.setattr(reference, "block_shape", lambda *args: blocks)
    torch.manual_seed(torch.seed() % 2**31)
    x = torch.randn(9, 6, dtype=torch.float64)
    W = torch.randn(53, 6, dtype=torch.float64)
    b = torch.randn(53, dtype=torch.float64) * 40
    if column is None:
        b[:] = value
    else:
        b[column] = value
    t = torch.randint(0, 53, (9,))
    t[4] = -100
    s = fused_ce.linear_cross_entropy(x, W, t, linear_bias=b, reduction="none", low_memory=True,
                                      return_stats=True)
    z = logits64(x, W, b)
    valid = t != -100
    torch.testing.assert_close(s.lse[valid], torch.logsumexp(z, -1)[valid], equal_nan=True,
                               rtol=1e-13, atol=0)
    assert torch.equal(s.predicted[valid], z.argmax(-1)[valid])
    want = cross_entropy64(x, W, t, bias=b, reduction="none")
    # (a confident row's loss lse - z_t is a cancellation of logits of ~100: fp64 ulps of those)
    torch.testing.assert_close(s.loss, want, equal_nan=True, rtol=1e-13, atol=1e-12)
