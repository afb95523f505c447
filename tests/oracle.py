"""The fp64 PyTorch oracle every numeric test compares against."""

import torch
import torch.nn.functional as F


def logits64(x, weight, bias=None, softcap=None, dtype=torch.float64):
    z = F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z


def cross_entropy64(x, weight, target, bias=None, class_weight=None, reduction="mean",
                    ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None,
                    dtype=torch.float64):
    """``F.cross_entropy`` of the explicit logits in ``dtype`` (fp64: the oracle; the inputs'
    own dtype: what eager PyTorch gets), plus the z-loss term."""
    z = logits64(x, weight, bias, softcap, dtype)
    flat = z.reshape(-1, z.shape[-1])
    t = target.reshape(-1).long()
    cw = None if class_weight is None else class_weight.to(dtype)
    loss = F.cross_entropy(flat, t, weight=cw, reduction=reduction, ignore_index=ignore_index,
                           label_smoothing=label_smoothing)
    if z_loss:
        valid = t != ignore_index
        zl = z_loss * torch.logsumexp(flat, -1) ** 2 * valid
        if reduction == "mean":
            zl = zl.sum() / valid.sum()
        elif reduction == "sum":
            zl = zl.sum()
        loss = loss + zl
    return loss.reshape(target.shape) if reduction == "none" else loss


def rel_err(got, want):
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def near_oracle(got, want, eager, tol, atol=1e-30):
    """CCE's criterion: our error against the fp64 oracle is within a few times eager PyTorch's
    error in the same dtype, plus ``tol`` relative and ``atol`` absolute. (A loss of 1e-18 is 0
    in fp32 for everyone.) Returns (holds, our error, eager's error, |want|), Frobenius norms."""
    err = (got.double() - want.double()).norm().item()
    base = (eager.double() - want.double()).norm().item()
    scale = want.double().norm().item()
    return err <= 4 * base + tol * scale + atol, err, base, scale


def assert_close(got, want, eager, tol, atol=1e-30):
    """``near_oracle`` as an assertion."""
    ok, err, base, scale = near_oracle(got, want, eager, tol, atol)
    assert ok, (err, base, scale)


def assert_prepared_targets_change_nothing(x, w, b, t):
    """fused_ce.linear_cross_entropy with ``prepare_targets`` (made before the call, its scan
    real, not a no-op) gives bitwise the loss and gradients of the call without it."""
    import fused_ce

    params = [p.requires_grad_() for p in (x, w, b)]

    def run(prepared):
        for p in params:
            p.grad = None
        loss = fused_ce.linear_cross_entropy(x, w, t, linear_bias=b, prepared_targets=prepared)
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in params]

    prepared = fused_ce.prepare_targets(t, w.shape[0])
    assert prepared.scan is not None
    for got, exp in zip(run(prepared), run(None)):
        assert torch.equal(got, exp)


def assert_grads_rounded_once(backend, monkeypatch, x, w, b, t, k, low_memory=False):
    """``linear_cross_entropy(...) * k`` backpropagated: its gradients are bitwise what the
    backend's forward computed for an upstream gradient of 1 (recorded as it returns them),
    times k in fp32 and rounded once into the parameters' dtypes (ops.linear_ce_sum). Returns
    the dtypes the backend gave them (16-bit: rounded in its forward; fp32: unrounded)."""
    import fused_ce

    seen = []
    forward = backend.forward

    def recording(*args, **kwargs):
        stats = forward(*args, **kwargs)
        seen.append([None if g is None else g.clone() for g in (stats.dx, stats.dw, stats.db)])
        return stats

    monkeypatch.setattr(backend, "forward", recording)
    ps = [p.clone().requires_grad_() for p in (x, w, b)]
    loss = fused_ce.linear_cross_entropy(ps[0], ps[1], t, linear_bias=ps[2],
                                         low_memory=low_memory)
    (loss * k).backward()
    assert len(seen) == 1
    # 'mean' (without low_memory) is the op's sum over the valid rows divided by their count
    # (api._coefficients): autograd hands the op k / count, which it multiplies in once
    up = torch.tensor(k, dtype=torch.float32)
    if not low_memory:
        up = up / (t != -100).sum().to(torch.float32)
    for p, g in zip(ps, seen[0]):
        want = (g.to(torch.promote_types(g.dtype, torch.float32)) * up).to(p.dtype)
        assert p.grad.dtype == p.dtype and torch.equal(p.grad, want)
    return [g.dtype for g in seen[0]]
