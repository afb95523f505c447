"""Per-row statistics, loss and gradient coefficients of the finish kernels (row_chunks.py,
logits_tiles.py): merges lane- or tile-wise online log-sum-exp accumulators and writes a row's
lse, target logit, nll, weighted sum, max, argmax and loss (ops.py's loss_i); the per-row
factors of its logits' gradient dz_j = alpha p_j - c_tgt [j = t] - c_smooth w_j (also for the
sweeps' grad_logits.py, on a block of rows)."""

import triton
import triton.language as tl  # noqa: F401 (triton: the jit's namespace)


@triton.jit
def _nll(mx, log_s, lse, zt, has_t):
    """reference.nll_from for one row (NaN and +-inf maxima are not finite)."""
    finite = tl.abs(mx) < float("inf")
    return tl.where(finite & has_t, (mx - zt) + log_s, lse - zt)


@triton.jit
def _row_loss(row, lse, zt, ws, nll, c_tgt_ptr, c_smooth_ptr, c_prob_ptr, c_lse_sq_ptr,
              WITH_WS: tl.constexpr):
    """ops._row_loss for one row: prob lse - target z_t - smooth ws + lse_sq lse^2, or without
    the weighted sum (prob = target) target nll + lse_sq lse^2."""
    c_tgt = tl.load(c_tgt_ptr + row)
    if WITH_WS:
        loss = (tl.load(c_prob_ptr + row) * lse - c_tgt * zt
                - tl.load(c_smooth_ptr + row) * ws)
    else:
        loss = c_tgt * nll
    return loss + tl.load(c_lse_sq_ptr + row) * lse * lse


@triton.jit
def merged_lse(m, s):
    """(M, log S) of a row from its lanes' (or tiles') running maxima m and sums
    s = sum exp(z - m): lse = M + log S with M = max m and S = sum s exp(m - M). Lanes that
    saw no finite logit (m = -inf) add nothing, also when every lane is such (lse = -inf)."""
    mx = tl.max(m, 0)
    return mx, tl.log(tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - mx)), 0))


@triton.jit
def row_max(m, arg):
    """(max, argmax) of a row from its lanes' maxima ``m`` and their first columns ``arg``: the
    first column attaining the row max is the smallest lane-first index among the lanes whose
    max equals it (torch.argmax's tie rule)."""
    mx = tl.max(m, 0)
    return mx, tl.min(tl.where(m == mx, arg, 2147483647), 0)


@triton.jit
def store_row_stats(m, s, arg, ws, row, tgt, zt, V, c_tgt_ptr, c_smooth_ptr, c_prob_ptr,
                    c_lse_sq_ptr, lse_ptr, zt_ptr, ws_ptr, max_ptr, am_ptr, nll_ptr, loss_ptr,
                    WITH_WS: tl.constexpr, WITH_LOSS: tl.constexpr):
    """Merges the lanes (row_chunks._fold_block's, or one per vocabulary tile: each a max m,
    s = sum exp(z - m), the first column of m, a weighted sum) and writes the row's statistics
    and (WITH_LOSS: from the coefficients) loss (``zt``: its target's finished logit, 0 when
    the target is not a column here); returns its lse."""
    mx, am = row_max(m, arg)
    return store_merged_stats(mx, am, merged_lse(m, s)[1], ws, row, tgt, zt, V, c_tgt_ptr,
                              c_smooth_ptr, c_prob_ptr, c_lse_sq_ptr, lse_ptr, zt_ptr, ws_ptr,
                              max_ptr, am_ptr, nll_ptr, loss_ptr, WITH_WS, WITH_LOSS)


@triton.jit
def store_merged_stats(mx, am, log_s, ws, row, tgt, zt, V, c_tgt_ptr, c_smooth_ptr, c_prob_ptr,
                       c_lse_sq_ptr, lse_ptr, zt_ptr, ws_ptr, max_ptr, am_ptr, nll_ptr,
                       loss_ptr, WITH_WS: tl.constexpr, WITH_LOSS: tl.constexpr):
    """store_row_stats from the merged row: its max ``mx``, argmax ``am`` and log S, where
    lse = mx + log S; ``ws``: the lanes' (or tiles') weighted sums. Returns the lse."""
    lse = mx + log_s
    has_t = (tgt >= 0) & (tgt < V)  # else the target is a column of another shard
    nll = _nll(mx, log_s, lse, zt, has_t)
    ws_sum = tl.sum(ws, 0)
    tl.store(lse_ptr + row, lse)
    tl.store(zt_ptr + row, zt)
    tl.store(nll_ptr + row, nll)
    tl.store(ws_ptr + row, ws_sum)
    tl.store(max_ptr + row, mx)
    tl.store(am_ptr + row, am.to(tl.int64))
    if WITH_LOSS:
        tl.store(loss_ptr + row, _row_loss(row, lse, zt, ws_sum, nll, c_tgt_ptr, c_smooth_ptr,
                                           c_prob_ptr, c_lse_sq_ptr, WITH_WS))
    return lse


@triton.jit
def grad_coefs(row, lse, c_tgt_ptr, c_smooth_ptr, c_prob_ptr, c_lse_sq_ptr):
    """(alpha, c_tgt, c_smooth) of row ``row``'s dz: alpha = c_prob + 2 c_lse_sq lse (the z-loss
    term lse_sq lse^2 differentiates to 2 lse_sq lse p_j)."""
    alpha = tl.load(c_prob_ptr + row) + 2.0 * tl.load(c_lse_sq_ptr + row) * lse
    return alpha, tl.load(c_tgt_ptr + row), tl.load(c_smooth_ptr + row)


@triton.jit
def smoothing(cols, valid, c_smooth, cw_ptr, HAS_CW: tl.constexpr):
    """dz's label-smoothing term c_smooth w_j on columns ``cols`` (w_j: the class weights, 0
    where not ``valid``; 1 without class weights)."""
    term = c_smooth
    if HAS_CW:  # (one return: Triton wants a single return type)
        term = c_smooth * tl.load(cw_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    return term


@triton.jit
def store_ignored_stats(row_idx_ptr, k0, n_rows, ignore_index, lse_ptr, zt_ptr, ws_ptr,
                        max_ptr, am_ptr, nll_ptr, loss_ptr, FILL: tl.constexpr):
    """The statistics of the rows listed at positions [k0, k0 + FILL) of the row list below
    ``n_rows`` (positions from the valid count on: ignored rows): 0, argmax ``ignore_index``
    (row_stats.combine's contract), written by extra programs of a finish kernel's launch
    instead of torch fills of every row before it."""
    k = k0 + tl.arange(0, FILL)
    mask = k < n_rows
    row = tl.load(row_idx_ptr + k, mask=mask, other=0)
    zero = tl.zeros((FILL,), tl.float32)
    tl.store(lse_ptr + row, zero, mask=mask)
    tl.store(zt_ptr + row, zero, mask=mask)
    tl.store(ws_ptr + row, zero, mask=mask)
    tl.store(max_ptr + row, zero, mask=mask)
    tl.store(nll_ptr + row, zero, mask=mask)
    tl.store(loss_ptr + row, zero, mask=mask)
    tl.store(am_ptr + row, tl.full((FILL,), ignore_index, tl.int64), mask=mask)
