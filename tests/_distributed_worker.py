"""Multi-process worker for tests/test_distributed.py (gloo, CPU).

Run as a script, never inside pytest's own process::

    python tests/_distributed_worker.py --seed 1234 --out results.json

It forks 4 ranks (spawn where fork is unavailable) that run every case of ``build_cases()`` in the
same order: vocab-parallel cases on sub-groups of 2 ranks (0-1) and 3 ranks (0-2) while the others
wait; DTensor, DDP and FSDP2 cases on all 4, the 2-D case on a (dp=2, tp=2) mesh,
and writes ``{case: {"ok": bool, "msg": str, "seconds": float}}`` to ``--out``. Every numeric case
compares against the fp64 oracle of tests/oracle.py on fresh random inputs derived from ``--seed``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import fused_ce  # noqa: E402
from fused_ce import distributed as fdist  # noqa: E402
from tests.oracle import cross_entropy64, logits64, near_oracle, rel_err  # noqa: E402

WORLD = 4
G2, G3, G4 = "g2", "g3", "g4"  # ranks 0-1 / ranks 0-2 / all four


class CaseFailure(AssertionError):
    pass


# Failed expectations of the running case. They are collected rather than raised so that a rank
# whose check fails still joins the collectives that follow (otherwise its peers would hang).
_FAILS: list = []


def expect(cond, msg):
    if not cond:
        _FAILS.append(msg)


def expect_near_oracle(name, got, want, eager, tol):
    """tests/oracle.py's near_oracle (eager: PyTorch on the explicit logits in the inputs'
    dtype; for fp64 inputs the oracle itself, so the bound is tol alone)."""
    ok, diff, base, scale = near_oracle(got, want, eager, tol, atol=0.0)
    expect(ok and math.isfinite(diff), f"{name}: |got - want| = {diff:.3e} > 4 * |eager - want| ({base:.3e}) + "
               f"{tol:.1e} * |want| ({scale:.3e})")


def expect_close(name, got, want, tol, atol=0.0):
    """``|got - want| <= tol * |want| + atol`` (Frobenius norms)."""
    if got is None or want is None:
        expect(got is None and want is None, f"{name}: got {got is None=}, want {want is None=}")
        return
    diff = (got.double() - want.double()).norm().item()
    scale = want.double().norm().item()
    ok = math.isfinite(diff) and diff <= tol * scale + atol
    expect(ok, f"{name}: |got - want| = {diff:.3e} > {tol:.1e} * |want| ({scale:.3e}) + {atol:.1e}")


# --------------------------------------------------------------------------- problem generation

def _gen(seed):
    return torch.Generator().manual_seed(seed)


def uneven_sizes(g, world, vocab_min=20):
    """Uneven positive shard sizes, one at least twice another."""
    sizes = [int(torch.randint(1, 9, (), generator=g)) + 3 * r for r in range(world)]
    perm = torch.randperm(world, generator=g).tolist()
    sizes = [sizes[p] for p in perm]
    while sum(sizes) < vocab_min:
        sizes[int(torch.randint(0, world, (), generator=g))] += 5
    return sizes


def make_problem(seed, sizes, *, shape=(3, 7), hidden=24, bias=True, class_weight=False,
                 ignore_index=-100, ignore_frac=0.2, dtype=torch.float32):
    g = _gen(seed)
    vocab = sum(sizes)
    x = torch.randn(*shape, hidden, generator=g, dtype=torch.float64).to(dtype)
    W = (torch.randn(vocab, hidden, generator=g, dtype=torch.float64) * 2.5 / hidden ** 0.5).to(dtype)
    b = torch.randn(vocab, generator=g, dtype=torch.float64).to(dtype) if bias else None
    t = torch.randint(0, vocab, shape, generator=g)
    # targets on every shard boundary (first and last row of each shard)
    edges, off = [], 0
    for s in sizes:
        edges += [off, off + s - 1]
        off += s
    flat = t.view(-1)
    k = min(len(edges), flat.numel())
    flat[:k] = torch.tensor(edges[:k])
    drop = torch.rand(shape, generator=g) < ignore_frac
    t[drop] = ignore_index
    cw = (torch.rand(vocab, generator=g, dtype=torch.float64) + 0.5).to(dtype) if class_weight else None
    g_up = torch.randn(shape, generator=g, dtype=torch.float64)
    return x, W, b, t, cw, g_up


def shard(t, sizes, r):
    if t is None:
        return None
    off = sum(sizes[:r])
    return t[off:off + sizes[r]].clone()


def all_equal_across(group, tensor):
    """True if ``tensor`` is bitwise identical on every rank of ``group``."""
    ws = dist.get_world_size(group)
    out = [torch.empty_like(tensor) for _ in range(ws)]
    dist.all_gather(out, tensor.contiguous(), group=group)
    as_bytes = lambda u: u.reshape(-1).view(torch.uint8) if u.is_floating_point() else u  # noqa: E731
    return all(torch.equal(as_bytes(o), as_bytes(out[0])) for o in out)


# --------------------------------------------------------------------------- vocab-parallel cases

def run_vp(ctx, *, seed, dtype=torch.float32, reduction="mean", bias=True, class_weight=False,
           label_smoothing=0.0, z_loss=0.0, softcap=None, ignore_index=-100, ignore_frac=0.2,
           return_stats=False, low_memory=False, shape=(3, 7), hidden=24, int32=False,
           via_module=False):
    group, r, ws = ctx["group"], ctx["rank"], ctx["world"]
    g = _gen(seed)
    sizes = uneven_sizes(g, ws)
    x, W, b, t, cw, g_up = make_problem(seed + 1, sizes, shape=shape, hidden=hidden, bias=bias,
                                        class_weight=class_weight, ignore_index=ignore_index,
                                        ignore_frac=ignore_frac, dtype=dtype)
    if int32:
        t = t.int()
    xr = x.clone().requires_grad_()
    Wr = shard(W, sizes, r).requires_grad_()
    br = None if b is None else shard(b, sizes, r).requires_grad_()
    opts = dict(weight=cw, reduction=reduction, ignore_index=ignore_index,
                label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                low_memory=low_memory, return_stats=return_stats)
    if via_module:
        w_opt = opts.pop("weight")
        mod = fused_ce.FusedCrossEntropy(w_opt, ignore_index=opts.pop("ignore_index"),
                                         reduction=opts.pop("reduction"),
                                         label_smoothing=opts.pop("label_smoothing"),
                                         z_loss=opts.pop("z_loss"), softcap=opts.pop("softcap"),
                                         low_memory=opts.pop("low_memory"),
                                         return_stats=opts.pop("return_stats"),
                                         process_group=group)
        out = mod(xr, Wr, t, br)
    else:
        out = fused_ce.linear_cross_entropy(xr, Wr, t, linear_bias=br, process_group=group, **opts)
    loss = out.loss if return_stats else out
    up = g_up.to(loss.dtype) if reduction == "none" else g_up.view(-1)[0].to(loss.dtype)
    (loss * up).sum().backward()

    x64 = x.double().requires_grad_()
    W64 = W.double().requires_grad_()
    b64 = None if b is None else b.double().requires_grad_()
    ref = cross_entropy64(x64, W64, t, bias=b64, class_weight=None if cw is None else cw.double(),
                          reduction=reduction, ignore_index=ignore_index,
                          label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)
    (ref * up.double()).sum().backward()
    # eager PyTorch in the inputs' dtype: the rounding no implementation in that dtype avoids
    xe, We = (t_.detach().clone().requires_grad_() for t_ in (x, W))
    be = None if b is None else b.detach().clone().requires_grad_()
    eager = cross_entropy64(xe, We, t, bias=be, class_weight=cw, reduction=reduction,
                            ignore_index=ignore_index, label_smoothing=label_smoothing,
                            z_loss=z_loss, softcap=softcap, dtype=dtype)
    (eager * up.to(eager.dtype)).sum().backward()

    tol = 1e-11 if dtype == torch.float64 else 2e-5
    expect(loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32),
           f"loss dtype {loss.dtype}")
    expect(tuple(loss.shape) == tuple(ref.shape), f"loss shape {tuple(loss.shape)} != {tuple(ref.shape)}")
    expect_near_oracle("loss", loss.detach(), ref.detach(), eager.detach(), tol)
    expect_near_oracle("input.grad", xr.grad, x64.grad, xe.grad, tol)
    expect_near_oracle("weight.grad (this shard's rows)", Wr.grad, shard(W64.grad, sizes, r),
                       shard(We.grad, sizes, r), tol)
    if b is not None:
        expect_near_oracle("bias.grad (this shard's rows)", br.grad, shard(b64.grad, sizes, r),
                           shard(be.grad, sizes, r), tol)
    expect(xr.grad.dtype == dtype and Wr.grad.dtype == dtype, "gradient dtypes")
    expect(all_equal_across(group, loss.detach()), "loss differs between ranks")
    expect(all_equal_across(group, xr.grad), "input.grad differs between ranks")

    if return_stats:
        z = logits64(x64.detach(), W64.detach(), None if b64 is None else b64.detach(), softcap)
        z = z.reshape(-1, z.shape[-1])
        tf = t.reshape(-1).long()
        valid = tf != ignore_index
        lse = out.lse.reshape(-1)
        expect(tuple(out.lse.shape) == tuple(t.shape), "stats.lse shape")
        if valid.any():
            expect_close("stats.lse", lse[valid], torch.logsumexp(z, -1)[valid], tol)
        expect(bool((lse[~valid] == 0).all()), "stats.lse not 0 on ignored rows")
        pred = out.predicted.reshape(-1)
        top2 = z.topk(2, -1).values
        clear = valid & ((top2[:, 0] - top2[:, 1]) > 1e-4)
        expect(torch.equal(pred[clear], z.argmax(-1)[clear]), "stats.predicted != oracle argmax")
        expect(bool((pred[~valid] == ignore_index).all()), "stats.predicted on ignored rows")
        expect(torch.equal(out.correct.reshape(-1), (pred == tf) & valid), "stats.correct")
        nvalid = int(valid.sum())
        want_acc = ((z.argmax(-1) == tf) & valid).sum().item() / nvalid if nvalid else math.nan
        got_acc = out.accuracy.item()
        expect((math.isnan(want_acc) and math.isnan(got_acc)) or abs(got_acc - want_acc) < 1e-6 or
               not bool(clear[valid].all()), f"stats.accuracy {got_acc} != {want_acc}")
        if z_loss:
            zl = z_loss * torch.logsumexp(z, -1) ** 2 * valid
            zl = zl.reshape(t.shape) if reduction == "none" else (
                zl.sum() / valid.sum() if reduction == "mean" else zl.sum())
            expect_close("stats.z_loss", out.z_loss, zl, tol)
        else:
            expect(out.z_loss is None, "stats.z_loss should be None without z_loss")
        expect(all_equal_across(group, out.predicted), "stats.predicted differs between ranks")
        expect(all_equal_across(group, out.lse), "stats.lse differs between ranks")


def case_all_ignored(ctx, seed):
    group, r, ws = ctx["group"], ctx["rank"], ctx["world"]
    sizes = uneven_sizes(_gen(seed), ws)
    x, W, b, t, _, _ = make_problem(seed, sizes, ignore_frac=1.0)
    for reduction in ("mean", "sum", "none"):
        xr = x.clone().requires_grad_()
        Wr = shard(W, sizes, r).requires_grad_()
        br = shard(b, sizes, r).requires_grad_()
        s = fused_ce.linear_cross_entropy(xr, Wr, t, linear_bias=br, reduction=reduction,
                                          label_smoothing=0.1, z_loss=1e-3, return_stats=True,
                                          process_group=group)
        ref = cross_entropy64(x, W, t, bias=b, reduction=reduction, label_smoothing=0.1, z_loss=1e-3)
        if reduction == "mean":
            expect(math.isnan(s.loss.item()) and math.isnan(ref.item()), "mean over no tokens: nan")
        else:
            expect(bool((s.loss == 0).all()) and bool((ref == 0).all()), f"{reduction}: zeros")
        s.loss.sum().backward()
        for name, grad in (("input", xr.grad), ("weight", Wr.grad), ("bias", br.grad)):
            expect(grad is not None and bool((grad == 0).all()), f"{reduction}: {name}.grad not 0")
        expect(bool((s.predicted == -100).all()) and math.isnan(s.accuracy.item()), "stats")


def case_argmax_ties(ctx, seed):
    """Integer-valued inputs make logits tie exactly; the global argmax must be the lowest global
    index, also when the tie spans shards."""
    group, r, ws = ctx["group"], ctx["rank"], ctx["world"]
    sizes = uneven_sizes(_gen(seed), ws)
    vocab, hidden = sum(sizes), 6
    g = _gen(seed + 1)
    x = torch.randint(-2, 3, (10, hidden), generator=g).double()
    W = torch.randint(-1, 2, (vocab, hidden), generator=g).double()
    offs = [sum(sizes[:i]) for i in range(ws)]
    ends = [o + s - 1 for o, s in zip(offs, sizes)]
    # rows 0..2: the top class appears at the end of shard 0 and in later shards
    W[ends[0]] = W[offs[1]] = 5.0
    W[ends[-1]] = 5.0
    t = torch.randint(0, vocab, (10,), generator=g)
    t[3] = -100
    x[:3] = 1.0
    s = fused_ce.linear_cross_entropy(x, shard(W, sizes, r), t, return_stats=True,
                                      process_group=group)
    z = logits64(x, W)
    want = z.argmax(-1)
    want[3] = -100
    expect(torch.equal(s.predicted, want), f"predicted {s.predicted.tolist()} != {want.tolist()}")
    expect(bool((s.predicted[:3] == ends[0]).all()), "tie across shards not broken to lowest index")
    expect_close("loss", s.loss, cross_entropy64(x, W, t), 1e-12)
    # NaN logits count as the maximum (torch.argmax), here in the second shard for every row
    W[offs[1]] = math.nan
    s = fused_ce.linear_cross_entropy(x, shard(W, sizes, r), t, return_stats=True,
                                      process_group=group)
    want = logits64(x, W).argmax(-1)
    want[3] = -100
    expect(torch.equal(s.predicted, want) and bool((want[torch.arange(10) != 3] == offs[1]).all()),
           f"predicted with a NaN logit {s.predicted.tolist()} != {want.tolist()}")
    expect(math.isnan(s.loss.item()), "NaN logits give a NaN loss")


def case_zero_rows(ctx, seed):
    group, r, ws = ctx["group"], ctx["rank"], ctx["world"]
    sizes = uneven_sizes(_gen(seed), ws)
    W = torch.randn(sum(sizes), 8, dtype=torch.float64)
    x = torch.randn(0, 8, dtype=torch.float64, requires_grad=True)
    t = torch.zeros(0, dtype=torch.long)
    Wr = shard(W, sizes, r).requires_grad_()
    loss = fused_ce.linear_cross_entropy(x, Wr, t, process_group=group)
    expect(math.isnan(loss.item()), "mean over zero rows is nan")
    loss.backward()
    expect(x.grad.shape == (0, 8) and bool((Wr.grad == 0).all()), "zero-row grads")
    loss = fused_ce.linear_cross_entropy(x, Wr, t, reduction="sum", process_group=group)
    expect(loss.item() == 0.0, "sum over zero rows is 0")


def case_no_input_grad_reduction(ctx, seed):
    """VocabParallel(group, reduce_input_grad=False) through FusedCrossEntropy: each rank gets its
    shard's partial input gradient; their sum is the complete gradient."""
    group, r, ws = ctx["group"], ctx["rank"], ctx["world"]
    sizes = uneven_sizes(_gen(seed), ws)
    x, W, b, t, cw, _ = make_problem(seed + 1, sizes, class_weight=True, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    Wr = shard(W, sizes, r).requires_grad_()
    mod = fused_ce.FusedCrossEntropy(cw, label_smoothing=0.1, z_loss=1e-3, softcap=4.0,
                                     process_group=fdist.VocabParallel(group, reduce_input_grad=False))
    loss = mod(xr, Wr, t, shard(b, sizes, r))
    loss.backward()
    x64 = x.clone().requires_grad_()
    ref = cross_entropy64(x64, W, t, bias=b, class_weight=cw, label_smoothing=0.1, z_loss=1e-3,
                          softcap=4.0)
    ref.backward()
    expect_close("loss", loss, ref, 1e-11)
    expect(rel_err(xr.grad, x64.grad) > 1e-3, "partial input.grad should not be the full gradient")
    total = xr.grad.clone()
    dist.all_reduce(total, group=group)
    expect_close("sum over ranks of partial input.grad", total, x64.grad, 1e-11)
    expect_close("weight.grad", Wr.grad, shard(W64_grad(x, W, b, t, cw), sizes, r), 1e-11)


def W64_grad(x, W, b, t, cw):
    W64 = W.double().clone().requires_grad_()
    cross_entropy64(x.double(), W64, t, bias=b.double(), class_weight=cw.double(),
                    label_smoothing=0.1, z_loss=1e-3, softcap=4.0).backward()
    return W64.grad


def case_autocast_bf16(ctx, seed):
    group, r, ws = ctx["group"], ctx["rank"], ctx["world"]
    sizes = uneven_sizes(_gen(seed), ws)
    x, W, b, t, _, _ = make_problem(seed + 1, sizes, hidden=40)
    xr = x.clone().requires_grad_()
    Wr = shard(W, sizes, r).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fused_ce.linear_cross_entropy(xr, Wr, t, linear_bias=shard(b, sizes, r),
                                             process_group=group)
    loss.backward()
    x64 = x.double().requires_grad_()
    ref = cross_entropy64(x64, W, t, bias=b)
    ref.backward()
    expect(loss.dtype == torch.float32 and Wr.grad.dtype == torch.float32, "autocast dtypes")
    expect_close("loss (bf16 autocast)", loss, ref, 2e-2)
    expect_close("input.grad (bf16 autocast)", xr.grad, x64.grad, 3e-2)


def case_dtensor(ctx, seed):
    """DTensor Shard(0) weight and bias over a 1-D mesh (uneven: torch.chunk split), replicated
    DTensor input; gradients come back as DTensors with the same placements."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    ws, mesh = ctx["world"], ctx["mesh"]
    vocab = 3 * ws + 2  # not divisible by ws
    g = _gen(seed)
    x = torch.randn(4, 5, 16, generator=g, dtype=torch.float64)
    W = torch.randn(vocab, 16, generator=g, dtype=torch.float64)
    b = torch.randn(vocab, generator=g, dtype=torch.float64)
    t = torch.randint(0, vocab, (4, 5), generator=g)
    t[0, :2] = -100
    cw = torch.rand(vocab, generator=g, dtype=torch.float64) + 0.5
    opts = dict(weight=cw, label_smoothing=0.2, z_loss=1e-3, softcap=5.0)
    x64 = x.clone().requires_grad_()
    W64 = W.clone().requires_grad_()
    b64 = b.clone().requires_grad_()
    ref = cross_entropy64(x64, W64, t, bias=b64, class_weight=cw, label_smoothing=0.2,
                          z_loss=1e-3, softcap=5.0)
    ref.backward()
    for pg, input_dt in ((None, False), (mesh, True)):
        Wd = nn.Parameter(distribute_tensor(W.clone(), mesh, [Shard(0)]))
        bd = nn.Parameter(distribute_tensor(b.clone(), mesh, [Shard(0)]))
        if input_dt:
            xin = nn.Parameter(distribute_tensor(x.clone(), mesh, [Replicate()]))
        else:
            xin = x.clone().requires_grad_()
        loss = fused_ce.linear_cross_entropy(xin, Wd, t, linear_bias=bd, process_group=pg, **opts)
        loss.backward()
        expect_close(f"loss (process_group={pg})", loss, ref, 1e-11)
        for name, p, want, pl in (("linear_weight", Wd, W64.grad, (Shard(0),)),
                                  ("linear_bias", bd, b64.grad, (Shard(0),))):
            expect(isinstance(p.grad, DTensor) and tuple(p.grad.placements) == pl,
                   f"{name}.grad: expected a DTensor {pl}, got {type(p.grad).__name__} "
                   f"{getattr(p.grad, 'placements', None)}")
            expect_close(f"{name}.grad", p.grad.full_tensor(), want, 1e-11)
        xg = xin.grad.full_tensor() if input_dt else xin.grad
        expect_close("input.grad", xg, x64.grad, 1e-11)


def case_errors(ctx, seed):
    """Clear errors naming the argument; every rank raises the same error (nobody hangs)."""
    group, r, ws = ctx["group"], ctx["rank"], ctx["world"]
    sizes = uneven_sizes(_gen(seed), ws)
    x, W, b, t, cw, _ = make_problem(seed + 1, sizes, class_weight=True)
    Wr, br = shard(W, sizes, r), shard(b, sizes, r)

    def raises(exc, words, fn):
        try:
            fn()
        except exc as e:
            msg = str(e)
            for w in words:
                expect(w in msg, f"error message {msg!r} lacks {w!r}")
            return
        except Exception as e:  # noqa: BLE001
            expect(False, f"expected {exc.__name__} with {words}, got {type(e).__name__}: {e}")
            return
        expect(False, f"expected {exc.__name__} with {words}, nothing raised")

    lce = fused_ce.linear_cross_entropy
    vocab = sum(sizes)
    # class weights given as this rank's shard instead of the full vector
    raises(ValueError, ["weight", f"({vocab},)", "full vector"],
           lambda: lce(x, Wr, t, linear_bias=br, weight=shard(cw, sizes, r), process_group=group))
    # different targets on different ranks (e.g. data-parallel batches)
    t_odd = t.clone()
    t_odd.view(-1)[0] = (int(t.view(-1)[0]) + 1 + r) % vocab
    raises(ValueError, ["target", "same tensor on every rank"],
           lambda: lce(x, Wr, t_odd, linear_bias=br, process_group=group))
    # different row counts
    n = 3 + (r % 2)
    raises(ValueError, ["input", "rows"],
           lambda: lce(x.reshape(-1, x.shape[-1])[:n], Wr, t.reshape(-1)[:n], linear_bias=br,
                       process_group=group))
    # different options
    raises(ValueError, ["label_smoothing: expected the same value on every rank", "ranks [1"],
           lambda: lce(x, Wr, t, linear_bias=br, label_smoothing=0.1 * (r > 0), process_group=group))
    raises(ValueError, ["reduction: expected the same value", f"rank {r} has"],
           lambda: lce(x, Wr, t, linear_bias=br, reduction="sum" if r else "mean",
                       process_group=group))
    raises(ValueError, ["linear_bias is None: expected the same value"],
           lambda: lce(x, Wr, t, linear_bias=br if r else None, process_group=group))
    # a different dtype on one rank: named, not a collective of mismatched sizes
    raises(ValueError, ["the dtype of input, linear_weight and linear_bias", "torch.float"],
           lambda: lce(x.double() if r else x, Wr.double() if r else Wr, t,
                       linear_bias=br.double() if r else br, process_group=group))
    # a global target id out of range
    t_bad = t.clone()
    t_bad.view(-1)[1] = vocab
    raises(ValueError, ["target", f"[0, {vocab})", str(vocab)],
           lambda: lce(x, Wr, t_bad, linear_bias=br, process_group=group))
    # bias shard that does not match the weight shard
    raises(ValueError, ["linear_bias", f"({sizes[r]},)"],
           lambda: lce(x, Wr, t, linear_bias=torch.randn(sizes[r] + 1), process_group=group))
    raises(TypeError, ["process_group", "ProcessGroup", "int"],
           lambda: lce(x, Wr, t, process_group=7))
    raises(ValueError, ["reduce_input_grad"],
           lambda: fdist.vocab_parallel_cross_entropy(
               x, Wr, t, process_group=fdist.VocabParallel(group, reduce_input_grad=False),
               reduce_input_grad=True))
    if "mesh" in ctx:  # a replicated DTensor head is not a vocab shard
        from torch.distributed.tensor import Replicate, distribute_tensor
        Wd = distribute_tensor(W.clone(), ctx["mesh"], [Replicate()])
        raises(ValueError, ["linear_weight", "Shard(dim=0)", "Replicate"],
               lambda: lce(x, Wd, t, process_group=ctx["mesh"]))
    # after all of that the group still works
    loss = lce(x, Wr, t, linear_bias=br, weight=cw, process_group=group)
    expect_close("loss after errors", loss, cross_entropy64(x, W, t, bias=b, class_weight=cw), 2e-5)


# --------------------------------------------------------------------------- DDP / FSDP2

class TinyLM(nn.Module):
    """Embedding -> 2 residual MLP blocks -> head; the loss is computed inside the head module's
    forward (so FSDP2 has unsharded the head's parameters when it is read)."""

    def __init__(self, vocab, hidden, tied=False, bias=True):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, hidden),
                                                  nn.Tanh()) for _ in range(2))
        self.head = LossHead(hidden, vocab, bias)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids, labels, fused=True, **loss_kw):
        h = self.embed(ids)
        for blk in self.blocks:
            h = h + blk(h)
        return self.head(h, labels, fused, **loss_kw)


class LossHead(nn.Module):
    def __init__(self, hidden, vocab, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, hidden) / hidden ** 0.5)
        self.bias = nn.Parameter(torch.randn(vocab) * 0.5) if bias else None

    def forward(self, h, labels, fused=True, **kw):
        if fused:
            return fused_ce.linear_cross_entropy(h, self.weight, labels, linear_bias=self.bias, **kw)
        kw = dict(kw)
        return cross_entropy64(h, self.weight, labels, bias=self.bias,
                               class_weight=kw.pop("weight", None), **kw)


def _lm_batch(seed, vocab, batch, seq, ignore_frac):
    g = _gen(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[torch.rand(batch, seq, generator=g) < ignore_frac] = -100
    return ids, labels


def _oracle_grads(model, ids, labels, **kw):
    """Loss and gradients of ``model`` (an fp64 copy) with the explicit-logits fp64 loss."""
    model.zero_grad()
    loss = model(ids, labels, fused=False, **kw)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def case_ddp(ctx, seed):
    """DDP over 3 ranks, each with a third of the global batch, equals single-process fp64 training
    on the global batch: (a) 'mean' with all tokens valid; (b) ignored tokens, with the global-count
    normalization documented in docs/distributed.md."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    group, r, ws = ctx["group"], ctx["rank"], ctx["world"]
    vocab, hidden = 29, 16
    for tied, ignore_frac in ((False, 0.0), (True, 0.3)):
        torch.manual_seed(seed)
        base = TinyLM(vocab, hidden, tied=tied)
        ids, labels = _lm_batch(seed + 1, vocab, 2 * ws, 5, ignore_frac)
        oracle = TinyLM(vocab, hidden, tied=tied).double()
        oracle.load_state_dict(base.state_dict())
        ref_loss, ref_grads = _oracle_grads(oracle, ids, labels)
        model = DDP(base, process_group=group)
        mine = slice(2 * r, 2 * r + 2)
        if ignore_frac == 0:
            loss = model(ids[mine], labels[mine])
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss, group=group)
            global_loss /= ws
        else:
            n_valid = (labels[mine] != -100).sum().double()
            dist.all_reduce(n_valid, group=group)
            loss = model(ids[mine], labels[mine], reduction="sum") / n_valid * ws
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss, group=group)
            global_loss /= ws
        loss.backward()
        expect_close(f"DDP loss (tied={tied})", global_loss, ref_loss, 2e-6)
        for n, p in base.named_parameters():
            expect_close(f"DDP grad {n} (tied={tied})", p.grad, ref_grads[n], 2e-5)


def case_fsdp2(ctx, seed):
    """FSDP2 (fully_shard) on CPU/gloo over 3 ranks, data parallel: (a) untied, every block and the
    head its own unit; (b) tied embeddings (the shared weight in the root unit). Loss and full
    gradients equal the unsharded fp64 model on the global batch."""
    from torch.distributed.fsdp import fully_shard
    ws, r, mesh = ctx["world"], ctx["rank"], ctx["mesh"]
    vocab, hidden = 31, 16  # 31 rows over 3 ranks: uneven FSDP shards
    for tied in (False, True):
        torch.manual_seed(seed + tied)
        model = TinyLM(vocab, hidden, tied=tied)
        oracle = TinyLM(vocab, hidden, tied=tied).double()
        oracle.load_state_dict(model.state_dict())
        ids, labels = _lm_batch(seed + 2 + tied, vocab, 2 * ws, 6, 0.0)
        ref_loss, ref_grads = _oracle_grads(oracle, ids, labels, label_smoothing=0.1)
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh)
        if not tied:
            fully_shard(model.head, mesh=mesh)
        fully_shard(model, mesh=mesh)
        mine = slice(2 * r, 2 * r + 2)
        for step in range(2):  # the second step reuses FSDP's state
            model.zero_grad()
            loss = model(ids[mine], labels[mine], label_smoothing=0.1)
            loss.backward()
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss)
            global_loss /= ws
            expect_close(f"FSDP2 loss (tied={tied}, step {step})", global_loss, ref_loss, 2e-6)
            for n, p in model.named_parameters():
                expect(type(p.grad).__name__ == "DTensor", f"{n}.grad is not a DTensor")
                expect_close(f"FSDP2 grad {n} (tied={tied}, step {step})", p.grad.full_tensor(),
                             ref_grads[n], 2e-5)
        # The DESIGN pitfall: outside the head's forward its weight is FSDP's Shard(0) DTensor.
        # The loss must refuse it clearly (data-parallel ranks have different targets), on every
        # rank, instead of computing something wrong.
        h = torch.randn(2, 6, hidden)
        try:
            fused_ce.linear_cross_entropy(h, model.head.weight, labels[mine])
            expect(False, "a sharded FSDP weight read outside forward was accepted")
        except ValueError as e:
            expect("target" in str(e) and "FSDP" in str(e), f"unclear error: {e}")


def case_fsdp2_hf_bert(ctx, seed):
    """A tiny HF BERT patched with fused_ce.patch_hf_model, FSDP2-sharded (each layer and the root),
    data parallel over 3 ranks == the unpatched, unsharded fp64 model on the global batch."""
    from torch.distributed.fsdp import fully_shard
    from transformers import BertConfig, BertForMaskedLM
    ws, r, mesh = ctx["world"], ctx["rank"], ctx["mesh"]
    cfg = BertConfig(vocab_size=67, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=48, max_position_embeddings=32, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    torch.manual_seed(seed)
    model = BertForMaskedLM(cfg)
    oracle = BertForMaskedLM(cfg).double()
    oracle.load_state_dict(model.state_dict())
    ids, labels = _lm_batch(seed + 1, cfg.vocab_size, 2 * ws, 8, 0.0)
    labels[:, ::3] = -100  # MLM-like, the same count of valid tokens in every row
    oracle.zero_grad()
    ref = oracle(input_ids=ids, labels=labels).loss
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in oracle.named_parameters() if p.grad is not None}
    fused_ce.patch_hf_model(model)
    for layer in model.bert.encoder.layer:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    mine = slice(2 * r, 2 * r + 2)
    out = model(input_ids=ids[mine], labels=labels[mine])
    expect(out.logits is None, "patched model should not return logits in training")
    out.loss.backward()
    global_loss = out.loss.detach().clone()
    dist.all_reduce(global_loss)
    global_loss /= ws
    expect_close("FSDP2 BERT loss", global_loss, ref.detach(), 2e-6)
    full = {n: p.grad.full_tensor() for n, p in model.named_parameters() if n in ref_grads}
    expect(len(full) == len(ref_grads), f"gradients of {sorted(set(ref_grads) - set(full))} missing")
    # Some gradients are 0 in exact arithmetic (e.g. attention key biases): absolute floor.
    floor = 1e-5 * max(g.norm().item() for g in ref_grads.values())
    for n, g in full.items():
        expect_close(f"FSDP2 BERT grad {n}", g, ref_grads[n], 5e-5, atol=floor)


def case_fsdp2_tp_2d(ctx, seed):
    """2-D parallelism as Lightning's ModelParallelStrategy sets it up: a (dp=2, tp=2) mesh; the
    head's rows are a DTensor Shard(0) over "tp" (vocab-parallel), everything is FSDP2-sharded over
    "dp"; both ranks of a tp group see the same batch. Inside the head's forward the weight is a
    1-D tp DTensor and the loss takes the vocab-parallel path without a process_group argument.
    Loss and every full gradient == the unsharded fp64 model on the global batch."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh2d = ctx["mesh2d"]
    dp, tp = mesh2d["dp"], mesh2d["tp"]
    vocab, hidden = 23, 16  # 23 rows: uneven over tp, then over dp
    torch.manual_seed(seed)
    model = TinyLM(vocab, hidden)
    oracle = TinyLM(vocab, hidden).double()
    oracle.load_state_dict(model.state_dict())
    g = _gen(seed + 1)
    cw = torch.rand(vocab, generator=g) + 0.5
    kw = dict(weight=cw, label_smoothing=0.1, z_loss=1e-3, softcap=5.0)
    ids, labels = _lm_batch(seed + 2, vocab, 4, 6, 0.2)
    labels[:, 0] = 1  # at least one valid token per row
    # Per-dp-rank 'sum' divided by the global class-weight sum of the valid targets: the global
    # batch's normalization whatever the per-rank counts (docs/distributed.md, DDP).
    valid = labels != -100
    denom = cw[labels.clamp(min=0)][valid].sum().double()
    oracle.zero_grad()
    ref = oracle(ids, labels, fused=False, reduction="sum",
                 **dict(kw, weight=cw.double())) / denom
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in oracle.named_parameters()}
    head = model.head
    head.weight = nn.Parameter(distribute_tensor(head.weight.data, tp, [Shard(0)]))
    head.bias = nn.Parameter(distribute_tensor(head.bias.data, tp, [Shard(0)]))
    for blk in model.blocks:
        fully_shard(blk, mesh=dp)
    fully_shard(model.head, mesh=dp)
    fully_shard(model, mesh=dp)
    d = dp.get_local_rank()
    mine = slice(2 * d, 2 * d + 2)
    loss = model(ids[mine], labels[mine], reduction="sum", **kw) / denom.float()
    (loss * 2).backward()  # FSDP averages over the 2 dp ranks
    total = loss.detach().clone()
    dist.all_reduce(total, group=dp.get_group())
    full = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    expect_close("2-D loss", total, ref.detach(), 2e-6)
    for n, grad in full.items():
        expect_close(f"2-D grad {n}", grad, ref_grads[n], 2e-5)


def case_benchmark_script(ctx, seed):
    """benchmarks/vocab_parallel.py's measurement function at its tiny --cpu size on this group
    (smoke test of the 2-GPU script; the numbers it reports against its fp32 reference)."""
    import importlib.util
    path = os.path.join(ROOT, "benchmarks", "vocab_parallel.py")
    spec = importlib.util.spec_from_file_location("_vp_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = bench.parse_args(["--cpu", "--iters", "1", "--warmup", "0", "--seed", str(seed % 2**31)])
    reports = bench.run_benchmark(args, ctx["group"], torch.device("cpu"))
    expect(len(reports) == 2, "one report per rank")
    for rep in reports:
        for name in ("vocab-parallel", "single fused", "eager"):
            expect(math.isfinite(rep[name]["ms"]), f"{name}: time")
            for k, err in rep[name]["rel_err_vs_fp32"].items():
                expect(err < 1e-5, f"rank {rep['rank']} {name} {k}: rel. error {err:.2e} vs fp32")
        for k, err in rep["vocab-parallel vs single fused"].items():
            expect(err < 1e-5, f"rank {rep['rank']} vocab-parallel vs single fused {k}: {err:.2e}")


# --------------------------------------------------------------------------- the case list

def _vp_matrix():
    """(name, kwargs): every option combination in fp32, a rotating subset in fp64."""
    out = []
    combos = itertools.product(("mean", "sum", "none"), (False, True), (0.0, 0.1), (0.0, 1e-3),
                               (None, 6.0), (True, False))
    ignore_cycle = (-100, -1, 0, 5)  # 0 and 5 are valid class ids: those targets are ignored
    for i, (red, cw, ls, zl, cap, bias) in enumerate(combos):
        kw = dict(reduction=red, class_weight=cw, label_smoothing=ls, z_loss=zl, softcap=cap,
                  bias=bias, ignore_index=ignore_cycle[i % 4], return_stats=i % 2 == 0,
                  int32=i % 7 == 3, low_memory=i % 11 == 5)
        name = (f"{red}-cw{int(cw)}-ls{ls}-z{zl}-cap{cap}-bias{int(bias)}-ign{kw['ignore_index']}"
                f"{'-stats' if kw['return_stats'] else ''}")
        out.append((name, kw))
        if i % 3 == 0:
            out.append((name + "-fp64", dict(kw, dtype=torch.float64)))
    out.append(("module-3d-input", dict(via_module=True, shape=(2, 3, 4), class_weight=True,
                                        label_smoothing=0.1, return_stats=True)))
    out.append(("hidden-larger-than-chunks", dict(hidden=160, shape=(5, 3), softcap=3.0)))
    return out


def run_vp_triton(ctx, seed, **kw):
    """run_vp through the Triton kernels (interpreted): the kernels' handling of targets outside
    the local vocabulary ("no target column here") and of the given global lse."""
    old = os.environ.get("FUSED_CE_BACKEND")
    os.environ["FUSED_CE_BACKEND"] = "triton"
    try:
        run_vp(ctx, seed=seed, **kw)
    finally:
        if old is None:
            os.environ.pop("FUSED_CE_BACKEND")
        else:
            os.environ["FUSED_CE_BACKEND"] = old


def build_cases():
    cases = []
    for name, kw in (("cw-ls-none-stats", dict(reduction="none", class_weight=True,
                                                label_smoothing=0.1, return_stats=True)),
                     ("z-cap-sum-ign0-stats", dict(reduction="sum", z_loss=1e-3, softcap=5.0,
                                                   ignore_index=0, return_stats=True, hidden=40))):
        cases.append((f"vp2-triton-interpreter-{name}", G2,
                      lambda ctx, seed, kw=kw: run_vp_triton(ctx, seed, **kw)))
    for gname in (G2, G3):
        for name, kw in _vp_matrix():
            cases.append((f"vp{gname[1]}-{name}", gname,
                          lambda ctx, seed, kw=kw: run_vp(ctx, seed=seed, **kw)))
        for name, fn in (("all-ignored", case_all_ignored), ("argmax-ties", case_argmax_ties),
                         ("zero-rows", case_zero_rows),
                         ("no-input-grad-reduction", case_no_input_grad_reduction),
                         ("autocast-bf16", case_autocast_bf16), ("errors", case_errors)):
            cases.append((f"vp{gname[1]}-{name}", gname, fn))
    cases.append(("benchmark-script-cpu", G2, case_benchmark_script))
    cases.append(("dtensor-shard0", G4, case_dtensor))
    cases.append(("errors-dtensor", G4, case_errors))
    cases.append(("ddp-parity", G4, case_ddp))
    cases.append(("fsdp2-tinylm", G4, case_fsdp2))
    cases.append(("fsdp2-hf-bert-patched", G4, case_fsdp2_hf_bert))
    cases.append(("fsdp2-dp-x-vocab-parallel-tp-2d", G4, case_fsdp2_tp_2d))
    return cases


def _hf_available():
    try:
        import transformers  # noqa: F401
        from fused_ce.integrations import hf  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


def case_names():
    return [name for name, _, _ in build_cases()]


# --------------------------------------------------------------------------- process plumbing

def _rank_main(rank, world, init_file, seed, out_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    from torch.distributed.device_mesh import init_device_mesh
    assert world == 4, "the cases are written for 4 ranks"
    mesh = init_device_mesh("cpu", (world,))
    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    g2, g3 = dist.new_group([0, 1]), dist.new_group([0, 1, 2])
    ctxs = {G4: {"group": dist.group.WORLD, "rank": rank, "world": world, "mesh": mesh,
                 "mesh2d": mesh2d}}
    if rank < 3:
        ctxs[G3] = {"group": g3, "rank": rank, "world": 3}
    if rank < 2:
        ctxs[G2] = {"group": g2, "rank": rank, "world": 2}
    results = {}
    for i, (name, gname, fn) in enumerate(build_cases()):
        if gname not in ctxs:
            continue
        t0 = time.perf_counter()
        _FAILS.clear()
        try:
            fn(ctxs[gname], seed * 1000 + i)
            ok, msg = not _FAILS, "; ".join(_FAILS)
        except CaseFailure as e:
            ok, msg = False, "; ".join(_FAILS + [str(e)])
        except Exception:  # noqa: BLE001
            ok, msg = False, "; ".join(_FAILS + [traceback.format_exc()])
        results[name] = {"ok": ok, "msg": f"[rank {rank}] {msg}" if msg else "",
                         "seconds": time.perf_counter() - t0}
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        merged = {}
        for res in gathered:
            for name, v in res.items():
                m = merged.setdefault(name, {"ok": True, "msg": "", "seconds": 0.0})
                m["ok"] = m["ok"] and v["ok"]
                m["msg"] = (m["msg"] + "\n" + v["msg"]).strip()
                m["seconds"] = max(m["seconds"], v["seconds"])
        with open(out_path, "w") as f:
            json.dump(merged, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=int.from_bytes(os.urandom(3), "little"))
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    # The Triton kernels run on the CPU only under the interpreter, chosen before triton is
    # imported (here, not at import time: pytest imports this module for the case names). It
    # changes nothing for the other cases: on the CPU the dispatcher picks the PyTorch path unless
    # FUSED_CE_BACKEND=triton, which only the *-triton-interpreter cases set.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch.multiprocessing as mp
    # Import everything the ranks need before forking, so that children start in milliseconds.
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401
    _hf_available()
    try:
        import fused_ce.kernels  # noqa: F401
    except Exception:  # noqa: BLE001  (the triton cases then report the import error)
        pass
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.start_processes(_rank_main, args=(WORLD, init_file, args.seed, args.out),
                           nprocs=WORLD, start_method=method)
    print(f"seed {args.seed}: results in {args.out}")


if __name__ == "__main__":
    main()
