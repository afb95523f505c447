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
* ``scaled_grads(grads, dtypes, g)`` returns each gradient times the scalar ``g`` (the loss's
  upstream gradient, in the loss's dtype) in the given dtype: the product in the wider of the
  two precisions, rounded once; in place where a gradient already has its dtype.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from fused_ce._validation import check_target_values

# Bytes of logits-sized fp32 workspace one row chunk may use. Big enough for efficient GEMMs,
# small enough that the whole forward+backward stays far below the logits' size.
DEFAULT_CHUNK_BYTES = 32 * 2**20
LOW_MEMORY_CHUNK_BYTES = 4 * 2**20


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


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half/bfloat16/float32 inputs, fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def chunk_rows(vocab: int, dtype: torch.dtype, buffers: int, low_memory: bool) -> int:
    """Rows per chunk so that `buffers` logits-sized chunks stay within the workspace budget."""
    budget = LOW_MEMORY_CHUNK_BYTES if low_memory else DEFAULT_CHUNK_BYTES
    per_row = max(1, vocab) * torch.finfo(dtype).bits // 8 * buffers
    return max(1, budget // per_row)


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
    """Computes the logits of row chunks and their gradients, sharing one code path between
    ``forward`` (lse from the same chunk) and ``backward`` (lse given)."""

    def __init__(self, x, weight, bias, class_weight, softcap):
        self.acc = accumulation_dtype(x.dtype)
        # One up-cast copy of the weight (a no-op for fp32/fp64) keeps every GEMM in `acc`.
        self.weight = weight.to(self.acc)
        self.bias = None if bias is None else bias.to(self.acc)
        self.class_weight = None if class_weight is None else class_weight.to(self.acc)
        self.softcap = softcap
        self.x = x

    def logits(self, rows: Tensor, with_cap_factor: bool = False):
        """(x rows, their logits, the softcap's derivative or None). With a softcap c the
        derivative d(c tanh(u/c))/du = 1 - tanh^2(u/c) is computed as sech^2(u/c) from the raw
        logits: 1 - t^2 from the rounded t would cancel where tanh saturates."""
        xc = self.x.index_select(0, rows).to(self.acc)
        if self.bias is None:
            z = xc @ self.weight.t()
        else:
            z = torch.addmm(self.bias, xc, self.weight.t())
        cap_factor = None
        if self.softcap is not None:
            z.div_(self.softcap)
            if with_cap_factor:  # (cosh overflows to inf past |u/c| ~ 89: the factor is 0)
                cap_factor = torch.cosh(z).reciprocal_().square_()
            z.tanh_().mul_(self.softcap)
        return xc, z, cap_factor

    def grad_logits_(self, z, lse, tgt, has_tgt, coefs_rows, cap_factor, shifted=None) -> Tensor:
        """Overwrites the chunk's logits ``z`` with dz (module docstring); ``cap_factor`` from
        ``logits`` when a softcap is set. ``shifted = (m, s)`` with ``s = logsumexp(z - m)``
        (lse = m + s): the log-probabilities are then (z - m) - s, which keeps the digits that
        rounding m + s into one fp32 lse drops (at |lse| ~ 5 it rounds to 4.8e-7, all of
        1 - p when p ~ 1 - 2e-7); without it, z - lse."""
        target_c, smooth_c, prob_c, lse_sq_c = (c.to(self.acc) for c in coefs_rows)
        alpha = prob_c + 2 * lse_sq_c * lse
        rows = torch.arange(z.shape[0], device=z.device)
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
            z.addr_(smooth_c, self.class_weight, alpha=-1)
        if cap_factor is not None:
            z.mul_(cap_factor)
        return z


def _shifted_lse(z: Tensor, mx: Optional[Tensor] = None):
    """(finite, m, s): lse = m + s with m the row max ``mx`` (0 where it is not finite) and
    s = logsumexp(z - m), kept apart for the nll and the gradient (grad_logits_)."""
    mx = z.amax(dim=1) if mx is None else mx
    finite = torch.isfinite(mx)
    m = torch.where(finite, mx, 0)
    return finite, m, torch.logsumexp(z - m[:, None], dim=1)


def _run(x, weight, bias, target, ignore_index, softcap, class_weight, *, lse_in, coefs,
         with_weighted_sum, need_dx, need_dw, need_db, low_memory, lse_is_local=False,
         round_grads=True):
    n, vocab = x.shape[0], weight.shape[0]
    ch = _Chunker(x, weight, bias, class_weight, softcap)
    acc = ch.acc
    want_grads = coefs is not None and (need_dx or need_dw or need_db)
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

    rows_all = _processed_rows(target, ignore_index)
    step = chunk_rows(vocab, acc, 2 if softcap is not None else 1, low_memory)
    for start in range(0, rows_all.numel(), step):
        rows = rows_all[start:start + step]
        xc, z, cap_factor = ch.logits(rows, with_cap_factor=want_grads)
        tgt, has_tgt = _local_targets(target.index_select(0, rows), vocab)
        shifted = None
        if stats_wanted:
            mx, am = z.max(dim=1)
            finite, m, s = _shifted_lse(z, mx)
            shifted = (m, s)
            lse_c = m + s
            lse.index_copy_(0, rows, lse_c)
            zt = z.gather(1, tgt[:, None]).squeeze(1) * has_tgt
            target_logit.index_copy_(0, rows, zt)
            nll.index_copy_(0, rows, nll_from(finite, m, s, lse_c, zt, has_tgt))
            if with_weighted_sum:
                ws = z.sum(1) if ch.class_weight is None else z @ ch.class_weight
                weighted_sum.index_copy_(0, rows, ws)
            max_logit.index_copy_(0, rows, mx)
            argmax.index_copy_(0, rows, am)
        else:
            lse_c = lse_in.index_select(0, rows).to(acc)
            if lse_is_local and want_grads:
                shifted = _shifted_lse(z)[1:]
        if not want_grads:
            continue
        dz = ch.grad_logits_(z, lse_c, tgt, has_tgt, [c.index_select(0, rows) for c in coefs],
                             cap_factor, shifted)
        if dx is not None:
            dx.index_copy_(0, rows, dz @ ch.weight)
        if dw is not None:
            dw.addmm_(dz.t(), xc)
        if db is not None:
            db.add_(dz.sum(0))

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
            round_grads: bool = True) -> RowStats:
    """Per-row statistics of the logits, plus their gradients when ``coefs`` is given
    (in the accumulation dtype without ``round_grads``).
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
    ch = _Chunker(x, weight, bias, None, None)
    step = chunk_rows(vocab, ch.acc, 1, False)
    for start in range(0, n, step):
        rows = torch.arange(start, min(n, start + step), device=x.device)
        _, z, _ = ch.logits(rows)
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


def scaled_grads(grads, dtypes, g: Tensor) -> list:
    """[grad * g in dtype] (module docstring; g a 0-dim tensor of the loss's dtype)."""
    return [grad.mul_(g) if grad.dtype == dt else (grad * g).to(dt)
            for grad, dt in zip(grads, dtypes)]
