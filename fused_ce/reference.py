"""Chunked pure-PyTorch backend: the path on every device without a Triton kernel, and the
numerical oracle the kernels are tested against.

Backend contract (``fused_ce.kernels`` implements the same functions for CUDA)
=============================================================================

Notation: ``x (N, H)``, ``weight (V, H)``, ``bias (V,)`` or None, ``target (N,)`` int64.
Row ``i`` is *ignored* when ``target[i] == ignore_index``; ignored rows do no GEMM work and get
zeros everywhere. A target outside ``[0, V)`` that is not ``ignore_index`` means "this row has no
target column in this weight" (used by the vocab-parallel path, where each rank holds a slice of
the vocabulary): the row is processed, its target logit is 0 and no one-hot term is subtracted.

Logits of a processed row, computed with fp32 (fp64 for fp64 inputs) accumulation::

    z_ij = x_i . W_j + b_j                      (then  z = softcap * tanh(z / softcap)  if set)

``forward`` returns per-row statistics (all fp32, or fp64 for fp64 inputs; zeros on ignored rows)::

    lse_i           = log sum_j exp(z_ij)
    target_logit_i  = z_{i, t_i}                (0 if t_i is not a column of this weight)
    weighted_sum_i  = sum_j w_j z_ij            (w = class_weight, or all ones; only if
                                                 ``with_weighted_sum``, else zeros)
    max_logit_i     = max_j z_ij,  argmax_i = first j attaining it (torch.argmax's tie rule);
                      argmax is ``ignore_index`` on ignored rows
    nll_i           = lse_i - target_logit_i    (optional, None if not given: this backend
                                                 computes it as (m_i - z_{i,t_i}) + log sum_j
                                                 exp(z_ij - m_i), m_i the row max, which keeps
                                                 the digits lse_i's rounding drops when the
                                                 target has nearly all the probability)

Gradients use four per-row coefficients ``GradCoefs(target, smooth, prob, lse_sq)`` -- the
derivative of the row loss  a*(lse - z_t) + c*(W*lse - weighted_sum) + e*lse**2  (W = sum_j w_j
over the *whole* vocabulary) with respect to the logits is::

    dz_ij = (prob_i + 2 * lse_sq_i * lse_i) * p_ij - target_i * [j == t_i] - smooth_i * w_j
    with  p_ij = exp(z_ij - lse_i),  prob_i = a_i + c_i * W,  target_i = a_i,  smooth_i = c_i,
          lse_sq_i = e_i,

times ``1 - (z_ij / softcap)**2`` (the softcap's derivative) when a softcap is set. Then
``dx = dz @ W``, ``dW = dz.T @ x``, ``db = dz.sum(0)``, each accumulated in fp32 and returned
in the dtype of its input.

* ``forward(..., coefs=GradCoefs, need_dx/need_dw/need_db)`` also returns those gradients,
  computed from the lse of the same pass (three GEMM-equivalents in one sweep); with
  ``round_grads=False`` a backend may return them unrounded, in their accumulation dtype (for
  ``scaled_grads``: the upstream gradient is not known yet).
* ``backward(..., lse, coefs, ...)`` recomputes the logits and returns them (the lse comes from an
  earlier ``forward``; used when the upstream gradient is per row, and by the vocab-parallel path
  whose lse is global).
* ``log_softmax(x, weight, bias)`` returns ``log_softmax(x @ W.T + b)`` in ``x``'s dtype.
* ``total_loss(rows, mean_d, mean_divisor)`` returns the row losses' sum, or its 'mean'
  (``mean_from_sum``) when given the mean's denominator and divisor.
* ``scaled_grads(grads, dtypes, g)`` returns each gradient times the scalar ``g`` (the loss's
  upstream gradient, in the loss's dtype) in the given dtype: the product in the wider of the
  two precisions, rounded once; in place where a gradient already has its dtype.

Blocks (this backend)
=====================
The processed rows go in blocks whose logits stay within a workspace budget (32 MiB, or an
eighth of dW's size where dW is computed in the weight's own dtype and that is larger; 4 MiB
with ``low_memory``; ``block_shape``). Where the budget holds at least ``MIN_CHUNK_ROWS``
whole rows, a block is whole rows: its logits give the statistics and, from the same tensor,
the gradients (three GEMMs). Where it does not (large vocabularies), a block is a few hundred
rows cut into vocabulary tiles: one pass over the tiles computes the statistics with an online
log-sum-exp, a second recomputes each tile's logits for its gradient (four GEMM-equivalents),
and dW is read and written once per block rather than once per handful of rows.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from fused_ce._validation import check_target_values

# Bytes of logits-sized fp32 workspace one row chunk may use. Big enough for efficient GEMMs,
# small enough that the whole forward+backward stays far below the logits' size.
DEFAULT_CHUNK_BYTES = 32 * 2**20
LOW_MEMORY_CHUNK_BYTES = 4 * 2**20
# With dW computed, the default budget grows to dW's size over this: at a large vocabulary a
# block of whole rows then holds a few hundred rows (three GEMMs, dW read and written once per
# block) where 32 MiB would cut them into vocabulary tiles (four GEMM-equivalents). Only where
# the weight is stored in the accumulation dtype: whole rows up-cast the whole weight once
# (_Chunker), which for a 16-bit weight would add a V x H fp32 copy.
DW_BUDGET_FRACTION = 8
# Whole-row chunks of fewer rows than this give way to vocabulary tiles (block_shape), which
# are at least MIN_TILE_COLS wide.
MIN_CHUNK_ROWS = 256
MIN_TILE_COLS = 128


class GradCoefs(NamedTuple):
    """Per-row coefficients of the logits gradient (see the module docstring)."""

    target: Tensor
    smooth: Tensor
    prob: Tensor
    lse_sq: Tensor


class RowStats(NamedTuple):
    lse: Tensor
    target_logit: Tensor
    weighted_sum: Tensor
    max_logit: Tensor
    argmax: Tensor
    dx: Optional[Tensor] = None
    dw: Optional[Tensor] = None
    db: Optional[Tensor] = None
    nll: Optional[Tensor] = None
    row_loss: Optional[Tensor] = None  # loss_i (fused_ce.ops), when the backend computed it
    # None: dx has x's rows; else dx holds the valid rows only, its row k being x's row
    # dx_rows[k] (dx_rows lists all of x's rows, valid ones first: scatter_rows)
    dx_rows: Optional[Tensor] = None


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half/bfloat16/float32 inputs, fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def chunk_rows(vocab: int, dtype: torch.dtype, buffers: int, low_memory: bool,
               dw_bytes: int = 0) -> int:
    """Rows per chunk so that `buffers` logits-sized chunks stay within the workspace budget
    (``_budget``)."""
    per_row = max(1, vocab) * _itemsize(dtype) * buffers
    return max(1, _budget(low_memory, dw_bytes) // per_row)


def _budget(low_memory: bool, dw_bytes: int = 0) -> int:
    """The workspace budget: LOW_MEMORY_CHUNK_BYTES, or DEFAULT_CHUNK_BYTES raised to
    ``dw_bytes`` / DW_BUDGET_FRACTION (``dw_bytes``: the size of a dW the loss computes in the
    weight's own dtype, else 0)."""
    if low_memory:
        return LOW_MEMORY_CHUNK_BYTES
    return max(DEFAULT_CHUNK_BYTES, dw_bytes // DW_BUDGET_FRACTION)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def block_shape(rows: int, vocab: int, hidden: int, dtype: torch.dtype, buffers: int,
                low_memory: bool, dw_bytes: int = 0) -> tuple[int, int]:
    """(rows per block, vocabulary columns per tile) of the loss's blocks over ``rows``
    processed rows, within the workspace budget (``_budget``; ``low_memory``: the smaller one).

    Whole rows (columns = vocab: one pass, three GEMMs) when the budget holds
    ``MIN_CHUNK_ROWS`` of them, or all the rows. Else tiles of the budget's size whose block of
    inputs (rows x hidden) fits the budget too: a statistics pass over the tiles, then a
    gradient pass that recomputes them (four GEMM-equivalents). Chunks of a few whole rows would
    cost more: CPU GEMMs over few rows run up to 1.5x slower, and each chunk re-reads and
    re-writes the whole fp32 dW (2 GiB at Llama-3's head), where a block of tiles does so once.
    """
    whole = chunk_rows(vocab, dtype, buffers, low_memory, dw_bytes)
    if whole >= min(rows, MIN_CHUNK_ROWS):
        return whole, vocab
    budget, itemsize = _budget(low_memory, dw_bytes), _itemsize(dtype)
    block = max(1, min(rows, budget // (max(1, hidden) * itemsize),
                       budget // (MIN_TILE_COLS * itemsize * buffers)))
    cols = max(1, budget // (block * itemsize * buffers))
    return (block, cols) if cols < vocab else (max(1, whole), vocab)


def _processed_rows(target: Tensor, ignore_index: int) -> Tensor:
    return (target != ignore_index).nonzero().squeeze(1)


def _local_targets(target_rows: Tensor, vocab: int) -> tuple[Tensor, Tensor]:
    """(column index clamped into range, mask of rows whose target is a column of this weight)."""
    has = (target_rows >= 0) & (target_rows < vocab)
    return torch.where(has, target_rows, torch.zeros_like(target_rows)), has


def nll_from(finite: Tensor, m: Tensor, log_s: Tensor, lse: Tensor, target_logit: Tensor,
             has_target: Tensor) -> Tensor:
    """lse - z_t computed as (m - z_t) + log_s, with m the row max and log_s = logsumexp(z - m),
    where m is finite and the target is a column of this weight: when the target holds nearly
    all the probability log_s is tiny and lse = m + log_s has already rounded it away. Else
    lse - z_t as it is."""
    return torch.where(finite & has_target, (m - target_logit) + log_s, lse - target_logit)


class _Chunker:
    """Computes the logits of a block of rows (whole rows, or one vocabulary tile of them) and
    their gradients, sharing one code path between ``forward`` (lse from the same pass) and
    ``backward`` (lse given)."""

    def __init__(self, x, weight, bias, class_weight, softcap, whole_rows: bool):
        self.acc = accumulation_dtype(x.dtype)
        # Every GEMM runs in `acc`. Whole rows use one up-cast copy of the weight (a no-op for
        # fp32/fp64); tiles up-cast one tile at a time, so that a 16-bit weight adds no
        # V x H fp32 copy to the workspace (weight_tile).
        self.weight = weight.to(self.acc) if whole_rows else weight
        self.bias = None if bias is None else bias.to(self.acc)
        self.class_weight = None if class_weight is None else class_weight.to(self.acc)
        self.softcap = softcap
        self.x = x

    def rows(self, rows: Tensor) -> Tensor:
        """The input rows ``rows``, in the accumulation dtype."""
        return self.x.index_select(0, rows).to(self.acc)

    def weight_tile(self, cols: slice) -> Tensor:
        """The weight's rows ``cols`` in the accumulation dtype."""
        return self.weight[cols].to(self.acc)

    def logits(self, xc: Tensor, cols: slice = slice(None), with_cap_factor: bool = False,
               w: Optional[Tensor] = None):
        """(logits of the rows ``xc`` in the vocabulary columns ``cols``, the softcap's derivative
        or None); ``w``: weight_tile(cols) when the caller has it. With a softcap c the
        derivative d(c tanh(u/c))/du = 1 - tanh^2(u/c) is computed as sech^2(u/c) from the raw
        logits: 1 - t^2 from the rounded t would cancel where tanh saturates."""
        w = self.weight_tile(cols) if w is None else w
        z = xc @ w.t() if self.bias is None else torch.addmm(self.bias[cols], xc, w.t())
        cap_factor = None
        if self.softcap is not None:
            z.div_(self.softcap)
            if with_cap_factor:  # (cosh overflows to inf past |u/c| ~ 89: the factor is 0)
                cap_factor = torch.cosh(z).reciprocal_().square_()
            z.tanh_().mul_(self.softcap)
        return z, cap_factor

    def grad_logits_(self, z, lse, tgt, has_tgt, coefs_rows, cap_factor, shifted=None,
                     cols: slice = slice(None), exp_sums=None, target_logit=None) -> Tensor:
        """Overwrites the logits ``z`` (columns ``cols``) with dz (module docstring);
        ``cap_factor`` from ``logits`` when a softcap is set; ``tgt`` the target's column within
        ``cols`` where ``has_tgt``. ``shifted = (m, s)`` with ``s = logsumexp(z - m)`` over the
        whole row (lse = m + s): the log-probabilities are then (z - m) - s, which keeps the
        digits that rounding m + s into one fp32 lse drops (at |lse| ~ 5 it rounds to 4.8e-7,
        all of 1 - p when p ~ 1 - 2e-7); without it, z - lse. With ``exp_sums`` (whole rows,
        after _whole_row_stats_) z already holds exp(z - m) and exp_sums its row sums: the
        probabilities are z / exp_sums, without a second pass of exp, and the target's
        log-probability comes from its logit ``target_logit``."""
        target_c, smooth_c, prob_c, lse_sq_c = (c.to(self.acc) for c in coefs_rows)
        alpha = prob_c + 2 * lse_sq_c * lse
        rows = torch.arange(z.shape[0], device=z.device)
        if exp_sums is not None:
            log_p_t = (target_logit - shifted[0]) - shifted[1]
            z.mul_((alpha / exp_sums)[:, None])
        else:
            if shifted is None:
                z.sub_(lse[:, None])
            else:
                z.sub_(shifted[0][:, None]).sub_(shifted[1][:, None])
            log_p_t = z[rows, tgt]
            z.exp_().mul_(alpha[:, None])
        # The target column, alpha * p_t - target_c, as alpha * expm1(log p_t) + (alpha -
        # target_c): equal, but a p_t near 1 is stored with an absolute error of ~6e-8 in fp32,
        # which is all of 1 - p_t once that is ~1e-7; expm1 of log p_t keeps 1 - p_t to a few
        # ulps. Without smoothing and z-loss alpha - target_c is exactly 0.
        z_t = alpha * torch.expm1(log_p_t) + ((prob_c - target_c) + 2 * lse_sq_c * lse)
        z[rows, tgt] = torch.where(has_tgt, z_t, z[rows, tgt])
        if self.class_weight is None:
            z.sub_(smooth_c[:, None])
        else:
            z.addr_(smooth_c, self.class_weight[cols], alpha=-1)
        if cap_factor is not None:
            z.mul_(cap_factor)
        return z


class _BlockStats(NamedTuple):
    """Row statistics of one block: lse = m + log_s with m the row max (0 where it is not
    finite) and log_s = logsumexp(z - m), kept apart for the nll and the gradient."""

    finite: Tensor
    m: Tensor
    log_s: Tensor
    target_logit: Tensor
    weighted_sum: Optional[Tensor]
    max_logit: Tensor
    argmax: Tensor

    @property
    def lse(self) -> Tensor:
        return self.m + self.log_s


def _finite_shift(mx: Tensor) -> tuple[Tensor, Tensor]:
    """(finite, m): the rows whose max ``mx`` is finite, and the shift m the log-sum-exp is
    taken around: the max, 0 where it is not finite (an inf or nan max then reaches the lse)."""
    finite = torch.isfinite(mx)
    return finite, torch.where(finite, mx, 0)


def _shifted_lse(z: Tensor, mx: Optional[Tensor] = None):
    """(finite, m, s): lse = m + s with m the row max ``mx`` (0 where it is not finite) and
    s = logsumexp(z - m), kept apart for the nll and the gradient (grad_logits_)."""
    finite, m = _finite_shift(z.amax(dim=1) if mx is None else mx)
    return finite, m, torch.logsumexp(z - m[:, None], dim=1)


def _tiles(vocab: int, cols: int) -> list[slice]:
    """The vocabulary's tiles of ``cols`` columns (the last one narrower)."""
    return [slice(c0, min(vocab, c0 + cols)) for c0 in range(0, vocab, cols)]


def _tile_targets(tgt: Tensor, has_tgt: Tensor, cols: slice) -> tuple[Tensor, Tensor]:
    """(each row's target column within ``cols``, 0 where it is elsewhere; the mask of the rows
    whose target is in ``cols``)."""
    inside = has_tgt & (tgt >= cols.start) & (tgt < cols.stop)
    return torch.where(inside, tgt - cols.start, 0), inside


def _weighted_sum(ch: _Chunker, z: Tensor, cols: slice = slice(None)) -> Tensor:
    return z.sum(1) if ch.class_weight is None else z @ ch.class_weight[cols]


def _whole_row_stats_(ch, z, tgt, has_tgt, with_weighted_sum) -> tuple[_BlockStats, Tensor]:
    """(statistics of the whole rows of logits ``z``, the row sums of exp(z - m)); z is left
    holding exp(z - m), m the row max (0 where it is not finite), which grad_logits_ scales
    into the probabilities: one pass of exp over the logits, not two, and no copy of them."""
    mx, am = z.max(dim=1)
    zt = torch.where(has_tgt, z.gather(1, tgt[:, None]).squeeze(1), 0)
    ws = _weighted_sum(ch, z) if with_weighted_sum else None
    finite, m = _finite_shift(mx)
    sums = z.sub_(m[:, None]).exp_().sum(1)
    return _BlockStats(finite, m, sums.log(), zt, ws, mx, am), sums


def _tile_stats(ch, xc, tgt, has_tgt, cols, with_weighted_sum) -> _BlockStats:
    """_whole_row_stats_ of the rows ``xc`` from vocabulary tiles of ``cols`` columns, one tile
    of logits alive at a time: the log-sum-exp online (s = sum_j exp(z_j - m) rescaled by
    exp(m_old - m_new) when a tile raises the running max m), the argmax keeping the first
    column of the row max (a later tile wins only if strictly greater, or NaN)."""
    vocab, r = ch.weight.shape[0], xc.shape[0]
    m_run = torch.full((r,), float("-inf"), dtype=ch.acc, device=xc.device)
    s = torch.zeros_like(m_run)
    best, zt = m_run.clone(), torch.zeros_like(m_run)
    am = torch.zeros(r, dtype=torch.long, device=xc.device)
    ws = torch.zeros_like(m_run) if with_weighted_sum else None
    for cs in _tiles(vocab, cols):
        z, _ = ch.logits(xc, cs)
        tm, ti = z.max(dim=1)
        take = (tm > best) | (tm.isnan() & ~best.isnan())
        best, am = torch.where(take, tm, best), torch.where(take, ti + cs.start, am)
        tl, inside = _tile_targets(tgt, has_tgt, cs)
        zt = torch.where(inside, z.gather(1, tl[:, None]).squeeze(1), zt)
        if ws is not None:
            ws += _weighted_sum(ch, z, cs)
        m_new = torch.maximum(m_run, tm)
        shift = torch.where(torch.isfinite(m_new), m_new, 0)
        # s is kept as it is where the running max is not finite: 0 while it is -inf (every
        # exp so far was 0), inf or nan once a logit was +inf or nan
        rescale = torch.where(torch.isfinite(m_run), torch.exp(m_run - shift), 1.0)
        s = s * rescale + z.sub_(shift[:, None]).exp_().sum(1)
        m_run = m_new
    return _BlockStats(*_finite_shift(m_run), s.log(), zt, ws, best, am)


def _run(x, weight, bias, target, ignore_index, softcap, class_weight, *, lse_in, coefs,
         with_weighted_sum, need_dx, need_dw, need_db, low_memory, lse_is_local=False,
         round_grads=True):
    n, vocab = x.shape[0], weight.shape[0]
    acc = accumulation_dtype(x.dtype)
    rows_all = _processed_rows(target, ignore_index)
    want_grads = coefs is not None and (need_dx or need_dw or need_db)
    dw_in_acc = want_grads and need_dw and weight.dtype == acc
    dw_bytes = weight.numel() * _itemsize(acc) if dw_in_acc else 0
    step, cols = block_shape(rows_all.numel(), vocab, x.shape[1], acc,
                             2 if softcap is not None else 1, low_memory, dw_bytes)
    whole_rows = cols >= vocab
    ch = _Chunker(x, weight, bias, class_weight, softcap, whole_rows)
    dx = torch.zeros(x.shape, dtype=acc, device=x.device) if want_grads and need_dx else None
    dw = torch.zeros(weight.shape, dtype=acc, device=x.device) if want_grads and need_dw else None
    db = torch.zeros(vocab, dtype=acc, device=x.device) if want_grads and need_db else None

    stats_wanted = lse_in is None
    if stats_wanted:
        lse = torch.zeros(n, dtype=acc, device=x.device)
        target_logit = torch.zeros_like(lse)
        weighted_sum = torch.zeros_like(lse)
        max_logit = torch.zeros_like(lse)
        nll = torch.zeros_like(lse)
        argmax = torch.full((n,), ignore_index, dtype=torch.long, device=x.device)
    # the gradient takes its probabilities from m + s where the row's own statistics are known
    own_stats = stats_wanted or (lse_is_local and want_grads)

    for start in range(0, rows_all.numel(), step):
        rows = rows_all[start:start + step]
        xc = ch.rows(rows)
        tgt, has_tgt = _local_targets(target.index_select(0, rows), vocab)
        st = sums = None
        if whole_rows:
            z, cap_factor = ch.logits(xc, with_cap_factor=want_grads)
            if own_stats:  # (z then holds exp(z - m))
                st, sums = _whole_row_stats_(ch, z, tgt, has_tgt,
                                             stats_wanted and with_weighted_sum)
        elif own_stats:
            st = _tile_stats(ch, xc, tgt, has_tgt, cols, stats_wanted and with_weighted_sum)
        if stats_wanted:
            lse_c = st.lse
            lse.index_copy_(0, rows, lse_c)
            target_logit.index_copy_(0, rows, st.target_logit)
            nll.index_copy_(0, rows, nll_from(st.finite, st.m, st.log_s, lse_c,
                                              st.target_logit, has_tgt))
            if with_weighted_sum:
                weighted_sum.index_copy_(0, rows, st.weighted_sum)
            max_logit.index_copy_(0, rows, st.max_logit)
            argmax.index_copy_(0, rows, st.argmax)
        else:
            lse_c = lse_in.index_select(0, rows).to(acc)
        if not want_grads:
            continue
        shifted = None if st is None else (st.m, st.log_s)
        coefs_rows = [c.index_select(0, rows) for c in coefs]
        # whole rows: one tile, its logits from above; else each tile's logits recomputed
        dx_c = torch.zeros_like(xc) if dx is not None else None
        for cs in _tiles(vocab, cols):
            w_cs = ch.weight_tile(cs)
            if not whole_rows:
                z, cap_factor = ch.logits(xc, cs, with_cap_factor=True, w=w_cs)
            tl, inside = _tile_targets(tgt, has_tgt, cs)
            dz = ch.grad_logits_(z, lse_c, tl, inside, coefs_rows, cap_factor, shifted, cs,
                                 sums, None if st is None else st.target_logit)
            if dx_c is not None:
                dx_c.addmm_(dz, w_cs)
            if dw is not None:
                dw[cs].addmm_(dz.t(), xc)
            if db is not None:
                db[cs].add_(dz.sum(0))
        if dx_c is not None:
            dx.index_copy_(0, rows, dx_c)

    grads = (dx, dw, db)
    if round_grads:
        grads = rounded_grads(grads, x, weight, bias)
    if not stats_wanted:
        return grads
    return RowStats(lse, target_logit, weighted_sum, max_logit, argmax, *grads, nll)


def forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, ignore_index: int,
            softcap: Optional[float], class_weight: Optional[Tensor], *,
            with_weighted_sum: bool = False, coefs: Optional[GradCoefs] = None,
            need_dx: bool = False, need_dw: bool = False, need_db: bool = False,
            low_memory: bool = False, check_targets: bool = False,
            round_grads: bool = True, compact_dx: bool = False) -> RowStats:
    """Per-row statistics of the logits, plus their gradients when ``coefs`` is given
    (in the accumulation dtype without ``round_grads``). ``compact_dx`` lets a backend return
    the valid rows of dx only (RowStats.dx_rows); this one always returns all rows.
    ``check_targets``: raise ValueError for a target outside ``[0, V)`` that is not
    ``ignore_index`` (else such a row is "out of shard", see above)."""
    if check_targets:
        check_target_values(target, weight.shape[0], ignore_index)
    return _run(x, weight, bias, target, ignore_index, softcap, class_weight, lse_in=None,
                coefs=coefs, with_weighted_sum=with_weighted_sum, need_dx=need_dx,
                need_dw=need_dw, need_db=need_db, low_memory=low_memory,
                round_grads=round_grads)


def backward(x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, ignore_index: int,
             softcap: Optional[float], class_weight: Optional[Tensor], lse: Tensor,
             coefs: GradCoefs, *, need_dx: bool, need_dw: bool, need_db: bool,
             low_memory: bool = False, lse_is_local: bool = False):
    """(dx, dw, db) of the logits gradient defined by ``coefs`` and the given ``lse``.
    ``lse_is_local``: the lse is these logits' own (not a vocab-parallel global one), so the
    probabilities may come from the recomputed logits' m + s (grad_logits_), which keeps the
    digits the stored fp32 lse lost; the lse itself still sets the z-loss term."""
    return _run(x, weight, bias, target, ignore_index, softcap, class_weight, lse_in=lse,
                coefs=coefs, with_weighted_sum=False, need_dx=need_dx, need_dw=need_dw,
                need_db=need_db, low_memory=low_memory, lse_is_local=lse_is_local)


def log_softmax(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``log_softmax(x @ weight.T + bias, -1)`` in ``x``'s dtype, one row chunk at a time."""
    n, vocab = x.shape[0], weight.shape[0]
    out = torch.empty((n, vocab), dtype=x.dtype, device=x.device)
    ch = _Chunker(x, weight, bias, None, None, whole_rows=True)
    step = chunk_rows(vocab, ch.acc, 1, False)
    for start in range(0, n, step):
        rows = torch.arange(start, min(n, start + step), device=x.device)
        z, _ = ch.logits(ch.rows(rows))
        _, m, s = _shifted_lse(z)  # (z - m) - s: the digits an fp32 lse = m + s would drop
        out[start:start + rows.numel()] = z.sub_(m[:, None]).sub_(s[:, None])
    return out


def grad_dtypes(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> tuple:
    """The dtypes of dx, dW and db: their parameters' (db: the weight's without a bias)."""
    return x.dtype, weight.dtype, bias.dtype if bias is not None else weight.dtype


def rounded_grads(grads, x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> tuple:
    """(dx, dw, db) in their parameters' dtypes (grad_dtypes); None stays None."""
    return tuple(g if g is None or g.dtype == dt else g.to(dt)
                 for g, dt in zip(grads, grad_dtypes(x, weight, bias)))


def mean_from_sum(loss: Tensor, d_nll: Tensor, divisor: Tensor) -> Tensor:
    """'mean' from a summed loss and ``api._coefficients``' denominator and divisor: the sum
    divided by the divisor, nan where the denominator is 0 (torch: 0/0 when no target is
    valid; the gradients stay zero)."""
    return loss / divisor + torch.where(d_nll == 0, math.nan, 0.0).to(loss.dtype)


def total_loss(rows: Tensor, mean_d: Optional[Tensor] = None,
               mean_divisor: Optional[Tensor] = None) -> Tensor:
    """``rows.sum()``, or ``mean_from_sum`` of it when the mean's denominator and divisor are
    given."""
    loss = rows.sum()
    return loss if mean_divisor is None else mean_from_sum(loss, mean_d, mean_divisor)


def scaled_grads(grads, dtypes, g: Tensor, dx_rows: Optional[Tensor] = None) -> list:
    """[grad * g in dtype] (module docstring; g a 0-dim tensor of the loss's dtype); with
    ``dx_rows`` the first gradient holds the valid rows only (RowStats.dx_rows)."""
    grads = list(grads)
    if dx_rows is not None:
        grads[0] = scatter_rows(grads[0], dx_rows)
    return [grad.mul_(g) if grad.dtype == dt else (grad * g).to(dt)
            for grad, dt in zip(grads, dtypes)]


def scatter_rows(dx: Tensor, dx_rows: Tensor) -> Tensor:
    """The full dx of RowStats' compact one: a row per entry of ``dx_rows``, dx's row k at row
    ``dx_rows[k]``, zeros on the rest."""
    full = dx.new_zeros((dx_rows.shape[0], dx.shape[1]))
    return full.index_copy_(0, dx_rows[:dx.shape[0]], dx)
