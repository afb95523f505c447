"""The logits gradient of one (row block x vocabulary chunk), written to a workspace.

With the lse known (from the statistics pass or given), each logit's gradient is local::

    dz_ij = (prob_i + 2 * lse_sq_i * lse_i) * exp(z_ij - lse_i)
            - target_i * [j == t_i] - smooth_i * w_j          (times 1 - (z_ij/c)^2 with softcap c)

The tile's logits are recomputed (logits.py, bit-identical to the forward's) and dz is stored in
the input dtype as ``D[p - p0, j - v0]`` (compacted row position p, vocabulary column j), the A
operand of the dX and dW products (matmul.py); with ``D_BY_ROW`` as ``D[row(p), j - v0]`` (the
token's own row, for the cuBLAS products of gradients.py, which take x as it is). Column sums
of dz over the tile (fp32) go to ``db_part[row tile, j - v0]`` (row stride ldd, like D) for the
bias gradient; summing them in a fixed order keeps db deterministic. D holds dz times a power
of two (``scale_ptr``, 1 except for fp16, where it keeps the 1/N-sized gradients of a mean loss
out of fp16's subnormal range); the products divide it out.
"""

import triton
import triton.language as tl

from fused_ce.kernels.logits import cap_derivative, logits_tile
from fused_ce.kernels.row_loss import grad_coefs, smoothing


def grad_logits_options(tile_cfg: dict, *, fp32: bool, d_desc: bool, w_desc: bool) -> dict:
    """grad_logits_kernel's SPLIT, GROUP_M, PERSISTENT and FLATTEN for one launch: the tile
    configuration's (``tile_cfg``: its "grad_logits"), except that fp32 (its exact dot on the
    FMA units) takes the whole tile's epilogue, and the kernel is persistent only where D and W
    go through descriptors: otherwise the halves, or the persistent loop, spilled more (sm_90,
    Triton 3.6: with their pointers the loop 1.4-2.6 KB a thread at the wide tile, against
    0.6 KB with one tile a program). tools/sm90_registers.py compiles what this gives."""
    opts = {k: v for k, v in tile_cfg.items() if k != "programs"}  # ("programs": the grid's)
    if fp32:
        opts["SPLIT"] = 1
    opts["PERSISTENT"] = opts["PERSISTENT"] and d_desc and w_desc
    return opts


@triton.jit
def tile_order(tile, n_m, n_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of output tile number ``tile`` of n_m x n_n. GROUP_M = 0: the row
    tiles of one column tile next to each other. Else groups of GROUP_M row tiles across all
    column tiles, row tiles fastest: the programs running at once then share GROUP_M row tiles
    of x and a few column tiles of W that L2 holds, instead of streaming all of x's rows per
    column tile (128 MiB of x per column tile at 16384 x 4096)."""
    if GROUP_M > 0:
        per_group = GROUP_M * n_n
        first = tile // per_group * GROUP_M
        size = tl.minimum(n_m - first, GROUP_M)
        pid_m = first + tile % per_group % size
        pid_n = tile % per_group // size
    else:
        pid_m = tile % n_m
        pid_n = tile // n_m
    return pid_m, pid_n


@triton.jit
def _store_dz(z, rows, row_mask, offs_p, in_block, p0, col0, v0, vc, V, lse, alpha, c_tgt,
              c_smooth, tgt, softcap, cw_ptr, scale_ptr, d_ptr, ldd, db_ptr, pid_m,
              HAS_SOFTCAP: tl.constexpr, HAS_CW: tl.constexpr, STORE_D: tl.constexpr,
              D_BY_ROW: tl.constexpr, NEED_DB: tl.constexpr, D_DESC: tl.constexpr,
              WIDTH: tl.constexpr):
    """dz of the logits ``z`` (the tile's rows x the WIDTH chunk columns from ``col0``, module
    doc) into D and db_part; D_DESC: ``d_ptr`` is D's descriptor (block BLOCK_M x WIDTH)."""
    offs_j = col0 + tl.arange(0, WIDTH)
    cols = v0 + offs_j
    in_chunk = offs_j < vc
    col_mask = in_chunk & (cols < V)
    dz = alpha[:, None] * tl.exp(z - lse[:, None])
    dz -= tl.where(cols[None, :] == tgt[:, None], c_tgt[:, None], 0.0)
    dz -= smoothing(cols[None, :], col_mask[None, :], c_smooth[:, None], cw_ptr, HAS_CW)
    if HAS_SOFTCAP:
        dz *= cap_derivative(z, softcap)
    dz = tl.where(row_mask[:, None] & col_mask[None, :], dz, 0.0)

    if STORE_D:
        scaled = dz * tl.load(scale_ptr)
        if D_DESC:  # (rows past the block and columns past the chunk are not stored)
            d_ptr.store([pid_m * z.shape[0], col0], scaled.to(d_ptr.dtype))
        elif D_BY_ROW:
            # D's row is the token's own row (the rows never written stay as allocated: zero)
            d_ptrs = d_ptr + rows.to(tl.int64)[:, None] * ldd + offs_j[None, :]
            tl.store(d_ptrs, scaled.to(d_ptr.dtype.element_ty),
                     mask=row_mask[:, None] & in_chunk[None, :])
        else:
            d_ptrs = d_ptr + (offs_p - p0).to(tl.int64)[:, None] * ldd + offs_j[None, :]
            tl.store(d_ptrs, scaled.to(d_ptr.dtype.element_ty),
                     mask=in_block[:, None] & in_chunk[None, :])
    if NEED_DB:
        tl.store(db_ptr + pid_m.to(tl.int64) * ldd + offs_j, tl.sum(dz, 0), mask=in_chunk)


@triton.jit
def grad_logits_kernel(x_ptr, w_src, bias_ptr, cw_ptr, target_ptr, row_idx_ptr, n_valid_ptr,
                       lse_ptr, c_tgt_ptr, c_smooth_ptr, c_prob_ptr, c_lse_sq_ptr, scale_ptr,
                       d_ptr, ldd, db_ptr, p0, rows_in_block, v0, vc, V, H, softcap,
                       HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_CW: tl.constexpr,
                       STORE_D: tl.constexpr, D_BY_ROW: tl.constexpr, NEED_DB: tl.constexpr,
                       UPCAST: tl.constexpr,
                       IEEE: tl.constexpr, EVEN_K: tl.constexpr, W_DESC: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT: tl.constexpr = 1, GROUP_M: tl.constexpr = 0,
                       X_DESC: tl.constexpr = False, D_DESC: tl.constexpr = False,
                       PERSISTENT: tl.constexpr = False, FLATTEN: tl.constexpr = False):
    """The output tiles (row tile, column tile) of cdiv(rows_in_block, BLOCK_M) x
    cdiv(vc, BLOCK_N), in tile_order's GROUP_M order: one per program of a grid of that
    shape, or with PERSISTENT each program of a 1-D grid (one per multiprocessor) takes the
    tiles in turn, its loop FLATTENed (the next tile's loads issued during a tile's epilogue).
    SPLIT = 2: the epilogue on the two column halves of the tile in turn. X_DESC: ``x_ptr`` is
    the descriptor (block BLOCK_M x BLOCK_K) of the block's rows of x in compacted order,
    position p0 its row 0 (x's own rows where every row is valid, else x's valid rows
    gathered). D_DESC (not D_BY_ROW): ``d_ptr`` is D's descriptor (shape rows_in_block x vc,
    block BLOCK_M x BLOCK_N / SPLIT). Without the pointers of x's and D's tiles in registers
    the 128 x 256 tile's halves do not spill (sm_90, Triton 3.6: 768 bytes a thread with
    them)."""
    n_valid = tl.load(n_valid_ptr)
    if PERSISTENT:  # (the row tiles past the valid count are not visited)
        n_m = tl.cdiv(tl.minimum(rows_in_block, tl.maximum(n_valid - p0, 0)), BLOCK_M)
        n_n = tl.cdiv(vc, BLOCK_N)
        for tile in tl.range(tl.program_id(0), n_m * n_n, tl.num_programs(0), flatten=FLATTEN):
            pid_m, pid_n = tile_order(tile, n_m, n_n, GROUP_M)
            _grad_tile(pid_m, pid_n, n_valid, x_ptr, w_src, bias_ptr, cw_ptr, target_ptr,
                       row_idx_ptr, lse_ptr, c_tgt_ptr, c_smooth_ptr, c_prob_ptr, c_lse_sq_ptr,
                       scale_ptr, d_ptr, ldd, db_ptr, p0, rows_in_block, v0, vc, V, H, softcap,
                       HAS_BIAS, HAS_SOFTCAP, HAS_CW, STORE_D, D_BY_ROW, NEED_DB, UPCAST, IEEE,
                       EVEN_K, W_DESC, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, X_DESC, D_DESC)
    else:  # (not the persistent loop run once: that compiled to other spills and shared memory)
        n_m = tl.num_programs(0)
        pid_m, pid_n = tile_order(tl.program_id(0) + tl.program_id(1) * n_m, n_m,
                                  tl.num_programs(1), GROUP_M)
        if p0 + pid_m * BLOCK_M < n_valid:
            _grad_tile(pid_m, pid_n, n_valid, x_ptr, w_src, bias_ptr, cw_ptr, target_ptr,
                       row_idx_ptr, lse_ptr, c_tgt_ptr, c_smooth_ptr, c_prob_ptr, c_lse_sq_ptr,
                       scale_ptr, d_ptr, ldd, db_ptr, p0, rows_in_block, v0, vc, V, H, softcap,
                       HAS_BIAS, HAS_SOFTCAP, HAS_CW, STORE_D, D_BY_ROW, NEED_DB, UPCAST, IEEE,
                       EVEN_K, W_DESC, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, X_DESC, D_DESC)


@triton.jit
def _grad_tile(pid_m, pid_n, n_valid, x_ptr, w_src, bias_ptr, cw_ptr, target_ptr, row_idx_ptr,
               lse_ptr, c_tgt_ptr, c_smooth_ptr, c_prob_ptr, c_lse_sq_ptr, scale_ptr, d_ptr, ldd,
               db_ptr, p0, rows_in_block, v0, vc, V, H, softcap, HAS_BIAS: tl.constexpr,
               HAS_SOFTCAP: tl.constexpr, HAS_CW: tl.constexpr, STORE_D: tl.constexpr,
               D_BY_ROW: tl.constexpr, NEED_DB: tl.constexpr, UPCAST: tl.constexpr,
               IEEE: tl.constexpr, EVEN_K: tl.constexpr, W_DESC: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               SPLIT: tl.constexpr, X_DESC: tl.constexpr, D_DESC: tl.constexpr):
    """D and db_part of output tile (pid_m, pid_n), whose first row is below the valid count."""
    p_start = p0 + pid_m * BLOCK_M
    offs_p = p_start + tl.arange(0, BLOCK_M)
    in_block = offs_p < p0 + rows_in_block
    row_mask = in_block & (offs_p < n_valid)
    rows = tl.load(row_idx_ptr + offs_p, mask=row_mask, other=0)
    offs_j = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = v0 + offs_j
    col_mask = (offs_j < vc) & (cols < V)

    z = logits_tile(x_ptr, w_src, bias_ptr, rows, row_mask, v0 + pid_n * BLOCK_N, cols,
                    col_mask, H, softcap, HAS_BIAS, HAS_SOFTCAP, UPCAST, IEEE, EVEN_K, W_DESC,
                    BLOCK_M, BLOCK_N, BLOCK_K, X_DESC, p_start - p0)

    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    # (masked rows read row 0's coefficients: their dz is zeroed below)
    alpha, c_tgt, c_smooth = grad_coefs(rows, lse, c_tgt_ptr, c_smooth_ptr, c_prob_ptr,
                                        c_lse_sq_ptr)
    tgt = tl.load(target_ptr + rows, mask=row_mask, other=-1)
    # A 128 x 256 fp32 tile is 128 of a thread's 255 registers at 8 warps: with the epilogue's
    # full-width temporaries beside it the kernel spills, so SPLIT = 2 takes its halves in turn.
    if SPLIT == 1:
        _store_dz(z, rows, row_mask, offs_p, in_block, p0, pid_n * BLOCK_N, v0, vc, V, lse,
                  alpha, c_tgt, c_smooth, tgt, softcap, cw_ptr, scale_ptr, d_ptr, ldd, db_ptr,
                  pid_m, HAS_SOFTCAP, HAS_CW, STORE_D, D_BY_ROW, NEED_DB, D_DESC, BLOCK_N)
    else:
        z0, z1 = tl.split(tl.permute(tl.reshape(z, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
        _store_dz(z0, rows, row_mask, offs_p, in_block, p0, pid_n * BLOCK_N, v0, vc, V, lse,
                  alpha, c_tgt, c_smooth, tgt, softcap, cw_ptr, scale_ptr, d_ptr, ldd, db_ptr,
                  pid_m, HAS_SOFTCAP, HAS_CW, STORE_D, D_BY_ROW, NEED_DB, D_DESC, BLOCK_N // 2)
        _store_dz(z1, rows, row_mask, offs_p, in_block, p0, pid_n * BLOCK_N + BLOCK_N // 2, v0,
                  vc, V, lse, alpha, c_tgt, c_smooth, tgt, softcap, cw_ptr, scale_ptr, d_ptr,
                  ldd, db_ptr, pid_m, HAS_SOFTCAP, HAS_CW, STORE_D, D_BY_ROW, NEED_DB, D_DESC,
                  BLOCK_N // 2)
