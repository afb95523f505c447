"""The row-chunk path's logits with the softmax's first pass in the GEMM's epilogue.

Per chunk of c valid rows ``x_c`` (row_chunks.py runs the dX and dW products after it)::

    logits_tiles_kernel    persistent over the (row tile, vocabulary tile) pairs; tl.dot on
                           TMA-loaded tiles of x_c and W gives z = x_c W_tile^T (+ b) in fp32
                           registers, and the epilogue writes
                               E = exp(z - m_t)   in the input dtype, where D goes,
                           with m_t the row's max over the tile, and per (row, tile) m_t,
                           s_t = sum_j exp(z_j - m_t), the first column of m_t and (label
                           smoothing) sum_j w_j z_j. The epilogue is the kernel's cost beyond
                           the tensor cores (its warps run it while no MMA is issued), so it
                           computes only these: max and argmax in one reduction, exp as a
                           flush-to-zero exp2 (sm_90, 128 x 256 tile in column halves,
                           counted without the tile loop's flattening: 2560 instructions
                           instead of 3632 when it also extracted the target logit)
    finish_tiles_kernel    per row: merges the tiles (lse = M + log sum_t s_t exp(m_t - M),
                           M = max_t m_t), takes the target logit z_t as a dot product of x's
                           row and W_t (or M where the target is the argmax), writes the
                           statistics and the loss, and rewrites E in place as
                           D = alpha exp(m_t - lse) E - c_tgt [j = t] - c_smooth w_j;
                           the target's entry from the fp32 z_t, not from the rounded E
    d_tiles_kernel         with a bias, in place of finish_tiles_kernel's D: the same D, by
                           (64 rows x 2048 columns) tiles, and each tile's column sums of D
                           (as rounded) in fp32; their sum over the row tiles is db, which
                           then needs no second read of D (H100, bert8k: 0.39 ms for D and
                           the sums against 0.37 + 0.24 for D and a (1 x c) product over it)

Bytes per logit beyond the GEMM's inputs: E written, read, D written (3 x 2 for bf16), where
the fp32 path (cuBLAS Z, finish_rows_kernel) moves 14: Z written, read twice, D written. D's
non-target entries are rounded twice (E, then D), which the dX and dW products average over
(each sums thousands of them) before their own single rounding.

Used for bf16 inputs without a given lse; under the Triton interpreter (tests) for fp32 too,
with E in fp32. With a softcap (logits c tanh(z / c)) the gradient of each logit carries the
cap's derivative f_j = 1 - (z_j / c)^2 of the capped z_j, which D cannot take from the rounded
E: the epilogue stores E f instead of E (from the fp32 z), and the target's entry gets f_t from
the fp32 z_t. Label smoothing's term of D would need f_j alone: with both, the fp32 path serves.

log_softmax (log_softmax_chunks._log_softmax_tiles) runs the same GEMM with LOG_PROBS: the
epilogue stores U = z - m_t instead of E, and log_probs_tiles_kernel writes log p = U + m_t -
lse. U is rounded once before the output is: |U| <= |log p|, so each entry is within two
roundings of its own size (rounding z itself, as bf16 logits do, costs |z| / |log p|
roundings).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fused_ce.kernels import config
from fused_ce.kernels.logits import cap_derivative, tanh
from fused_ce.kernels.problem import Problem, descriptor_ok
from fused_ce.kernels.row_loss import (grad_coefs, merged_lse, row_max, smoothing,
                                       store_ignored_stats, store_merged_stats,
                                       store_row_stats)
from fused_ce.kernels.row_ref import scale_row, scaled_row, target_logit, tile_refs


# (the chunk's row counts and offsets are not specialized on: one compiled kernel serves every
# chunk size, so a chunk launched while a CUDA graph is captured, sized from N instead of the
# valid count, runs the kernel that eager calls have loaded; loading a module during capture
# is refused by some CUDA setups. The row counts only bound loops and per-row masks here.)
@triton.jit(do_not_specialize=["c0", "M", "n_progs", "min_count"])
def logits_tiles_kernel(x_desc, w_desc, e_desc, bias_ptr, cw_ptr, count_ptr, c0, M, V, H, m_ptr,
                        s_ptr, a_ptr, ws_ptr, ref_ptr, n_tiles_v, n_progs, softcap, min_count,
                        E_DTYPE: tl.constexpr, HAS_BIAS: tl.constexpr,
                        HAS_CW: tl.constexpr, WITH_WS: tl.constexpr, UPCAST: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        SPLIT: tl.constexpr, FLATTEN: tl.constexpr,
                        LOG_PROBS: tl.constexpr = False, STATS_ONLY: tl.constexpr = False,
                        HAS_SOFTCAP: tl.constexpr = False, ROW_REF: tl.constexpr = False):
    """E and the per-(row, tile) statistics of the M chunk rows (compacted positions c0 + r)
    over the V columns (module doc). A vocabulary tile (of the statistics and of E) is
    BN // SPLIT columns; the statistics of tile t at [r * n_tiles_v + t]. ``n_progs`` programs
    (the grid) take the (BM, BN) output tiles in turn. With LOG_PROBS (log_softmax: rows in
    order, no targets) E holds U = z - m_t instead and only m_t and s_t are stored. With
    STATS_ONLY (the forward pass without gradients, stats_pass.py) only the statistics are
    stored, no E (``e_desc`` may be None), of the logits softcapped where HAS_SOFTCAP (E holds
    no z to differentiate the cap by). With ROW_REF, E and s_t are taken against the row's
    reference ``ref_ptr[c0 + r]`` (row_ref.py) where the tile's max is not far above it. Otherwise
    the rows past the valid count (``count_ptr``, on the device; the chunk's first row is the
    compacted position c0) are not computed: a chunk launched before the host has read the
    count covers the first rows of the stable partition, the valid ones first. None is where
    the count is below ``min_count``: the host then drops such a chunk (row_chunks.py)."""
    if not LOG_PROBS:
        count = tl.load(count_ptr)
        M = tl.minimum(M, tl.maximum(count - c0, 0))
        M = tl.where(count < min_count, 0, M)
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(V, BN)
    for tile in tl.range(tl.program_id(0), n_m * n_n, n_progs, flatten=FLATTEN):
        # the row tiles of one W tile run next to each other: W comes from HBM once
        pid_m = tile % n_m
        pid_n = tile // n_m
        off_m = pid_m * BM
        off_n = pid_n * BN
        rows = off_m + tl.arange(0, BM)
        if ROW_REF:
            ref = tl.load(ref_ptr + c0 + rows, mask=rows < M, other=0.0)
        else:
            ref = tl.zeros((BM,), tl.float32)  # (not used)
        acc = tl.zeros((BM, BN), tl.float32)
        for k in range(0, H, BK):  # (the descriptors read zeros past H, V and M)
            a = x_desc.load([off_m, k])
            b = w_desc.load([off_n, k])
            if UPCAST:  # the interpreter's 16-bit dot is wrong (triton#11584)
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b.T, acc)
        # The epilogue runs on column halves of the accumulator when SPLIT = 2: a 128 x 256
        # accumulator takes 128 of a thread's 255 registers, and full-width temporaries beside
        # it spill to local memory.
        if SPLIT == 1:
            _tile_epilogue(acc, rows, off_m, off_n, pid_n, e_desc, bias_ptr, cw_ptr, M, V, m_ptr,
                           s_ptr, a_ptr, ws_ptr, ref, n_tiles_v, E_DTYPE, HAS_BIAS, HAS_CW,
                           WITH_WS, LOG_PROBS, STATS_ONLY, HAS_SOFTCAP, ROW_REF, softcap, BN)
        else:
            z0, z1 = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
            _tile_epilogue(z0, rows, off_m, off_n, 2 * pid_n, e_desc, bias_ptr, cw_ptr, M, V,
                           m_ptr, s_ptr, a_ptr, ws_ptr, ref, n_tiles_v, E_DTYPE, HAS_BIAS,
                           HAS_CW, WITH_WS, LOG_PROBS, STATS_ONLY, HAS_SOFTCAP, ROW_REF, softcap,
                           BN // 2)
            # (in the last tile, this half may lie past V: tile n_tiles_v, nothing stored)
            _tile_epilogue(z1, rows, off_m, off_n + BN // 2, 2 * pid_n + 1, e_desc, bias_ptr,
                           cw_ptr, M, V, m_ptr, s_ptr, a_ptr, ws_ptr, ref, n_tiles_v, E_DTYPE,
                           HAS_BIAS, HAS_CW, WITH_WS, LOG_PROBS, STATS_ONLY, HAS_SOFTCAP,
                           ROW_REF, softcap, BN // 2)


@triton.jit
def _tile_epilogue(z, rows, off_m, off_n, t, e_desc, bias_ptr, cw_ptr, M, V, m_ptr, s_ptr, a_ptr,
                   ws_ptr, ref, n_tiles_v, E_DTYPE: tl.constexpr,
                   HAS_BIAS: tl.constexpr, HAS_CW: tl.constexpr, WITH_WS: tl.constexpr,
                   LOG_PROBS: tl.constexpr, STATS_ONLY: tl.constexpr,
                   HAS_SOFTCAP: tl.constexpr, ROW_REF: tl.constexpr, softcap, BS: tl.constexpr):
    """Vocabulary tile t (columns off_n + [0, BS)) of the rows: E (with LOG_PROBS: U) and the
    statistics from the fp32 logits z (without the bias). In place on z, and each (BM, BS)
    temporary ends before the next begins (registers). With ROW_REF, E = exp(z - r) and s_t =
    sum exp(z - r) for the rows' references ``ref`` (r = row_ref.tile_refs(m_t, ref)), else
    r = m_t."""
    cols = off_n + tl.arange(0, BS)
    in_v = cols < V
    in_m = rows < tl.where(t < n_tiles_v, M, 0)  # no row of a tile past V
    stat = rows.to(tl.int64) * n_tiles_v + t
    if HAS_BIAS:
        z += tl.load(bias_ptr + cols, mask=in_v, other=0.0).to(tl.float32)[None, :]
    if HAS_SOFTCAP:
        z = softcap * tanh(z / softcap)
    if WITH_WS:
        if HAS_CW:
            cw = tl.load(cw_ptr + cols, mask=in_v, other=0.0).to(tl.float32)
        else:
            cw = tl.where(in_v, 1.0, 0.0)
        zw = z * cw[None, :]
        if HAS_SOFTCAP:
            # an inf in x makes the zero-padded columns' z nan (inf * 0); without a cap the row's
            # loss is nan anyway, with one it is finite (F.cross_entropy's), so drop them
            zw = tl.where(in_v[None, :], zw, 0.0)
        tl.store(ws_ptr + stat, tl.sum(zw, 1), mask=in_m)
    z = tl.where(in_v[None, :], z, float("-inf"))
    # a NaN anywhere makes the tile's sum NaN (exp(NaN)), hence the row's lse (m_t and its
    # column may then be the NaN's: the reduction's order decides)
    if LOG_PROBS:
        mt = tl.max(z, 1)
    else:
        # the max and its first column in one reduction, not a second pass comparing with it
        mt, arg = tl.reduce((z, tl.broadcast_to(cols[None, :], z.shape)), 1, _max_first)
        tl.store(a_ptr + stat, arg, mask=in_m)
    tl.store(m_ptr + stat, mt, mask=in_m)
    # z - r; exp(-inf - r) = 0 past V; a row of -inf logits takes r = 0 here (not -inf - -inf
    # = NaN)
    if ROW_REF:
        r = tile_refs(mt, ref)
    else:
        r = tl.where(mt == float("-inf"), 0.0, mt)
    u = z - r[:, None]
    if LOG_PROBS:
        # U stored rounded: |U| = m_t - z <= lse - z = |log p|, so U's rounding error is at
        # most one rounding of the log-probability itself (rounding z would cost |z| / |log p|
        # of them: large logits, confident tokens)
        tl.store(s_ptr + stat, tl.sum(_exp(u), 1), mask=in_m)
        e_desc.store([off_m, off_n], tl.where(in_v[None, :], u, 0.0).to(E_DTYPE))
    else:
        e = _exp(u)
        tl.store(s_ptr + stat, tl.sum(e, 1), mask=in_m)
        if not STATS_ONLY:
            if HAS_SOFTCAP:
                # E f_j (module doc) from z_j = u + r, which the cap keeps in [-c, c]; past V
                # (u = -inf) the clamp gives q = -1, so E = 0 there. (A tl.where on the columns
                # instead, or e * (1 - q^2), spills on sm_90: tools/sm90_registers.py)
                q = tl.maximum(u + r[:, None], -softcap) / softcap
                e = e - e * q * q
            e_desc.store([off_m, off_n], e.to(E_DTYPE))


@triton.jit
def _max_first(v1, i1, v2, i2):
    """Combine of the (max, first column) reduction: the larger value, on a tie the smaller
    column (torch.argmax's rule). (tl.max's own return_indices does the same, but the
    interpreter's raises on a row of NaN.)"""
    first = (v1 > v2) | ((v1 == v2) & (i1 < i2))
    return tl.where(first, v1, v2), tl.where(first, i1, i2)


@triton.jit
def _exp(u):
    """exp(u) as 2^(u log2 e): PTX ex2.approx.ftz (a multiply and one MUFU per element), where
    tl.exp's ex2.approx without ftz adds a compare and two predicated multiplies for results
    below 2^-126 (here: probabilities under 1e-38 flushed to 0)."""
    return tl.math.exp2(u * 1.4426950408889634)


@triton.jit(do_not_specialize=["c0", "n_chunk"])
def finish_tiles_kernel(e_ptr, lde, m_ptr, s_ptr, a_ptr, ws_in_ptr, n_tiles_v, x_ptr, ldx, w_ptr,
                        ldw, bias_ptr, H, cw_ptr, target_ptr, row_idx_ptr, count_ptr, c0,
                        c_tgt_ptr, c_smooth_ptr, c_prob_ptr, c_lse_sq_ptr, lse_ptr, zt_ptr,
                        ws_ptr, max_ptr, am_ptr, nll_ptr, loss_ptr, V, VPAD, softcap, n_chunk,
                        n_rows, ignore_index, ref_ptr, rs_ptr, dt_ptr, key_ptr, xs_ptr,
                        HAS_BIAS: tl.constexpr, HAS_CW: tl.constexpr, WITH_WS: tl.constexpr,
                        WITH_LOSS: tl.constexpr, NEED_D: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_H: tl.constexpr, TILES: tl.constexpr, BN: tl.constexpr,
                        HAS_SOFTCAP: tl.constexpr = False, FILL: tl.constexpr = 0,
                        ROW_REF: tl.constexpr = False):
    """One program per chunk row r < ``n_chunk`` (x's row ``x_ptr + r ldx``): the row's
    statistics and (with WITH_LOSS) loss from its tiles and its target logit (target_logit),
    then (with NEED_D) D over E in columns [0, VPAD) (0 past V), TILES vocabulary tiles of BN
    columns per step. Rows past the valid count (``count_ptr``, on the device) write nothing,
    as in the GEMM, but (with NEED_D) a zero row of D: where the chunks were sized without the
    count (CUDA-graph capture), the products over the chunk's rows then add nothing for them.
    With FILL, programs r >= n_chunk write the ignored rows' statistics (0, argmax
    ``ignore_index``; row_loss.store_ignored_stats), FILL of them each. With ROW_REF (E against
    the references ``ref_ptr[c0 + r]``, row_ref.py; no label smoothing) the target logit comes
    from there, and D's row is written only where the row cannot keep its reference; the row's
    scale goes to ``rs_ptr[r]``, its target term to ``dt_ptr[r]``, its target (or -1) to
    ``key_ptr[r]`` and x's row times the scale to ``xs_ptr + r H`` (row_ref.scale_row; 0 and -1
    for rows past the count)."""
    r = tl.program_id(0).to(tl.int64)
    if FILL > 0:
        if r >= n_chunk:
            store_ignored_stats(row_idx_ptr, tl.load(count_ptr) + (r - n_chunk) * FILL, n_rows,
                                ignore_index, lse_ptr, zt_ptr, ws_ptr, max_ptr, am_ptr, nll_ptr,
                                loss_ptr, FILL)
            return
    e_row = e_ptr + r * lde
    ti = tl.arange(0, TILES)
    cj = tl.arange(0, BN)
    if c0 + r >= tl.load(count_ptr):
        if NEED_D:
            for v0 in range(0, VPAD, TILES * BN):
                cols = v0 + ti[:, None] * BN + cj[None, :]
                tl.store(e_row + cols, tl.zeros((TILES, BN), e_ptr.dtype.element_ty),
                         mask=cols < VPAD)
            if ROW_REF:
                tl.store(rs_ptr + r, 0.0)
                tl.store(dt_ptr + r, 0.0)
                tl.store(key_ptr + r, -1)
                scaled_row(x_ptr + r * ldx, xs_ptr + r * H, 0.0, H, BLOCK_H)
        return
    row = tl.load(row_idx_ptr + c0 + r)
    tgt = tl.load(target_ptr + row)
    t = tl.arange(0, BLOCK_T)
    in_t = t < n_tiles_v
    stat = r * n_tiles_v + t
    m = tl.load(m_ptr + stat, mask=in_t, other=float("-inf"))
    s = tl.load(s_ptr + stat, mask=in_t, other=0.0)
    arg = tl.load(a_ptr + stat, mask=in_t, other=0)
    if WITH_WS:
        ws = tl.load(ws_in_ptr + stat, mask=in_t, other=0.0)
    else:
        ws = tl.zeros((BLOCK_T,), tl.float32)
    mx, am = row_max(m, arg)
    if ROW_REF:
        ref = tl.load(ref_ptr + c0 + r)  # (target_logit's dot product: 0 without a target)
        zt = tl.where(am == tgt, mx, ref)
        # lse = M + log sum_t s_t exp(r_t - M) over the tiles' references r_t; log S against
        # the row's max as (M - mx) + log(...), not lse - mx (an ulp of lse)
        big, log_big = merged_lse(tl.where(in_t, tile_refs(m, ref), float("-inf")), s)
        lse = store_merged_stats(mx, am, (big - mx) + log_big, ws, row, tgt, zt, V, c_tgt_ptr,
                                 c_smooth_ptr, c_prob_ptr, c_lse_sq_ptr, lse_ptr, zt_ptr,
                                 ws_ptr, max_ptr, am_ptr, nll_ptr, loss_ptr, WITH_WS, WITH_LOSS)
    else:
        ref = 0.0  # (not used)
        zt = target_logit(x_ptr + r * ldx, w_ptr, ldw, bias_ptr, tgt, V, mx, am, H, softcap,
                          HAS_BIAS, HAS_SOFTCAP, BLOCK_H)
        lse = store_row_stats(m, s, arg, ws, row, tgt, zt, V, c_tgt_ptr, c_smooth_ptr,
                              c_prob_ptr, c_lse_sq_ptr, lse_ptr, zt_ptr, ws_ptr, max_ptr, am_ptr,
                              nll_ptr, loss_ptr, WITH_WS, WITH_LOSS)
    if NEED_D:
        alpha, c_tgt, c_smooth = grad_coefs(row, lse, c_tgt_ptr, c_smooth_ptr, c_prob_ptr,
                                            c_lse_sq_ptr)
        d_t = _target_d(zt, lse, alpha, c_tgt, softcap, HAS_SOFTCAP)
        whole_d = True
        if ROW_REF:
            whole_d = not scale_row(e_row, x_ptr + r * ldx, xs_ptr + r * H, rs_ptr + r,
                                    dt_ptr + r, key_ptr + r, ref, lse, alpha, d_t, tgt, V,
                                    VPAD, H, BLOCK_H)
        if whole_d:
            for v0 in range(0, VPAD, TILES * BN):
                tiles = v0 // BN + ti
                cols = v0 + ti[:, None] * BN + cj[None, :]
                _store_d_block(e_row, cols, tiles, m_ptr + r * n_tiles_v, n_tiles_v, lse,
                               alpha, d_t, tgt, smoothing(cols, cols < V, c_smooth, cw_ptr,
                                                          HAS_CW), V, VPAD, ref, ROW_REF)


@triton.jit
def _target_d(zt, lse, alpha, c_tgt, softcap, HAS_SOFTCAP: tl.constexpr):
    """D's target entry from the fp32 z_t: alpha p_t - c_tgt, times the cap's derivative f_t
    with a softcap (module doc)."""
    d_t = alpha * tl.exp(zt - lse) - c_tgt
    if HAS_SOFTCAP:
        d_t *= cap_derivative(zt, softcap)
    return d_t


@triton.jit
def _store_d_block(e_row, cols, tiles, m_row, n_tiles_v, lse, alpha, d_t, tgt, smooth, V, VPAD,
                   ref, ROW_REF: tl.constexpr):
    """One row's D over its E on the (tiles, BN) block ``cols``, in place, and returned as
    stored: alpha p_j - smooth_j, where p = E exp(r_t - lse) (one exp per tile, not per logit;
    r_t the tile's max m_t, or with ROW_REF row_ref.tile_refs(m_t, ref)), the target's entry
    d_t (taken from the fp32 z_t, not from the rounded E), 0 past V. (With a softcap E holds
    E f: the product is then p_j f_j, and ``smooth`` is 0.)"""
    r_t = tl.load(m_row + tiles, mask=tiles < n_tiles_v, other=0.0)
    if ROW_REF:
        r_t = tile_refs(r_t, ref)
    f = alpha * tl.exp(r_t - lse)
    e = tl.load(e_row + cols, mask=cols < VPAD, other=0.0).to(tl.float32)
    dz = tl.where(cols == tgt, d_t, e * f[:, None]) - smooth
    d = tl.where(cols < V, dz, 0.0).to(e_row.dtype.element_ty)
    tl.store(e_row + cols, d, mask=cols < VPAD)
    return d


@triton.jit(do_not_specialize=["c0", "n_rows"])
def d_tiles_kernel(e_ptr, lde, m_ptr, zt_ptr, n_tiles_v, cw_ptr, target_ptr, row_idx_ptr,
                   count_ptr, c0, n_rows, c_tgt_ptr, c_smooth_ptr, c_prob_ptr, c_lse_sq_ptr,
                   lse_ptr, db_ptr, V, VPAD, softcap, HAS_CW: tl.constexpr, ROWS: tl.constexpr,
                   TILES: tl.constexpr, BN: tl.constexpr, HAS_SOFTCAP: tl.constexpr = False):
    """D over E (finish_tiles_kernel's formula, from the lse and z_t it wrote) for the chunk
    rows [i ROWS, (i + 1) ROWS) and the columns of TILES vocabulary tiles j TILES + [0, TILES),
    where (i, j) is the program; the column sums of those rows' D, as stored (rounded), go to
    row i of ``db_ptr`` (VPAD wide): db's partial sums, which row_chunks.py adds up (a 16 MiB
    read at bert8k). db then costs no second read of D. Rows past the valid count
    (``count_ptr``) get a zero row of D (finish_tiles_kernel's doc says why)."""
    i = tl.program_id(0)
    tiles = tl.program_id(1) * TILES + tl.arange(0, TILES)
    cols = tiles[:, None] * BN + tl.arange(0, BN)[None, :]
    w_smooth = smoothing(cols, cols < V, 1.0, cw_ptr, HAS_CW)  # w_j (1 without class weights)
    acc = tl.zeros((TILES, BN), tl.float32)
    r0 = i.to(tl.int64) * ROWS
    n_here = tl.minimum(ROWS, n_rows - i * ROWS)
    n_live = tl.maximum(tl.minimum(n_here, tl.load(count_ptr) - c0 - i * ROWS), 0)
    for k in range(0, n_live):
        r = r0 + k
        row = tl.load(row_idx_ptr + c0 + r)
        tgt = tl.load(target_ptr + row)
        lse = tl.load(lse_ptr + row)
        alpha, c_tgt, c_smooth = grad_coefs(row, lse, c_tgt_ptr, c_smooth_ptr, c_prob_ptr,
                                            c_lse_sq_ptr)
        zt = tl.load(zt_ptr + row)  # (0 where the target is not a column here)
        d_t = _target_d(zt, lse, alpha, c_tgt, softcap, HAS_SOFTCAP)
        d = _store_d_block(e_ptr + r * lde, cols, tiles, m_ptr + r * n_tiles_v, n_tiles_v, lse,
                           alpha, d_t, tgt, c_smooth * w_smooth, V, VPAD, 0.0, False)
        acc += d.to(tl.float32)
    for k in range(n_live, n_here):
        tl.store(e_ptr + (r0 + k) * lde + cols, tl.zeros((TILES, BN), e_ptr.dtype.element_ty),
                 mask=cols < VPAD)
    tl.store(db_ptr + i.to(tl.int64) * VPAD + cols, acc, mask=cols < VPAD)


@triton.jit
def log_probs_tiles_kernel(u_ptr, ldu, m_ptr, s_ptr, n_tiles_v, out_ptr, r0, V,
                           BLOCK_T: tl.constexpr, TILES: tl.constexpr, BN: tl.constexpr):
    """One program per chunk row r: lse = M + log sum_t s_t exp(m_t - M) from the row's
    tiles, then log p = U + (m_t - lse) into out's row r0 + r (columns [0, V))."""
    r = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, BLOCK_T)
    m_row = m_ptr + r * n_tiles_v
    m = tl.load(m_row + t, mask=t < n_tiles_v, other=float("-inf"))
    s = tl.load(s_ptr + r * n_tiles_v + t, mask=t < n_tiles_v, other=0.0)
    mx, log_s = merged_lse(m, s)
    lse = mx + log_s
    ti = tl.arange(0, TILES)
    cj = tl.arange(0, BN)
    u_row = u_ptr + r * ldu
    out_row = out_ptr + (r0 + r) * V
    for v0 in range(0, V, TILES * BN):
        tiles = v0 // BN + ti
        mt = tl.load(m_row + tiles, mask=tiles < n_tiles_v, other=0.0)
        # (U was taken from m_t, or from 0 in a tile of -inf logits)
        off = tl.where(mt == float("-inf"), 0.0, mt) - lse
        cols = v0 + ti[:, None] * BN + cj[None, :]
        u = tl.load(u_row + cols, mask=cols < V, other=0.0).to(tl.float32)
        tl.store(out_row + cols, (u + off[:, None]).to(out_ptr.dtype.element_ty),
                 mask=cols < V)


def applicable(p: Problem, lse_in, rows: int, with_ws: bool) -> bool:
    """Wanted (config.LOGITS_EPILOGUE, else the tile configuration's "use" from its "min_rows"
    valid rows on), bf16 CUDA inputs (or fp32 under the interpreter), no given lse, not a
    softcap together with label smoothing (``with_ws``: module doc), x and W the TMA
    descriptors can address (problem.descriptor_ok)."""
    wanted = config.LOGITS_EPILOGUE
    if wanted is None:
        wanted = p.cfg["logits_tiles"]["use"] and rows >= min_valid_rows(p)
    if not wanted or lse_in is not None or (p.softcap is not None and with_ws):
        return False
    dtypes = (torch.bfloat16, torch.float32) if config.interpreting() else (torch.bfloat16,)
    return (p.x.dtype in dtypes and p.weight.dtype == p.x.dtype
            and descriptor_ok(p.x) and descriptor_ok(p.weight))


def min_valid_rows(p: Problem) -> int:
    """The valid rows from which ``applicable`` holds (0 where config.LOGITS_EPILOGUE forces
    the path)."""
    return p.cfg["logits_tiles"]["min_rows"] if config.LOGITS_EPILOGUE is None else 0


def bytes_per_row(p: Problem, v_pad: int) -> int:
    """Workspace bytes per chunk row: E (v_pad wide) and the tile statistics."""
    return v_pad * p.x.element_size() + triton.cdiv(p.V, tile_width(p.cfg["logits_tiles"])) * 16


def tile_width(cfg: dict) -> int:
    """Columns of a vocabulary tile of E and of the statistics: the GEMM tile's BN, cut in
    ``split`` parts by the epilogue."""
    return cfg["BN"] // cfg["split"]


def launch(cfg: dict, xc: torch.Tensor, w_desc, e: torch.Tensor, bias, cw, count, c0: int, V: int,
           m, s, a, ws, n_tiles: int, softcap: float = 1.0, min_count: int = 0, ref=None,
           **flags) -> None:
    """logits_tiles_kernel over the chunk rows ``xc`` (persistent: one program per
    multiprocessor) with E (U with LOG_PROBS) into e[:len(xc)], or only the statistics where
    ``e`` is None; nothing where the valid count is below ``min_count``; E against the rows'
    references ``ref[c0:]`` where given (row_ref.py); ``flags``: HAS_BIAS, HAS_CW, WITH_WS,
    LOG_PROBS and HAS_SOFTCAP (E then holds E f: module doc), the rest from the tile
    configuration ``cfg``."""
    cc, h = xc.shape
    x_desc = TensorDescriptor.from_tensor(xc, [cfg["BM"], cfg["BK"]])
    e_desc = (None if e is None
              else TensorDescriptor.from_tensor(e[:cc], [cfg["BM"], tile_width(cfg)]))
    tiles = triton.cdiv(cc, cfg["BM"]) * triton.cdiv(V, cfg["BN"])
    progs = min(tiles, cfg["programs"] if config.interpreting() else config.sm_count(xc.device))
    logits_tiles_kernel[(progs,)](
        x_desc, w_desc, e_desc, bias, cw, count, c0, cc, V, h, m, s, a, ws,
        m if ref is None else ref, n_tiles, progs, softcap, min_count, ROW_REF=ref is not None,
        E_DTYPE=tl.bfloat16 if e is not None and e.dtype == torch.bfloat16 else tl.float32,
        STATS_ONLY=e is None,
        UPCAST=config.interpreting(), BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"],
        SPLIT=cfg["split"], FLATTEN=cfg["flatten"], num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"] if e is not None else cfg["stats_stages"], **flags)


class TileStats:
    """The per-(row, tile) workspace of one call: chunks of up to ``rows`` rows."""

    def __init__(self, p: Problem, rows: int, with_ws: bool):
        cfg = p.cfg["logits_tiles"]
        self.cfg = cfg
        self.n_tiles = triton.cdiv(p.V, tile_width(cfg))
        f32 = dict(dtype=torch.float32, device=p.device)
        self.m = torch.empty((rows, self.n_tiles), **f32)
        self.s = torch.empty((rows, self.n_tiles), **f32)
        self.a = torch.empty((rows, self.n_tiles), dtype=torch.int32, device=p.device)
        self.ws = torch.empty((rows, self.n_tiles), **f32) if with_ws else self.m
        self.w_desc = TensorDescriptor.from_tensor(p.weight, [cfg["BN"], cfg["BK"]])

    def logits(self, p: Problem, xc: torch.Tensor, e: torch.Tensor, c0: int, bias,
               with_ws: bool, min_count: int = 0, refs=None) -> None:
        """E over e[:len(xc), :V] (none where ``e`` is None) and the tile statistics of the
        chunk's rows (nothing where fewer than ``min_count`` rows are valid); against the rows'
        references where ``refs`` (a row_ref.RowRefs) is given."""
        launch(self.cfg, xc, self.w_desc, e, bias, p.cw_arg, p.n_valid, c0, p.V, self.m, self.s,
               self.a, self.ws, self.n_tiles, p.softcap_arg, min_count,
               ref=None if refs is None else refs.ref,
               HAS_BIAS=p.bias is not None,
               HAS_CW=p.class_weight is not None, WITH_WS=with_ws,
               HAS_SOFTCAP=p.softcap is not None)

    def finish(self, p: Problem, xc: torch.Tensor, e, c0: int, bias, cf, out, with_ws: bool,
               need_d: bool, db_parts=None, fill_ignored: bool = False, refs=None) -> int:
        """The statistics and loss of the chunk's rows ``xc`` (``bias`` as given to ``logits``),
        and D over E. With ``db_parts`` (fp32, ``db_part_rows(cc)`` x E's width) D comes from
        d_tiles_kernel, which also writes db's partial sums there; returns how many rows of
        them. Without coefficients (``cf`` None) the statistics alone, no loss; without E
        (``e`` None: stats_pass.py) no D. ``fill_ignored``: the same launch also writes the
        ignored rows' statistics (0, argmax ignore_index), which ``out`` then need not hold.
        ``refs``: the row_ref.RowRefs that ``logits`` took (then D is E scaled per row, where
        the row allows: refs.s and refs.xs written for the products)."""
        cfg = self.cfg
        cc = xc.shape[0]
        stats_only = cf is None
        e_arg, vpad = (xc, 0) if e is None else (e, e.shape[1])
        # (the fill programs cover the row list from the valid count on, whatever it is; FILL
        # is set with or without them, so that both launches run one compiled kernel)
        fill = cfg["fill_rows"]
        fill_programs = triton.cdiv(p.N, fill) if fill_ignored else 0
        finish_tiles_kernel[(cc + fill_programs,)](
            e_arg, vpad, self.m, self.s, self.a, self.ws, self.n_tiles, xc, xc.stride(0),
            p.weight, p.weight.stride(0), bias, p.H, p.cw_arg, p.target, p.row_idx, p.n_valid,
            # (without the loss the coefficients are not read: the lse stands in for them)
            c0, *([out.lse] * 4 if stats_only else cf), out.lse, out.zt, out.ws, out.mx, out.am,
            out.nll, out.loss, p.V, vpad, p.softcap_arg, cc, p.N, p.ignore_index,
            *((self.m, self.m, self.m, self.a, self.m) if refs is None
              else (refs.ref, refs.s, refs.dt, refs.key, refs.xs)),
            ROW_REF=refs is not None, HAS_SOFTCAP=p.softcap is not None,
            HAS_BIAS=p.bias is not None, HAS_CW=p.class_weight is not None, WITH_WS=with_ws,
            WITH_LOSS=not stats_only, NEED_D=need_d and db_parts is None,
            BLOCK_T=triton.next_power_of_2(self.n_tiles), BLOCK_H=cfg["finish_block_h"],
            TILES=cfg["finish_tiles"], BN=tile_width(cfg), FILL=fill,
            num_warps=cfg["finish_warps"])
        if db_parts is None:
            return 0
        parts = db_part_rows(cfg, cc)
        width = tile_width(cfg)
        d_tiles_kernel[(parts, triton.cdiv(e.shape[1], cfg["db_tiles"] * width))](
            e, e.shape[1], self.m, out.zt, self.n_tiles, p.cw_arg, p.target, p.row_idx,
            p.n_valid, c0, cc, *cf, out.lse, db_parts, p.V, e.shape[1], p.softcap_arg,
            HAS_CW=p.class_weight is not None, HAS_SOFTCAP=p.softcap is not None,
            ROWS=cfg["db_rows"], TILES=cfg["db_tiles"], BN=width, num_warps=cfg["db_warps"])
        return parts


def db_part_rows(cfg: dict, rows: int) -> int:
    """Rows of d_tiles_kernel's partial column sums for a chunk of ``rows`` rows."""
    return triton.cdiv(rows, cfg["db_rows"])
