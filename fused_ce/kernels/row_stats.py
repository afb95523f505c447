"""Per-row statistics of the logits in one sweep (no logits stored): the forward pass.

Grid: (row tiles of the compacted valid rows) x (vocabulary splits). A program owns BLOCK_M rows
and a contiguous range of vocabulary tiles; for each tile it computes the logits (logits.py) and
folds them into running statistics with the online log-sum-exp::

    m' = max(m, max_j z_j)      s' = s * exp(m - m') + sum_j exp(z_j - m')

plus the first argmax, the target logit and sum_j w_j z_j. Splits write partial statistics that
``combine`` merges (lse = M + log sum_s s_s exp(m_s - M)). Programs whose rows lie past the number
of valid rows (read from device memory) exit at once: ignored rows cost nothing and no host sync
is needed.
"""

import torch
import triton
import triton.language as tl

from fused_ce.kernels.logits import logits_tile
from fused_ce.reference import nll_from


@triton.jit
def row_stats_kernel(x_ptr, w_src, bias_ptr, cw_ptr, target_ptr, row_idx_ptr, n_valid_ptr,
                     m_ptr, s_ptr, am_ptr, zt_ptr, ws_ptr,
                     N, V, H, tiles_per_split, softcap,
                     HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_CW: tl.constexpr,
                     WITH_WS: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                     EVEN_K: tl.constexpr, W_DESC: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    n_valid = tl.load(n_valid_ptr)
    p0 = pid_m * BLOCK_M
    if p0 >= n_valid:
        return
    offs_p = p0 + tl.arange(0, BLOCK_M)
    row_mask = offs_p < n_valid
    rows = tl.load(row_idx_ptr + offs_p, mask=row_mask, other=0)
    tgt = tl.load(target_ptr + rows, mask=row_mask, other=-1)

    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_M,), tl.float32)
    best = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    am = tl.zeros((BLOCK_M,), tl.int32)
    zt = tl.zeros((BLOCK_M,), tl.float32)
    ws = tl.zeros((BLOCK_M,), tl.float32)

    n_tiles = tl.cdiv(V, BLOCK_N)
    t_lo = split * tiles_per_split
    t_hi = tl.minimum(t_lo + tiles_per_split, n_tiles)
    for t in range(t_lo, t_hi):
        cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < V
        z = logits_tile(x_ptr, w_src, bias_ptr, rows, row_mask, t * BLOCK_N, cols, col_mask, H,
                        softcap, HAS_BIAS, HAS_SOFTCAP, UPCAST, IEEE, EVEN_K, W_DESC, BLOCK_M,
                        BLOCK_N, BLOCK_K)
        zm = tl.where(col_mask[None, :], z, float("-inf"))
        tile_max = tl.max(zm, 1)
        m_new = tl.maximum(m, tile_max)
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(zm - m_new[:, None]), 1)
        m = m_new
        # first column attaining the tile max; a later tile must be strictly larger to win
        tile_arg = tl.min(tl.where(zm == tile_max[:, None], cols[None, :], 2147483647), 1)
        better = tile_max > best
        am = tl.where(better, tile_arg, am)
        best = tl.where(better, tile_max, best)
        hit = (cols[None, :] == tgt[:, None]) & col_mask[None, :]
        zt += tl.sum(tl.where(hit, z, 0.0), 1)
        if WITH_WS:
            if HAS_CW:
                w = tl.load(cw_ptr + cols, mask=col_mask, other=0.0)
                ws += tl.sum(tl.where(col_mask[None, :], z * w[None, :], 0.0), 1)
            else:
                ws += tl.sum(tl.where(col_mask[None, :], z, 0.0), 1)

    out = split.to(tl.int64) * N + rows
    tl.store(m_ptr + out, m, mask=row_mask)
    tl.store(s_ptr + out, s, mask=row_mask)
    tl.store(am_ptr + out, am, mask=row_mask)
    tl.store(zt_ptr + out, zt, mask=row_mask)
    tl.store(ws_ptr + out, ws, mask=row_mask)


def combine(m, s, am, zt, ws, valid, target, vocab, ignore_index):
    """Merge per-split partials (S, N) into (lse, target_logit, weighted_sum, max_logit, argmax,
    nll); zeros on ignored rows (nll: reference.nll_from)."""
    mx = m.max(0).values
    log_s = torch.log((s * torch.exp(m - mx)).sum(0))
    lse = mx + log_s
    zt = zt.sum(0)
    nll = nll_from(torch.isfinite(mx), mx, log_s, lse, zt, (target >= 0) & (target < vocab))
    # first split whose max is the row max (splits are in vocabulary order: torch's tie rule)
    first = (m == mx).to(torch.int32).argmax(0, keepdim=True)
    argmax = am.gather(0, first).squeeze(0).to(torch.long)
    zero = torch.zeros((), dtype=lse.dtype, device=lse.device)
    return (torch.where(valid, lse, zero), torch.where(valid, zt, zero),
            torch.where(valid, ws.sum(0), zero), torch.where(valid, mx, zero),
            torch.where(valid, argmax, torch.full_like(argmax, ignore_index)),
            torch.where(valid, nll, zero))
