"""The fp64 PyTorch oracle every numeric test compares against."""

import torch
import torch.nn.functional as F

from fused_ce import reference


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
    backend computed, with k applied before their one rounding. Without ``low_memory``: the
    backend's forward computed them for an upstream gradient of 1 (recorded as it returns
    them), and they are that times k / count ('mean' is the op's sum over the valid rows
    divided by their count afterwards, api._coefficients) in fp32, rounded once into the
    parameters' dtypes (ops.linear_ce_sum). With ``low_memory``: the backend's backward
    computed them from coefficients that carry k / count on every valid row (0 elsewhere), and
    they arrive as it returned them. Returns the dtypes the backend gave them (without
    ``low_memory``: fp32, unrounded, for 16-bit parameters)."""
    import fused_ce

    seen, seen_coefs = [], []
    stage = "backward" if low_memory else "forward"
    call = getattr(backend, stage)

    def recording(*args, **kwargs):
        out = call(*args, **kwargs)
        grads = (out.dx, out.dw, out.db) if stage == "forward" else out
        if stage == "forward" and out.dx_rows is not None:  # the valid rows only
            grads = (reference.scatter_rows(out.dx, out.dx_rows), *grads[1:])
        seen.append([None if g is None else g.clone() for g in grads])
        if stage == "backward":
            seen_coefs.append(args[8])  # (x, w, b, t, ignore_index, softcap, cw, lse, coefs)
        return out

    monkeypatch.setattr(backend, stage, recording)
    ps = [p.clone().requires_grad_() for p in (x, w, b)]
    loss = fused_ce.linear_cross_entropy(ps[0], ps[1], t, linear_bias=ps[2],
                                         low_memory=low_memory)
    (loss * k).backward()
    assert len(seen) == 1
    valid = t != -100
    up = torch.tensor(k, dtype=torch.float32) / valid.sum().to(torch.float32)
    if low_memory:
        want = torch.where(valid, up, 0.0)
        assert torch.equal(seen_coefs[0].target.float(), want)
        for p, g in zip(ps, seen[0]):
            assert p.grad.dtype == p.dtype and torch.equal(p.grad, g)
    else:
        for p, g in zip(ps, seen[0]):
            want = (g.to(torch.promote_types(g.dtype, torch.float32)) * up).to(p.dtype)
            assert p.grad.dtype == p.dtype and torch.equal(p.grad, want)
    return [g.dtype for g in seen[0]]


def eager_and_custom_op_grads(monkeypatch, x, w, b, t, k):
    """The gradients of ``linear_cross_entropy(x, w, t, linear_bias=b) * k`` by the eager route
    (ops.py's autograd.Function) and by the custom op (torch.compile's route), in that order."""
    import fused_ce
    from fused_ce import ops

    def grads(eager):
        monkeypatch.setattr(ops, "_plain_eager", lambda *a: eager)
        ps = [p.clone().requires_grad_() for p in (x, w, b)]
        (fused_ce.linear_cross_entropy(ps[0], ps[1], t, linear_bias=ps[2]) * k).backward()
        return [p.grad for p in ps]

    return grads(True), grads(False)
