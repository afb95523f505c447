"""Triton kernels for CUDA: the same contract as ``fused_ce.reference`` (see its docstring).

* ``forward``: per-row statistics of the logits; with ``coefs`` also their gradients.
  - 16-bit inputs with gradients (the default training path): row_chunks.py, three cuBLAS
    GEMMs per chunk of valid rows with the softmax work in one Triton kernel between them. It
    reads the number of valid rows on the host once per call; while a CUDA graph is captured
    its chunks span every row instead, the count staying on the device. For bf16
    heads (not with a softcap and label smoothing together) the logits GEMM is a Triton one
    whose epilogue does the softmax's first pass (logits_tiles.py).
  - Otherwise (no gradients, fp32 inputs, ``low_memory``): one statistics pass
    computes lse, target logit, sum_j w_j z_j, max and argmax per row without storing logits
    (16-bit inputs: the epilogue GEMM without E, stats_pass.py; otherwise row_stats.py), and
    the gradients follow from vocabulary sweeps (gradients.py). Valid rows
    are compacted on the device and the Triton kernels read their count from device memory.
    The sweeps' cuBLAS products (bf16, fp32) need host sizes: when the forward checks targets
    outside graph capture, the valid count comes with that check's one read and the products
    skip ignored rows; while a graph is captured nothing waits on the host and the products
    span every row (zeros where ignored).
* ``backward``: the gradients from a given lse, through the same two paths.
* ``log_softmax``: 16-bit inputs by row chunks (log_softmax_chunks.py): bf16 through the
  epilogue GEMM of logits_tiles.py, which stores ``z - m_t`` (tile max), and a per-row kernel
  writing ``z - lse``; fp16 through fp32 cuBLAS logits and one Triton kernel per chunk writing
  ``z - lse``. Otherwise the statistics sweep, then a sweep writing ``z - lse`` (log_probs.py).
* ``total_loss``: the sum op's loss from the row losses (and 'mean') in one launch
  (total_loss.py).
* ``scaled_grads``: the backward's scaling by the upstream gradient, rounding the forward's
  unrounded (fp32, ``round_grads=False``) gradients once into their dtypes, in one launch
  (scale.py). The sweeps then store each finished dW chunk in fp32 instead of rounding it.

Results are deterministic (no atomics; every reduction has a fixed order). fp64 inputs use the
reference (Triton's fp64 dot is not worth a kernel).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from fused_ce import reference
from fused_ce._validation import _cannot_sync, check_target_values
from fused_ce.reference import GradCoefs, RowStats

import triton  # an ImportError here tells the dispatcher the kernels are unavailable

from fused_ce.kernels import config
from fused_ce.kernels import log_softmax_chunks, row_chunks, stats_pass
from fused_ce.kernels.gradients import grad_scale, gradients, library_products, row_coefs
from fused_ce.kernels.log_probs import log_probs_kernel
from fused_ce.kernels.problem import Problem
from fused_ce.kernels.row_stats import combine, row_stats_kernel
from fused_ce.kernels.scale import scalable, scale_into
from fused_ce.kernels.targets import scan_targets as _scan
from fused_ce.kernels.total_loss import total_loss

__all__ = ["forward", "backward", "log_softmax", "supports", "scan_targets", "scaled_grads",
           "total_loss"]


def supports(x: Tensor) -> bool:
    """True when these kernels can run on x's device: CUDA (compute capability >= 8.0), or any
    device under the Triton interpreter (TRITON_INTERPRET=1)."""
    if config.interpreting():
        return True
    return x.is_cuda and config.capability(x.device)[0] >= 8


def _use_reference(x: Tensor, weight: Tensor) -> bool:
    """fp64 (no fp64 tensor cores), and H = 0 (no product: the logits are the bias; the TMA
    descriptors take no empty dimension) go to the PyTorch path."""
    return x.dtype == torch.float64 or weight.dtype == torch.float64 or x.shape[-1] == 0


def _row_stats(p: Problem, with_weighted_sum: bool, cf=None):
    """The statistics pass's (lse, target_logit, weighted_sum, max_logit, argmax, nll) and, with
    coefficients ``cf`` where stats_pass.py serves, the row losses."""
    if stats_pass.applicable(p):
        return stats_pass.row_stats(p, with_weighted_sum, cf)
    lg = p.cfg["logits"]
    n_tiles = triton.cdiv(p.V, lg["BLOCK_N"])
    row_tiles = triton.cdiv(p.N, lg["BLOCK_M"])
    if config.interpreting():
        splits = p.cfg["stats_splits"]
    else:
        target = p.cfg["stats_programs_per_sm"] * config.sm_count(p.device)
        splits = triton.cdiv(target, row_tiles)
    splits = max(1, min(splits, n_tiles))
    per_split = triton.cdiv(n_tiles, splits)
    splits = triton.cdiv(n_tiles, per_split)
    f32 = dict(dtype=torch.float32, device=p.device)
    m, s, zt, ws = (torch.empty((splits, p.N), **f32) for _ in range(4))
    am = torch.empty((splits, p.N), dtype=torch.int32, device=p.device)
    row_stats_kernel[(row_tiles, splits)](
        p.x, p.w_src, p.bias_arg, p.cw_arg, p.target, p.row_idx, p.n_valid,
        m, s, am, zt, ws, p.N, p.V, p.H, per_split, p.softcap_arg,
        HAS_CW=p.class_weight is not None, WITH_WS=with_weighted_sum, **p.flags, **lg)
    return combine(m, s, am, zt, ws, p.valid, p.target, p.V, p.ignore_index)


def _row_stats_with(stats, grads, dx_rows=None) -> RowStats:
    """RowStats from the paths' (lse, target_logit, weighted_sum, max_logit, argmax, nll[,
    loss]) and (dx, dw, db)."""
    return RowStats(*stats[:5], *grads, *stats[5:], dx_rows=dx_rows)


def _empty_stats(x: Tensor, ignore_index: int):
    z = torch.zeros(0, dtype=torch.float32, device=x.device)
    return (z, z.clone(), z.clone(), z.clone(), torch.zeros(0, dtype=torch.long, device=x.device),
            z.clone())


def forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, ignore_index: int,
            softcap: Optional[float], class_weight: Optional[Tensor], *,
            with_weighted_sum: bool = False, coefs: Optional[GradCoefs] = None,
            need_dx: bool = False, need_dw: bool = False, need_db: bool = False,
            low_memory: bool = False, check_targets: bool = False,
            scan: Optional["TargetScan"] = None, round_grads: bool = True,
            compact_dx: bool = False) -> RowStats:
    """Per-row statistics of the logits (and, given ``coefs``, the row losses where a kernel
    computes them), plus their gradients when ``coefs`` is given and one is needed (without
    ``round_grads`` in fp32, unrounded).
    ``scan``: ``scan_targets`` of this same target, made earlier (its host read has had time
    to arrive). ``compact_dx`` (with ``round_grads=False``): dx may hold the valid rows only
    (RowStats.dx_rows: reference.RowStats)."""
    if _use_reference(x, weight):
        return reference.forward(x, weight, bias, target, ignore_index, softcap, class_weight,
                                 with_weighted_sum=with_weighted_sum, coefs=coefs,
                                 need_dx=need_dx, need_dw=need_dw, need_db=need_db,
                                 low_memory=low_memory, check_targets=check_targets,
                                 round_grads=round_grads)
    p = Problem(x, weight, bias, target, ignore_index, softcap, class_weight,
                scan=None if scan is None else (scan.row_idx, scan.counts))
    want = coefs is not None and (need_dx or need_dw or need_db)
    if want and row_chunks.applicable(p, low_memory, host_read=not _cannot_sync()):
        stats, grads, dx_rows = _row_chunks(
            p, coefs, with_weighted_sum, need_dx, need_dw, need_db, check_targets=check_targets,
            scan=scan, compact_dx=compact_dx and not round_grads)
        if round_grads:
            grads = reference.rounded_grads(grads, x, weight, bias)
        return _row_stats_with(stats, grads, dx_rows)
    read = None
    if check_targets and p.N > 0 and not _cannot_sync():
        # the target check's host read of the scan's counts, started now (or by a prepared
        # scan) and waited for once the statistics pass is queued, so that the GPU works while
        # the host waits (the kernels take any target: an out-of-range one as a column of no
        # shard)
        read = _count_read(p, scan)
    elif check_targets:
        check_target_values(target, p.V, ignore_index)
    # (with coefficients the loss too, in the pass's finish kernel where stats_pass.py serves)
    cf = row_coefs(p, coefs) if coefs is not None and p.N > 0 else None
    stats = _row_stats(p, with_weighted_sum, cf) if p.N > 0 else _empty_stats(x, ignore_index)
    if read is not None and want and library_products(p):
        # the sweeps' cuBLAS products want the valid count: they then skip the ignored rows
        read.wait(p, check_targets=True)
        read = None
    grads = (None, None, None)
    if want:
        grads = gradients(p, stats[0], coefs, need_dx=need_dx, need_dw=need_dw,
                          need_db=need_db, low_memory=low_memory, round_grads=round_grads)
    if read is not None:
        read.wait(p, check_targets=True)  # raises on an out-of-range target
    return _row_stats_with(stats, grads)


def backward(x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, ignore_index: int,
             softcap: Optional[float], class_weight: Optional[Tensor], lse: Tensor,
             coefs: GradCoefs, *, need_dx: bool, need_dw: bool, need_db: bool,
             low_memory: bool = False, lse_is_local: bool = False):
    """(dx, dw, db) of the logits gradient defined by ``coefs`` and the given ``lse`` (used
    as given, whether or not ``lse_is_local``: see reference.backward)."""
    if _use_reference(x, weight):
        return reference.backward(x, weight, bias, target, ignore_index, softcap, class_weight,
                                  lse, coefs, need_dx=need_dx, need_dw=need_dw, need_db=need_db,
                                  low_memory=low_memory, lse_is_local=lse_is_local)
    p = Problem(x, weight, bias, target, ignore_index, softcap, class_weight)
    unit, largest = _unit_coefs(p, coefs)
    if row_chunks.applicable(p, low_memory, host_read=not _cannot_sync()):
        _, grads, _ = _row_chunks(p, unit, False, need_dx, need_dw, need_db, lse_in=lse)
        wanted = [(g, dt) for g, dt in zip(grads, reference.grad_dtypes(x, weight, bias))
                  if g is not None]
        scaled = iter(scaled_grads(*zip(*wanted), largest) if wanted else ())
        return tuple(None if g is None else next(scaled) for g in grads)
    largest_host = None
    if p.N > 0 and library_products(p) and not _cannot_sync():
        # the cuBLAS products need host sizes: with the valid count read they skip the
        # ignored rows (while a graph is captured they span every row); the same read brings
        # the factor, which the dW products then take as their scalar
        largest_host = CountRead(p.counts, largest).wait(p, check_targets=False)
    grads = gradients(p, lse, unit, need_dx=need_dx, need_dw=need_dw, need_db=need_db,
                      low_memory=low_memory, factor=largest, factor_host=largest_host)
    return reference.rounded_grads(grads, x, weight, bias)


def _unit_coefs(p: Problem, coefs: GradCoefs) -> tuple[GradCoefs, Tensor]:
    """(coefs / m, m): m the largest |coefficient| of dz's target and probability terms (an
    fp32 device tensor of one element; 1 where all are 0 or one is not finite, so that a NaN
    or inf still reaches the gradients).

    The 16-bit D holds coefficient * dz rounded. The backward's coefficients carry the
    per-row upstream gradient, typically one factor for all rows (1/n from a mean taken after
    the loss, or over the vocab-parallel rows). Left in, every row's target entry (p_t - 1) * c
    with p_t small is c's own rounding, the same relative error (up to 2^-9 in bf16) in every
    row, and dX and dW inherit it row for row. Divided by m, equal coefficients are exactly 1
    (x / x is exact), and m multiplies the fp32 gradients before their one rounding (NOTES.md
    #66; on the device, so also where nothing may wait on the host, #70)."""
    tgt, smooth, prob, lse_sq = row_coefs(p, coefs)
    if p.N == 0:
        return GradCoefs(tgt, smooth, prob, lse_sq), torch.ones(1, device=p.device)
    m = torch.maximum(tgt.abs().amax(), prob.abs().amax()).reshape(1)
    m = torch.where(torch.isfinite(m) & (m > 0), m, 1.0)
    return GradCoefs(tgt / m, smooth / m, prob / m, lse_sq / m), m


def _row_chunks(p: Problem, coefs: GradCoefs, with_ws, need_dx, need_dw, need_db, lse_in=None,
                check_targets=False, scan=None, compact_dx=False):
    cf = row_coefs(p, coefs)
    scale = grad_scale(p, cf) if p.x.dtype == torch.float16 else None
    wait, arrived = None, lambda: False
    if _cannot_sync():  # CUDA-graph capture: chunks over all N, the count on the device
        if check_targets:
            check_target_values(p.target, p.V, p.ignore_index)  # an asynchronous device assert
    else:
        read = _count_read(p, scan, scale)
        wait, arrived = lambda: read.wait(p, check_targets=check_targets), read.arrived
    return row_chunks.forward_with_grads(p, cf, wait, scale, with_ws, need_dx, need_dw, need_db,
                                         lse_in=lse_in, read_arrived=arrived,
                                         compact_dx=compact_dx)


def _count_read(p: Problem, scan: Optional["TargetScan"], scale: Optional[Tensor] = None):
    """The host read of p's counts: the one a prepared scan already started, unless D's fp16
    scale must come with it; else started now."""
    if scan is not None and scale is None:
        return scan.read
    return CountRead(p.counts, scale)


class CountRead:
    """The one host read of a call: the valid and out-of-range counts (Problem.counts: the
    target check, and the sizes of cuBLAS products over the valid rows only) and, for fp16,
    D's scale. The copy starts at once (into pinned memory, asynchronously) so that the work
    that does not depend on it can be queued before ``wait``."""

    def __init__(self, counts: Tensor, scale: Optional[Tensor] = None):
        vals = counts if scale is None else torch.cat([counts.double(), scale.double()])
        self._event = None
        if vals.is_cuda:
            self._host = torch.empty(vals.shape, dtype=vals.dtype, pin_memory=True)
            self._host.copy_(vals, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = vals

    def arrived(self) -> bool:
        """Whether ``wait`` would return at once (asked without waiting)."""
        return self._event is None or self._event.query()

    def wait(self, p: Problem, *, check_targets: bool) -> float:
        """Sets ``p.n_valid_host``, returns the scale (1 without one) and, with
        ``check_targets``, raises on an out-of-range target (naming one)."""
        if self._event is not None:
            self._event.synchronize()
        n_valid, n_bad, *scale = self._host.tolist()
        p.n_valid_host = int(n_valid)
        if check_targets and n_bad:
            check_target_values(p.target, p.V, p.ignore_index)  # raises
        return scale[0] if scale else 1.0


class TargetScan:
    """``scan_targets``: the compacted rows and counts of one target vector, with their host
    read already started."""

    def __init__(self, target: Tensor, ignore_index: int, vocab: int):
        self.row_idx, self.counts = _scan(target, ignore_index, vocab, config.current()["scan"])
        self.read = CountRead(self.counts)


def scan_targets(target: Tensor, ignore_index: int, vocab: int) -> Optional[TargetScan]:
    """The target scan of a later ``forward`` (same target, ignore_index and vocabulary), made
    now: called before a model's forward pass, the one host read of the loss then finds its
    value arrived instead of waiting for the whole forward pass to finish on the GPU. None
    where that read does not happen (no CUDA, graph capture, compile)."""
    if not (target.is_cuda or config.interpreting()) or _cannot_sync():
        return None
    return TargetScan(target.reshape(-1).contiguous(), ignore_index, vocab)


def scaled_grads(grads, dtypes, g: Tensor, dx_rows: Optional[Tensor] = None) -> list:
    """reference.scaled_grads: one Triton launch for 16-bit and fp32 gradients and an fp32 g
    (scale.py), torch otherwise (fp64)."""
    grads, dtypes = list(grads), list(dtypes)
    if scalable(grads, dtypes, g):
        return scale_into(grads, dtypes, g, dx_rows)
    return reference.scaled_grads(grads, dtypes, g, dx_rows)


def log_softmax(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``log_softmax(x @ weight.T + bias, -1)`` in ``x``'s dtype (logits never stored)."""
    if _use_reference(x, weight):
        return reference.log_softmax(x, weight, bias)
    if log_softmax_chunks.applicable(x) and weight.dtype == x.dtype:
        return log_softmax_chunks.log_softmax(x.contiguous(), weight.contiguous(),
                                              None if bias is None else bias.contiguous())
    n = x.shape[0]
    no_target = torch.full((n,), -1, dtype=torch.long, device=x.device)
    p = Problem(x, weight, bias, no_target, -2, None, None)
    out = torch.empty((n, p.V), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    lse = _row_stats(p, False)[0]
    lg = p.cfg["logits"]
    log_probs_kernel[(triton.cdiv(n, lg["BLOCK_M"]), triton.cdiv(p.V, lg["BLOCK_N"]))](
        p.x, p.w_src, p.bias_arg, lse, out, n, p.V, p.H, HAS_BIAS=p.flags["HAS_BIAS"],
        UPCAST=p.flags["UPCAST"], IEEE=p.flags["IEEE"], EVEN_K=p.flags["EVEN_K"],
        W_DESC=p.flags["W_DESC"], **lg)
    return out
