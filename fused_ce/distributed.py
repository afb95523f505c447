"""Vocab-parallel fused loss: the output head's rows are sharded over the ranks of a process group.

Usage (every rank of ``group`` runs the same line; see ``docs/distributed.md``)::

    loss = fused_ce.linear_cross_entropy(hidden, w_shard, labels, linear_bias=b_shard,
                                         process_group=group)

Contract
--------
* Rank ``r`` of ``group`` holds the ``r``-th contiguous block of the head's rows:
  ``linear_weight (V_r, H)``, ``linear_bias (V_r,)``. Shard sizes may differ between ranks; they
  are exchanged at each call (together with the checks below), and ``V = sum_r V_r``.
* ``input (..., H)`` and ``target (...)`` are the same on every rank; ``target`` holds *global*
  class ids in ``[0, V)`` (or ``ignore_index``).
* ``weight`` (class weights) is the *full* ``(V,)`` vector on every rank (target ids are global,
  and the label-smoothing term needs ``sum_j w_j`` over the whole vocabulary).
* Every rank returns the full loss of the unsharded computation, for every option (class
  weights, label smoothing over the global ``V``, z-loss, softcap, ``ignore_index``, the three
  reductions, ``return_stats`` with the global argmax -- ties to the lowest global index).
* ``input.grad`` is the complete gradient on every rank: the op all-reduces the partial
  ``dx = dz_r @ W_r`` of each shard over ``group``. Frameworks that reduce it themselves (e.g.
  Megatron-style "copy to tensor-parallel region" ops) pass ``reduce_input_grad=False`` (or
  ``process_group=VocabParallel(group, reduce_input_grad=False)`` through the public API) and get
  the partial gradient. Each shard's weight/bias gradient is exactly its rows of the full gradient.
* A ``DTensor`` weight (and bias) sharded ``Shard(0)`` over a 1-D ``DeviceMesh`` is accepted; its
  local shard is used, ``process_group`` may then be ``None``, the mesh or its group, and its
  gradient comes back as a ``DTensor`` with the same placement. A ``Replicate`` DTensor ``input``
  gets a ``Replicate`` gradient (``Partial`` with ``reduce_input_grad=False``).

Algorithm (per call, per rank)
------------------------------
1. One all-gather of a few int64 per rank: shard size, rows, hidden size, a fingerprint of
   ``target``, of each option (the compute dtype included) and of the class weights. Ranks that
   disagree raise the same ``ValueError`` on every rank (no hang), naming what differs.
   ``input`` itself is not compared (its values may legitimately differ in the last bits
   between ranks; it only has to have the same shape).
2. Pass 1: the backend's ``forward`` on the local shard with targets shifted by the shard offset
   (a target outside the shard means "no target column here") gives per-row local lse, target
   logit, class-weighted logit sum, max and argmax.
3. One all-gather of those per-row statistics: ``O(world * rows)`` numbers per rank, never logits
   or weights. Every rank combines them in the same order, so all ranks hold bit-identical global
   lse / loss / argmax. (An all-reduce would need two collectives, max then sum-exp.)
4. Backward, pass 2: the backend's ``backward`` recomputes the local logits and the gradients from
   the *global* lse and the per-row coefficients of ``fused_ce.api._coefficients`` scaled by the
   upstream gradient; then ``dx`` is all-reduced.

Why the gradients are not computed in the forward pass as ``fused_ce.ops.linear_ce_sum`` does for
scalar reductions: the softmax needs the global lse, known only after step 3, so a second sweep over
the logits is unavoidable either way. Doing it in ``backward`` keeps only O(rows) state between
forward and backward (not ``dx``/``dW``), skips the gradient work under ``torch.no_grad`` and
handles every upstream gradient (scalar or per row) with one code path.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from fused_ce import _validation as check
from fused_ce import ops
from fused_ce._dispatch import backend_for
from fused_ce.api import _cast_for_autocast, _coefficients, _rows, _stats
from fused_ce.reference import GradCoefs, accumulation_dtype, total_loss

__all__ = ["VocabParallel", "vocab_parallel_cross_entropy", "shard_bounds"]

# Local target sentinels handed to the backend: ignored rows and rows whose target column lives on
# another rank. Both are outside [0, V_r), and independent of the user's ignore_index (which may be
# a valid class id, or collide with shifted ids).
_LOCAL_IGNORE = -1
_NOT_HERE = -2

_DOUBLE_BACKWARD = ("fused_ce: double backward (create_graph=True) through the vocab-parallel "
                    "loss is not supported")


@dataclass(frozen=True)
class VocabParallel:
    """A process group plus vocab-parallel options, accepted wherever ``process_group`` is
    (``fused_ce.linear_cross_entropy``, ``FusedCrossEntropy``)::

        FusedCrossEntropy(process_group=VocabParallel(tp_group, reduce_input_grad=False))

    ``group``: a ``ProcessGroup``, a 1-D ``DeviceMesh``, or ``None`` when the head weight is a
    ``DTensor`` (its mesh is used). ``reduce_input_grad``: all-reduce ``input``'s gradient over the
    group (default) or leave each rank its partial gradient.
    """

    group: Any = None
    reduce_input_grad: bool = True


def shard_bounds(vocab: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of rank ``rank``'s rows when ``vocab`` rows are split like
    ``torch.chunk`` / ``DTensor`` ``Shard(0)`` (ceil-sized blocks, the last ones smaller or empty).
    Any contiguous split in rank order works with the loss; this is a convenience."""
    size = -(-vocab // world_size)
    start = min(vocab, rank * size)
    return start, min(vocab, start + size)


# --------------------------------------------------------------------------- argument resolution

def _dtensor_cls():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return None
    return DTensor


def _is_dtensor(t) -> bool:
    cls = _dtensor_cls()
    return cls is not None and isinstance(t, cls)


_FSDP_HINT = ("; an FSDP-sharded weight read outside its module's forward looks like this: "
              "compute the loss inside the forward of the module that owns the head")


def _mesh_group(mesh, name: str):
    if mesh.ndim != 1:
        hint = _FSDP_HINT if name == "linear_weight" else ""
        raise ValueError(f"{name}: expected a 1-D DeviceMesh (the vocab-parallel dimension), got "
                         f"a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)}; pass mesh['tp'] or "
                         f"the group of the vocabulary dimension{hint}")
    return mesh.get_group()


def _same_group(a, b) -> bool:
    return a is b or dist.get_process_group_ranks(a) == dist.get_process_group_ranks(b)


def _resolve_group(process_group, linear_weight):
    """(group, reduce_input_grad from a VocabParallel wrapper or None)."""
    reduce = None
    if isinstance(process_group, VocabParallel):
        reduce = bool(process_group.reduce_input_grad)
        process_group = process_group.group
    from torch.distributed.device_mesh import DeviceMesh
    if isinstance(process_group, DeviceMesh):
        process_group = _mesh_group(process_group, "process_group")
    mesh_group = None
    if _is_dtensor(linear_weight):
        mesh_group = _mesh_group(linear_weight.device_mesh, "linear_weight")
    if process_group is None:
        if mesh_group is None:
            raise ValueError("process_group: expected a torch.distributed ProcessGroup, a 1-D "
                             "DeviceMesh or fused_ce.distributed.VocabParallel (or a DTensor "
                             "linear_weight, whose mesh is used), got None")
        process_group = mesh_group
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group: expected a torch.distributed ProcessGroup, a 1-D "
                        f"DeviceMesh or fused_ce.distributed.VocabParallel, got "
                        f"{type(process_group).__name__}")
    if mesh_group is not None and not _same_group(mesh_group, process_group):
        raise ValueError(
            f"process_group: expected the group of linear_weight's DeviceMesh (ranks "
            f"{dist.get_process_group_ranks(mesh_group)}), got a group of ranks "
            f"{dist.get_process_group_ranks(process_group)}")
    return process_group, reduce


def _local_param(t, name: str, group):
    """The local shard of a ``Shard(0)`` DTensor (differentiable; its gradient comes back as a
    DTensor with the same placement), or ``t`` itself."""
    if t is None or not _is_dtensor(t):
        return t
    from torch.distributed.tensor import Shard
    placements = tuple(t.placements)
    if placements != (Shard(0),):
        raise ValueError(f"{name}: expected a DTensor sharded on dim 0 (placements (Shard(dim=0),)) "
                         f"over a 1-D mesh, got placements {placements}{_FSDP_HINT}")
    if not _same_group(_mesh_group(t.device_mesh, name), group):
        raise ValueError(f"{name}: expected a DTensor on the mesh of process_group (ranks "
                         f"{dist.get_process_group_ranks(group)}), got a mesh of ranks "
                         f"{t.device_mesh.mesh.flatten().tolist()}")
    return t.to_local()


def _local_input(x, group, reduce: bool):
    if not _is_dtensor(x):
        return x
    from torch.distributed.tensor import Partial, Replicate
    if not all(isinstance(p, Replicate) for p in x.placements) or x.device_mesh.ndim != 1 \
            or not _same_group(x.device_mesh.get_group(), group):
        raise ValueError(f"input: expected a plain tensor or a DTensor replicated (Replicate()) "
                         f"over process_group's mesh, got placements {tuple(x.placements)}")
    return x.to_local(grad_placements=[Replicate() if reduce else Partial()])


# --------------------------------------------------------------------------- communication

def _all_gather_flat(out: Tensor, inp: Tensor, group) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _all_gather_packed(tensors: list[Tensor], group, world: int) -> list[Tensor]:
    """All-gathers several tensors (any dtypes) in one collective: returns, for each, a tensor of
    shape ``(world, *t.shape)`` holding every rank's copy in rank order."""
    flat = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    sizes = [f.numel() for f in flat]
    buf = torch.cat(flat)
    out = buf.new_empty((world, buf.numel()))
    _all_gather_flat(out.view(-1), buf, group)
    result, start = [], 0
    for t, size in zip(tensors, sizes):
        part = out[:, start:start + size].contiguous().view(t.dtype)
        result.append(part.reshape(world, *t.shape))
        start += size
    return result


class _Meta(NamedTuple):
    sizes: list
    offset: int
    vocab: int


def _exchange_meta(x, w, t, class_weight, options: dict, group, world: int, rank: int) -> _Meta:
    """One small all-gather: shard sizes (-> offsets, global V) and consistency fingerprints,
    one per option of ``options`` (name -> this rank's value). Every rank sees the same table,
    so every rank raises the same error."""
    dev = x.device
    n = t.numel()
    tl = t.reshape(-1).long()
    pos = torch.arange(1, n + 1, device=dev, dtype=torch.long)
    # Exact integer fingerprint of the targets (wrapping int64 arithmetic is deterministic).
    t_fp = (tl * pos).sum() * 1_000_003 + tl.sum() if n else torch.zeros((), dtype=torch.long,
                                                                         device=dev)
    if class_weight is None:
        cw_n, cw_fp = -1, torch.full((), -1, dtype=torch.long, device=dev)
    else:
        cwd = class_weight.detach().reshape(-1).to(torch.float64)
        cw_n = class_weight.numel()
        cw_fp = (cwd.sum() + (cwd * torch.arange(cw_n, device=dev)).sum() * math.pi
                 ).reshape(1).view(torch.long)[0]
    # The table's columns in the order they are checked (the options before the class weights:
    # a rank without them raises the options' error); repr of a float round-trips exactly, so
    # equal values give equal fingerprints.
    fields = {"shard rows": w.shape[0], "rows": n, "hidden": x.shape[-1], "target": t_fp,
              **{name: zlib.crc32(repr(v).encode()) for name, v in options.items()},
              "weight length": cw_n, "weight": cw_fp}
    local = torch.stack([
        torch.tensor(v, dtype=torch.long, device=dev) if not isinstance(v, Tensor) else v.to(dev)
        for v in fields.values()])
    out = local.new_empty(world * local.numel())
    _all_gather_flat(out, local, group)
    cols = list(zip(*out.view(world, -1).tolist()))
    sizes = list(cols[0])
    vocab = sum(sizes)
    for name, values in list(zip(fields, cols))[1:]:
        values = list(values)
        if name == "weight length":
            if class_weight is not None and any(v != vocab for v in values):
                hint = (" (this rank's shard size: pass the full vector, targets are global ids)"
                        if cw_n == w.shape[0] else "")
                raise ValueError(
                    f"weight: expected class weights over the global vocabulary, shape ({vocab},) "
                    f"= sum of the shard sizes {sizes} over process_group, got lengths {values} on "
                    f"ranks 0..{world - 1}{hint}")
        elif len(set(values)) > 1:
            odd = [r for r in range(world) if values[r] != values[0]]
            if name in options:
                raise ValueError(_OPTION_MISMATCH.format(name=name, ranks=odd, rank=rank,
                                                         value=options[name]))
            raise ValueError(_MISMATCH[name].format(values=values, ranks=odd))
    return _Meta(sizes, sum(sizes[:rank]), vocab)


_MISMATCH = {
    "rows": "input: expected the same number of rows on every rank of process_group (vocab-parallel "
            "ranks share input and target), got row counts {values}",
    "hidden": "input: expected the same hidden size on every rank of process_group, got {values}",
    "target": "target: expected the same tensor on every rank of process_group (vocab-parallel ranks "
              "hold shards of one head and see the same tokens; data-parallel batches need a "
              "data-parallel group, not this one, and an FSDP-sharded head must be read inside "
              "its module's forward), got different targets on ranks {ranks} than on rank 0",
    "weight": "weight: expected the same full (V,) class-weight vector on every rank of "
              "process_group, got different values on ranks {ranks} than on rank 0",
}
_OPTION_MISMATCH = ("{name}: expected the same value on every rank of process_group, got a "
                    "different one on ranks {ranks} than on rank 0 (rank {rank} has {value!r})")


# --------------------------------------------------------------------------- autograd

class _Plan(NamedTuple):
    group: Any
    world: int
    offsets: Tensor          # (world,) int64, on the compute device
    ignore_index: int        # the user's
    softcap: Optional[float]
    with_ws: bool
    want_argmax: bool
    reduce_dx: bool
    low_memory: bool


class _VocabParallelCE(torch.autograd.Function):
    """(x, W_r, b_r) -> (row losses (N,), global lse (N,), global argmax (N,))."""

    @staticmethod
    def forward(ctx, x, w, b, t_loc, valid, cw_loc, coef_target, coef_smooth, coef_prob,
                coef_lse_sq, plan: _Plan):
        coefs = GradCoefs(coef_target, coef_smooth, coef_prob, coef_lse_sq)
        be = backend_for(x)
        st = be.forward(x, w, b, t_loc, _LOCAL_IGNORE, plan.softcap, cw_loc,
                        with_weighted_sum=plan.with_ws, low_memory=plan.low_memory)
        n = x.shape[0]
        fields = [st.lse, st.target_logit]
        if plan.with_ws:
            fields.append(st.weighted_sum)
        if plan.want_argmax:
            fields.append(st.max_logit)
        packed = torch.stack(fields)
        if n == 0:
            gathered = [packed.new_empty((plan.world, *packed.shape)),
                        st.argmax.new_empty((plan.world, 0))]
        else:
            gathered = _all_gather_packed(
                [packed] + ([st.argmax] if plan.want_argmax else []), plan.group, plan.world)
        g = gathered[0]  # (world, fields, N)
        lse = torch.where(valid, torch.logsumexp(g[:, 0], dim=0), 0).to(packed.dtype)
        target_logit = g[:, 1].sum(0)
        rows = coefs.prob * lse - coefs.target * target_logit + coefs.lse_sq * lse * lse
        if plan.with_ws:
            rows = rows - coefs.smooth * g[:, 2].sum(0)
        if plan.want_argmax:
            mx = g[:, -1]
            top = mx.max(0).values
            hit = (mx == top) | mx.isnan()  # torch.argmax: NaN is the maximum
            win = hit.to(torch.uint8).argmax(0)  # first (lowest) rank attaining it
            idx = gathered[1] + plan.offsets[:, None]
            argmax = idx.gather(0, win[None]).squeeze(0)
            argmax = torch.where(valid, argmax, plan.ignore_index)
        else:
            argmax = torch.full((n,), plan.ignore_index, dtype=torch.long, device=x.device)
        ctx.plan = plan
        ctx.has_bias = b is not None
        ctx.save_for_backward(x, w, b, t_loc, cw_loc, lse, *coefs)
        ctx.mark_non_differentiable(lse, argmax)
        return rows, lse, argmax

    @staticmethod
    def backward(ctx, g_rows, *_):
        if torch.is_grad_enabled():
            raise RuntimeError(_DOUBLE_BACKWARD)
        x, w, b, t_loc, cw_loc, lse, *coefs = ctx.saved_tensors
        plan = ctx.plan
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        need_db = need_db and ctx.has_bias
        dx = dw = db = None
        if need_dx or need_dw or need_db:
            g = g_rows.to(coefs[0].dtype)
            scaled = GradCoefs(*(c * g for c in coefs))
            dx, dw, db = backend_for(x).backward(
                x, w, b, t_loc, _LOCAL_IGNORE, plan.softcap, cw_loc, lse, scaled,
                need_dx=need_dx, need_dw=need_dw, need_db=need_db, low_memory=plan.low_memory)
        if need_dx and plan.reduce_dx and plan.world > 1 and dx.numel():
            dist.all_reduce(dx, op=dist.ReduceOp.SUM, group=plan.group)
        return (dx, dw, db) + (None,) * 8


# --------------------------------------------------------------------------- public entry point

def vocab_parallel_cross_entropy(
    input: Tensor,
    linear_weight,
    target: Tensor,
    *,
    linear_bias=None,
    weight: Optional[Tensor] = None,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    low_memory: bool = False,
    return_stats: bool = False,
    process_group=None,
    reduce_input_grad: Optional[bool] = None,
):
    """``fused_ce.linear_cross_entropy`` with the head's rows sharded over ``process_group``
    (module docstring). ``linear_weight``/``linear_bias`` are this rank's contiguous block of rows
    (rank order); ``input``, ``target`` (global class ids) and ``weight`` (full ``(V,)`` class
    weights) are the same on every rank. Returns what ``linear_cross_entropy`` returns for the
    unsharded head, on every rank.

    ``reduce_input_grad`` (default ``True``, or the ``VocabParallel`` wrapper's setting):
    all-reduce ``input``'s gradient over the group so every rank gets the complete gradient;
    ``False`` leaves each rank the partial gradient of its shard (sum over ranks = complete).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("process_group: the vocab-parallel loss needs torch.distributed "
                           "initialized (torch.distributed.init_process_group), got an "
                           "uninitialized default group")
    group, wrapped_reduce = _resolve_group(process_group, linear_weight)
    if reduce_input_grad is None:
        reduce_input_grad = True if wrapped_reduce is None else wrapped_reduce
    elif wrapped_reduce is not None and wrapped_reduce != bool(reduce_input_grad):
        raise ValueError(f"reduce_input_grad: expected the same value as the VocabParallel "
                         f"wrapper's ({wrapped_reduce}), got {reduce_input_grad}")
    reduce_input_grad = bool(reduce_input_grad)
    if linear_bias is not None and _is_dtensor(linear_bias) != _is_dtensor(linear_weight):
        raise ValueError("linear_bias: expected a DTensor exactly when linear_weight is one "
                         "(both sharded Shard(0) on the same mesh), got "
                         f"linear_weight {type(linear_weight).__name__} and linear_bias "
                         f"{type(linear_bias).__name__}")
    w_local = _local_param(linear_weight, "linear_weight", group)
    b_local = _local_param(linear_bias, "linear_bias", group)
    x_local = _local_input(input, group, reduce_input_grad)
    check.check_linear(x_local, w_local, b_local)
    # Everything but the class weights' length (which needs the global V) is checked before any
    # communication; with the same arguments on every rank, every rank raises alike.
    reduction, ignore_index, label_smoothing, z_loss, softcap = check.check_loss_options(
        target, x_local, 1, None, reduction, ignore_index, label_smoothing, z_loss, softcap)
    if weight is not None:
        check.check_tensor("weight", weight)
        check.check_same_device({"input": x_local, "weight": weight})
        if weight.dim() != 1:
            raise ValueError(f"weight: expected class weights of shape (V,) over the global "
                             f"vocabulary, got {tuple(weight.shape)}")

    # (autocast's casts and the dtype check, local, before any communication)
    (x, w, b), ctx = _cast_for_autocast((x_local, w_local, b_local), x_local.device.type)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    options = {"reduction": reduction, "ignore_index": ignore_index,
               "label_smoothing": label_smoothing, "z_loss": z_loss, "softcap": softcap,
               "return_stats": bool(return_stats), "linear_bias is None": b_local is None,
               "weight is None": weight is None,
               "the dtype of input, linear_weight and linear_bias (after autocast)": str(x.dtype)}
    meta = _exchange_meta(x_local, w_local, target, weight, options, group, world, rank)
    vocab, offset, v_local = meta.vocab, meta.offset, w_local.shape[0]
    check.check_target_values(target, vocab, ignore_index)

    x = _rows(x)
    t = target.reshape(-1).long()
    valid = t != ignore_index
    acc = accumulation_dtype(x.dtype)
    coefs, d_nll, divisor = _coefficients(t, valid, weight, vocab, reduction, label_smoothing,
                                          z_loss, acc)
    in_shard = valid & (t >= offset) & (t < offset + v_local)
    t_loc = torch.where(in_shard, t - offset,
                        torch.where(valid, _NOT_HERE, _LOCAL_IGNORE)).contiguous()
    cw_loc = None if weight is None else weight.to(acc)[offset:offset + v_local].contiguous()
    offsets = torch.tensor([sum(meta.sizes[:r]) for r in range(world)], dtype=torch.long,
                           device=x.device)
    plan = _Plan(group, world, offsets, int(ignore_index), softcap, label_smoothing > 0,
                 bool(return_stats), reduce_input_grad, bool(low_memory))
    with ctx:
        rows, lse, argmax = _VocabParallelCE.apply(x, w, b, t_loc, valid, cw_loc, *coefs, plan)
    # ('sum' and 'mean': d_nll and divisor are None unless 'mean')
    loss = (rows.reshape(target.shape) if reduction == "none"
            else total_loss(rows, d_nll, divisor))
    if not return_stats:
        return loss
    return _stats(loss, lse, argmax, t, valid, coefs, target.shape, z_loss, divisor)
