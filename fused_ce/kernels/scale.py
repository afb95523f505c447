"""The backward of a summed loss (``ops``): up to three gradients, computed by the forward pass
for an upstream gradient of 1 and kept unrounded (fp32), times the actual upstream gradient g
(an fp32 device scalar), each rounded once into its parameter's dtype, in one launch. A
destination may be its own source (in place: fp32 parameters).

One program scales BLOCK consecutive elements of one tensor: programs [0, t0) the first tensor,
[t0, t0 + t1) the second, the rest the third (t_k = cdiv(n_k, BLOCK)). The first may instead
be a dX that holds the valid rows only (row_chunks.forward_with_grads' ``compact_dx``): its
programs then take RB x HB blocks of the listed rows (RB * HB = BLOCK) and write each to its
row of the full dX, 0 * g on the rows past the valid ones (the same value a zeroed row scaled
gives, nan where g is not finite). torch's multiply by a
0-dim fp32 tensor followed by a cast is two launches per tensor, and its in-place multiply of
a 16-bit tensor takes a generic, non-vectorized kernel (H200: ~0.11 ms for BERT's dX, dW, db;
NOTES.md #30).
"""

import torch
import triton
import triton.language as tl

from fused_ce.kernels import config

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _scale_block(src, dst, n, blk, g, BLOCK: tl.constexpr):
    offs = blk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(src + offs, mask=mask)
    tl.store(dst + offs, (v.to(tl.float32) * g).to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _scatter_block(src, dst, rows_ptr, n_src_rows, n_rows, H, blk, g, RB: tl.constexpr,
                   HB: tl.constexpr):
    """dst[rows[k], j] = src[k, j] * g for block ``blk``'s RB listed rows k and HB columns j;
    0 * g where k >= n_src_rows (src holds the first n_src_rows listed rows)."""
    n_hb = tl.cdiv(H, HB)
    kb = blk // n_hb
    k = kb * RB + tl.arange(0, RB)
    j = (blk - kb * n_hb) * HB + tl.arange(0, HB)
    listed = k < n_rows
    r = tl.load(rows_ptr + k, mask=listed, other=0).to(tl.int64)
    mask = listed[:, None] & (j < H)[None, :]
    v = tl.load(src + k.to(tl.int64)[:, None] * H + j[None, :],
                mask=mask & (k < n_src_rows)[:, None], other=0.0)
    tl.store(dst + r[:, None] * H + j[None, :], (v.to(tl.float32) * g).to(dst.dtype.element_ty),
             mask=mask)


@triton.jit
def scale_kernel(a_src, a_dst, na, b_src, b_dst, nb, c_src, c_dst, nc, g_ptr, a_rows, a_valid,
                 a_h, BLOCK: tl.constexpr, A_ROWS: tl.constexpr, RB: tl.constexpr,
                 HB: tl.constexpr):
    """With A_ROWS the first tensor is a dX of ``a_valid`` rows of ``a_h``, written to the
    rows ``a_rows`` lists (``na`` of them); else ``na`` elements as the others."""
    pid = tl.program_id(0)
    if A_ROWS:
        ta = tl.cdiv(na, RB) * tl.cdiv(a_h, HB)
    else:
        ta = tl.cdiv(na, BLOCK)
    tb = tl.cdiv(nb, BLOCK)
    g = tl.load(g_ptr).to(tl.float32)
    if pid < ta:
        if A_ROWS:
            _scatter_block(a_src, a_dst, a_rows, a_valid, na, a_h, pid, g, RB, HB)
        else:
            _scale_block(a_src, a_dst, na, pid, g, BLOCK)
    elif pid < ta + tb:
        _scale_block(b_src, b_dst, nb, pid - ta, g, BLOCK)
    else:
        _scale_block(c_src, c_dst, nc, pid - ta - tb, g, BLOCK)


def scalable(sources, dtypes, g: torch.Tensor) -> bool:
    """Whether scale_into takes these: at most three contiguous 16-bit or fp32 tensors on g's
    device, 16-bit or fp32 destination dtypes, g a one-element fp32 tensor."""
    return (len(sources) <= 3 and g.dtype == torch.float32 and g.numel() == 1
            and all(t.is_contiguous() and t.device == g.device and t.dtype in _DTYPES
                    and dt in _DTYPES for t, dt in zip(sources, dtypes)))


def scale_into(sources, dtypes, g: torch.Tensor, dx_rows=None, outs=None) -> list:
    """[(s * g) in dtype for s, dtype] (``scalable``): fp32 products rounded once, in one
    launch; a source of its destination's dtype is scaled in place and returned. ``dx_rows``:
    the first source holds the valid rows only (reference.RowStats.dx_rows); its result has a
    row per entry of dx_rows. ``outs``: given destinations instead (contiguous, of the dtypes
    and as many elements as the sources; without dx_rows): the memory-minimal sweeps' fp32
    chunks rounded into dW's and dX's rows (torch's multiply by a 0-dim tensor into another
    dtype takes its generic elementwise kernel: H100, 45-55 such roundings took 2.8 ms at the
    wide heads, 1.1 ms this way, NOTES.md #104)."""
    cfg = config.current()["scale"]
    block = cfg["BLOCK"]
    shapes = [s.shape for s in sources]
    if dx_rows is not None:
        shapes[0] = (dx_rows.shape[0], sources[0].shape[1])
    # (in place only where nothing moves: a compact dx as tall as x is still a permutation)
    outs = outs or [s if s.dtype == dt and sh == s.shape and not (i == 0 and dx_rows is not None)
                    else torch.empty(sh, dtype=dt, device=s.device)
                    for i, (s, dt, sh) in enumerate(zip(sources, dtypes, shapes))]
    args, programs = [], 0
    rb = hb = 1
    for i in range(3):
        src, dst = (sources[i], outs[i]) if i < len(sources) else (g, g)  # no elements
        n = src.numel() if i < len(sources) else 0
        if i == 0 and dx_rows is not None:  # listed rows of RB x HB blocks
            n, h = shapes[0]
            hb = min(triton.next_power_of_2(max(h, 1)), block)
            rb = block // hb
            programs += triton.cdiv(n, rb) * triton.cdiv(h, hb)
        else:
            programs += triton.cdiv(n, block)
        args += [src, dst, n]
    if programs:
        rows = (dx_rows, sources[0].shape[0], shapes[0][1]) if dx_rows is not None else (g, 0, 0)
        scale_kernel[(programs,)](*args, g, *rows, BLOCK=block, A_ROWS=dx_rows is not None,
                                  RB=rb, HB=hb, num_warps=cfg["num_warps"])
    return outs
