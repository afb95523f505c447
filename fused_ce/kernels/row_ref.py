"""The epilogue path's E against one reference logit per row, so that D is E scaled per row
(NOTES.md #94): the D pass shrinks to a few numbers and one row of x per row.

logits_tiles.py's epilogue writes E = exp(z - m_t), m_t each tile's own max; D = alpha
exp(m_t - lse) E - c_tgt [j = t] then needs a pass that reads and rewrites all of E (on an
H100, 3.3 ms of Gemma-2's 50 ms). With one reference L_r per row instead::

    E_rj = exp(z_rj - L_r),   alpha_r p_rj = s_r E_rj,   s_r = alpha_r exp(L_r - lse_r)

so row r of D is s_r E_r off the target, and D_t = alpha p_t - c_tgt (from the fp32 z_t, as
the D pass takes it) on it. With E's target entry set to 0, the products become::

    dX = diag(s) (E W) + D_t W_t         cuBLAS's fp32 rows scaled, W_t added (dx_rows_kernel)
    dW = E^T (s x) + onehot^T (D_t x)    x's rows scaled by s and rounded to the input dtype;
                                         the target terms added in fp32 (dw_targets_kernel:
                                         per target, in a fixed order, no atomics)

so that the finish kernel writes, per row, s_r, s_r x_r, D_t and one 0 into E. The target
terms stay out of E and of s x on purpose: through them, D_t would be rounded twice (D_t / s_r
into E, s_r x_r), where the D pass rounds it once, and nearly exactly where p_t is small (D_t
near -c_tgt); the CPU model (tools/model_row_scale.py) gave dX / dW errors 2.34e-3 / 2.78e-3
that way against 1.66e-3 / 1.27e-3 today, and 1.66e-3 / 1.27e-3 (random rows) and 1.66e-3 /
1.33e-3 (a third of them at p_t ~ 0.999: today 1.86e-3 / 1.60e-3) as built. The reference is
the target logit z_t (target_refs_kernel, before the GEMM; the finish kernel then takes z_t
from it instead of its own dot product). Without label smoothing only (its term c_smooth w_j
is no row scale) and without db (d_tiles_kernel's partial sums need D itself).

Range: each E entry must stay finite and s_r a normal number. The epilogue takes L_r as a
tile's reference only while the tile's max is at most L_r + SPAN (else the max itself); the
finish kernel keeps the row scale only where lse - L_r <= SPAN (a loss of at most SPAN nats),
|s_r| >= S_MIN and the target is a column here. Other rows (a loss above 40 nats, a zero
coefficient, a NaN, a target of another shard) get their whole D written over E, from each
tile's own reference, s_r = 1 and no separate target term: today's D pass, for those rows.
"""

import torch
import triton
import triton.language as tl

from fused_ce.kernels.logits import tanh

# nats of a tile's max above L_r (and of lse above L_r) within which L_r serves as the reference:
# E <= e^40 (a tile's sum of 128 such below 2^72, the fp32 products far from overflow) and
# s_r >= alpha e^-40
SPAN = tl.constexpr(40.0)
# |s_r| below this (a class weight 0, a vanishing coefficient) takes the whole D row instead:
# s_r x_r rounded to bf16 must stay a normal number
S_MIN = tl.constexpr(1e-30)
# a tile whose max lies within this of L_r takes its max as reference (see tile_refs)
SNAP = tl.constexpr(2.0**-13)


@triton.jit
def tile_refs(m, ref):
    """The reference of tiles with maxima ``m`` in rows of reference ``ref`` (module doc): the
    row's, or the tile's max where that lies more than SPAN above it, or within SNAP of it.
    The latter is the target logit itself, which the GEMM and target_logit's dot product sum
    in different orders: with L_r as reference its E entry would be exp(a few ulps), rounded
    by the approximate exp to a relative 2^-22, and a confident row's nll = log(1 + small)
    would carry that error (2e-7 on an nll of 1e-3); with its own max the entry is exactly 1,
    as on the D pass. D = s_r E is then off by exp(m - L_r) - 1, at most 1.2e-4 relative, in
    that tile (a sixteenth of a bf16 rounding)."""
    return tl.where((m > ref + SPAN) | (tl.abs(m - ref) <= SNAP), m, ref)


@triton.jit
def target_logit(x_row, w_ptr, ldw, bias_ptr, tgt, V, mx, am, H, softcap,
                 HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_H: tl.constexpr):
    """The row's target logit z_t = x . W_t (+ b_t), softcapped where HAS_SOFTCAP, an fp32 dot
    product (0 when the target is not a column here: ignored, or another shard's). Where the
    target is the row's argmax ``am``, z_t is its max ``mx`` instead: the GEMM's own value of
    that logit, so that nll = (mx - z_t) + log s stays exact for confident targets (a z_t
    summed in another order can differ from mx by an ulp of |z|, as large as such an nll).
    (am = -1: the dot product alone.)"""
    has_t = (tgt >= 0) & (tgt < V)
    w_row = w_ptr + tl.where(has_t, tgt, 0) * ldw
    acc = tl.zeros((BLOCK_H,), tl.float32)
    for h0 in range(0, H, BLOCK_H):
        k = h0 + tl.arange(0, BLOCK_H)
        acc += (tl.load(x_row + k, mask=k < H, other=0.0).to(tl.float32)
                * tl.load(w_row + k, mask=k < H, other=0.0).to(tl.float32))
    z = tl.sum(acc, 0)
    if HAS_BIAS:
        z += tl.load(bias_ptr + tl.where(has_t, tgt, 0)).to(tl.float32)
    if HAS_SOFTCAP:
        z = softcap * tanh(z / softcap)
    return tl.where(has_t, tl.where(am == tgt, mx, z), 0.0)


@triton.jit
def target_refs_kernel(x_ptr, ldx, w_ptr, ldw, bias_ptr, target_ptr, row_idx_ptr, count_ptr,
                       ref_ptr, V, H, softcap, HAS_BIAS: tl.constexpr,
                       HAS_SOFTCAP: tl.constexpr, BLOCK_H: tl.constexpr):
    """ref[k] = the target logit of x's row ``row_idx[k]`` (target_logit's dot product), one
    program per compacted position k below the valid count (``count_ptr``, on the device)."""
    k = tl.program_id(0).to(tl.int64)
    if k < tl.load(count_ptr):
        row = tl.load(row_idx_ptr + k)
        tl.store(ref_ptr + k, target_logit(x_ptr + row * ldx, w_ptr, ldw, bias_ptr,
                                           tl.load(target_ptr + row), V, 0.0, -1, H, softcap,
                                           HAS_BIAS, HAS_SOFTCAP, BLOCK_H))


@triton.jit
def scaled_row(x_row, xs_row, scale, H, BLOCK_H: tl.constexpr):
    """xs_row[:H] = scale * x_row[:H], rounded to xs's dtype (zeros for a scale 0, also where
    x is not finite)."""
    for h0 in range(0, H, BLOCK_H):
        k = h0 + tl.arange(0, BLOCK_H)
        x = tl.load(x_row + k, mask=k < H, other=0.0).to(tl.float32)
        tl.store(xs_row + k, tl.where(scale == 0.0, 0.0, scale * x).to(xs_row.dtype.element_ty),
                 mask=k < H)


@triton.jit
def scale_row(e_row, x_row, xs_row, s_ptr, dt_ptr, key_ptr, ref, lse, alpha, d_t, tgt, V, VPAD,
              H, BLOCK_H: tl.constexpr):
    """Where the row keeps its reference (module doc): its s_r, x's row times s_r, its target
    term D_t (fp32) and target t (``key_ptr``), and a 0 in E's target entry; returns whether it
    did. Otherwise s_r = 1, x's row as it is, no target term (t = -1): the caller then writes
    the row's whole D over E. Either way E's columns [V, VPAD) (VPAD - V < 64) are set to 0:
    the products run over VPAD columns, which the GEMM's tiles need not reach."""
    tail = V + tl.arange(0, 64)
    tl.store(e_row + tail, tl.zeros((64,), e_row.dtype.element_ty), mask=tail < VPAD)
    s_r = alpha * tl.exp(ref - lse)
    # (a NaN lse or s_r fails these)
    scaled = (tgt >= 0) & (tgt < V) & (lse - ref <= SPAN) & (tl.abs(s_r) >= S_MIN)
    s_used = tl.where(scaled, s_r, 1.0)
    tl.store(s_ptr, s_used)
    tl.store(dt_ptr, tl.where(scaled, d_t, 0.0))
    tl.store(key_ptr, tl.where(scaled, tgt, -1).to(tl.int32))
    scaled_row(x_row, xs_row, s_used, H, BLOCK_H)
    if scaled:
        tl.store(e_row + tgt, tl.zeros((), e_row.dtype.element_ty))
    return scaled


@triton.jit
def dx_rows_kernel(dx_ptr, ldd, s_ptr, dt_ptr, key_ptr, w_ptr, ldw, H, BLOCK_H: tl.constexpr):
    """A chunk's dX rows from E W: dx_r = s_r (E W)_r + D_t W_t (no W_t where the row has no
    target term: key -1), program (r, H block)."""
    r = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    key = tl.load(key_ptr + r)
    row = dx_ptr + r * ldd
    keys = tl.full((BLOCK_H,), 0, tl.int32) + key
    w_t = tl.load(w_ptr + tl.maximum(keys, 0).to(tl.int64) * ldw + k, mask=(k < H) & (keys >= 0),
                  other=0.0).to(tl.float32)
    dx = tl.load(s_ptr + r) * tl.load(row + k, mask=k < H) + tl.load(dt_ptr + r) * w_t
    tl.store(row + k, dx, mask=k < H)


@triton.jit
def dw_targets_kernel(dw_ptr, lddw, keys_ptr, order_ptr, dt_ptr, x_ptr, ldx, n, H,
                      BLOCK_H: tl.constexpr, RB: tl.constexpr):
    """dW_t += sum of D_t x_r over a chunk's rows r whose target term is t, without atomics and
    in a fixed order: ``keys_ptr`` holds the n rows' targets sorted (-1: no term), ``order_ptr``
    their rows; program (i, H block) adds the run of equal targets that starts at position i,
    if one does (each dW row then has one writer), RB rows at a time: a frequent target (text's
    commonest tokens are several % of all) is a run of hundreds of rows, whose loads one row at
    a time would wait on each other."""
    i = tl.program_id(0)
    k = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    key = tl.load(keys_ptr + i)
    starts = (key >= 0) & ((i == 0) | (tl.load(keys_ptr + tl.maximum(i - 1, 0)) != key))
    if starts:
        acc = tl.zeros((BLOCK_H,), tl.float32)
        j = i
        more = starts
        while more:
            js = j + tl.arange(0, RB)
            # (sorted: the run is contiguous, and past its end no key equals it)
            in_run = tl.load(keys_ptr + js, mask=js < n, other=-1) == key
            r = tl.load(order_ptr + js, mask=in_run, other=0).to(tl.int64)
            d_t = tl.load(dt_ptr + r, mask=in_run, other=0.0)
            xr = tl.load(x_ptr + r[:, None] * ldx + k[None, :],
                         mask=in_run[:, None] & (k < H)[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(d_t[:, None] * xr, 0)
            j += RB
            more = tl.sum(in_run.to(tl.int32), 0) == RB
        dw_row = dw_ptr + key.to(tl.int64) * lddw + k
        tl.store(dw_row, tl.load(dw_row, mask=k < H) + acc, mask=k < H)


class RowRefs:
    """One call's references (the target logits of the compacted positions, computed on
    construction, before any logits GEMM) and, once ``chunk_buffers`` made them, what the
    finish kernel writes per row of a chunk for its products: s (fp32), s x (x's dtype), the
    target term D_t (fp32) and its target (int32, -1 for none)."""

    def __init__(self, p):
        cfg = p.cfg["logits_tiles"]
        self.p = p
        self.ref = torch.empty(p.N, dtype=torch.float32, device=p.device)
        self.s = self.dt = self.key = self.xs = None  # (chunk_buffers)
        target_refs_kernel[(p.N,)](
            p.x, p.x.stride(0), p.weight, p.weight.stride(0), p.bias_arg, p.target, p.row_idx,
            p.n_valid, self.ref, p.V, p.H, p.softcap_arg, HAS_BIAS=p.bias is not None,
            HAS_SOFTCAP=p.softcap is not None, BLOCK_H=cfg["finish_block_h"],
            num_warps=cfg["finish_warps"])

    def chunk_buffers(self, rows: int) -> None:
        """The finish kernel's outputs for chunks of up to ``rows`` rows."""
        p = self.p
        self.s, self.dt = torch.empty((2, rows), dtype=torch.float32, device=p.device)
        self.key = torch.empty(rows, dtype=torch.int32, device=p.device)
        self.xs = torch.empty((rows, p.H), dtype=p.x.dtype, device=p.device)

    def dx_rows(self, dx: torch.Tensor, weight: torch.Tensor) -> None:
        """dx (a chunk's fp32 E W, in place) to dX: dx_r = s_r dx_r + D_t W_t."""
        block = self.p.cfg["logits_tiles"]["finish_block_h"]
        dx_rows_kernel[(dx.shape[0], triton.cdiv(self.p.H, block))](
            dx, dx.stride(0), self.s, self.dt, self.key, weight, weight.stride(0), self.p.H,
            BLOCK_H=block)

    def dw_targets(self, dw: torch.Tensor, xc: torch.Tensor) -> None:
        """dw (fp32, holding E^T (s x) so far) += the target terms of the chunk rows ``xc``:
        dW_t += D_t x_r, summed per target in the order of a stable sort (deterministic)."""
        n = xc.shape[0]
        keys, order = torch.sort(self.key[:n], stable=True)
        cfg = self.p.cfg["logits_tiles"]
        block = cfg["finish_block_h"]
        dw_targets_kernel[(n, triton.cdiv(self.p.H, block))](
            dw, dw.stride(0), keys, order, self.dt, xc, xc.stride(0), n, self.p.H,
            BLOCK_H=block, RB=cfg["target_rows"], num_warps=cfg["finish_warps"])


def applicable(p, with_ws: bool, need_dx: bool, need_dw: bool, need_db: bool) -> bool:
    """Wanted (the tile configuration's "row_ref") for a loss with dX or dW but no db and no
    label smoothing (no weighted sums: ``with_ws`` False) on the epilogue path, at a vocabulary
    of at least "row_ref_min_v" columns. Below that the D pass costs little (4 V bytes a row)
    and equal targets are common: a run of N / V rows per target, which dw_targets_kernel
    sums in one program (a 9-class token tagger's runs would be thousands of rows long)."""
    cfg = p.cfg["logits_tiles"]
    return (cfg["row_ref"] and p.V >= cfg["row_ref_min_v"] and (need_dx or need_dw)
            and not (need_db or with_ws))
