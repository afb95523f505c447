"""dX, dW, db from the lse and the per-row coefficients: sweeps over the logits in chunks.

Default mode (four GEMM-equivalents counting the statistics pass, exact fp32 accumulation):
one sweep over vocabulary chunks of width ``vc`` with every valid row at once. Per chunk,
``grad_logits`` writes D = dz (rows x vc, input dtype), dW for those vocab rows is finished
(reduction over all valid rows in fp32: rounded once, or stored in fp32 for the
backward's scaling, no fp32 dW accumulator across chunks), and
D @ W[chunk] is added into an fp32 dX accumulator (rows x H) that the last chunk rounds into dX.
The products run in cuBLAS (bf16, fp32: ``library_products``) or in matmul.py's Triton kernels
(fp16). Workspace: D (<= config.D_BYTES) + the fp32 dX accumulator (4 N H bytes) + with cuBLAS
the chunk's fp32 dW (<= D_BYTES) and, when rows are ignored, x's valid rows gathered (2 n H).

Memory-minimal mode: where every row is valid and dX's fp32 accumulator fits in dW's buffer
with room to spare, one sweep for both products and a partial second one
(_low_memory_one_sweep: 4.1-4.3 GEMM-equivalents at the wide heads; config.LOW_MEMORY_ONE_SWEEP,
NOTES.md #103: 8-17 % faster there on an H100). Otherwise (five
GEMM-equivalents) dX in row blocks whose fp32 accumulator is small,
each a sweep over vocabulary chunks; then a second sweep over vocabulary chunks, all valid rows,
for dW and db. Workspace: D and the gathered rows (<= config.D_BYTES_LOW_MEMORY) + the dX
block's accumulator or (cuBLAS) the chunk's fp32 dW (<= DX_ACC_BYTES_LOW_MEMORY). When dW is
asked for, the dX sweeps keep D and their accumulator in dW's buffer instead (the dW sweep
writes all of it afterwards), with blocks and chunks sized by that buffer
(_low_memory_dx_blocks).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from fused_ce.kernels import config
from fused_ce.kernels.grad_logits import grad_logits_kernel, grad_logits_options
from fused_ce.kernels.matmul import dw_kernel, dx_kernel
from fused_ce.kernels.problem import Problem, descriptor_ok
from fused_ce.kernels.row_chunks import gemm_f32, gemm_into
from fused_ce.kernels.scale import scalable, scale_into
from fused_ce.reference import GradCoefs


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _fit(budget_elems: int, per: int, block: int, cap: int) -> int:
    """Largest multiple of ``block`` with (that * per) <= budget, at least one block, at most
    ``cap`` rounded up to a block."""
    n = max(block, budget_elems // max(1, per) // block * block)
    return min(n, _round_up(max(cap, 1), block))


def row_coefs(p: Problem, coefs: GradCoefs):
    """The four coefficients as contiguous fp32 (N,) vectors (as given when they are already)."""
    def as_rows(c):
        if (isinstance(c, torch.Tensor) and c.dtype == torch.float32 and c.shape == (p.N,)
                and c.is_contiguous()):
            return c
        return torch.as_tensor(c, device=p.device).to(torch.float32).expand(p.N).contiguous()
    return [as_rows(c) for c in (coefs.target, coefs.smooth, coefs.prob, coefs.lse_sq)]


def grad_scale(p: Problem, cf) -> torch.Tensor:
    """Power of two multiplying dz in the workspace D (device tensor, no sync). fp16 only: a
    mean over N rows makes |dz| ~ 1/N, deep in fp16's subnormals; scaled, its largest possible
    value (coefficient bound) is near 1. bf16 and fp32 have fp32's exponent range: 1."""
    one = torch.ones(1, dtype=torch.float32, device=p.device)
    if p.x.dtype != torch.float16 or p.N == 0:
        return one
    tgt, smooth, prob, lse_sq = cf
    wmax = 1.0 if p.class_weight is None else p.class_weight.abs().max()
    # |dz| <= |prob| + 2|lse_sq| |lse| + |tgt| + |smooth| max w ; |lse| taken as <= 64 here
    bound = (prob.abs() + tgt.abs() + smooth.abs() * wmax + 128.0 * lse_sq.abs()).max()
    e = torch.floor(torch.log2(1.0 / bound.clamp_min(1e-30))).clamp(-20.0, 40.0)
    return torch.exp2(e).reshape(1).to(torch.float32)


def _gemm_cfg(p: Problem, m: int, n: int) -> dict:
    """Tiles of a dX/dW product with an (m x n) output: the configured tile, or smaller ones
    when it would leave multiprocessors idle (the memory-minimal sweeps have narrow outputs:
    512 vocabulary rows x H=1024 is 16 programs of 128x256)."""
    base = p.cfg["gemm"]
    if config.interpreting():
        return base
    target = config.sm_count(p.device)
    options = [(base["BLOCK_M"], base["BLOCK_N"], base["num_warps"]), (128, 128, 4), (64, 128, 4),
               (64, 64, 4)]
    for bm, bn, warps in options:
        if triton.cdiv(m, bm) * triton.cdiv(n, bn) >= target:
            break
    return dict(base, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)


def library_products(p: Problem) -> bool:
    """Whether the sweeps' dX and dW products go to cuBLAS (torch.mm) instead of matmul.py's
    Triton kernels: bf16 and fp32 inputs on CUDA (fp16 keeps the Triton products, which divide
    out D's device-side scale without a host read). cuBLAS runs them at ~2-3x the Triton
    kernels' rate on the H200 (NOTES.md, session 5); it needs sizes known on the host, so
    its products span every row (a dX row block: every compacted position), ignored ones
    included, with D zero there, unless the forward read the valid count. fp32 inputs use it
    only at fp32 matmul precision "highest". config.LIBRARY_PRODUCTS switches it off;
    LIBRARY_PRODUCTS_ON_CPU runs it under the interpreter (tests)."""
    if not config.LIBRARY_PRODUCTS or p.x.dtype == torch.float16:
        return False
    if p.x.dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return False  # cuBLAS would use TF32 (allow_tf32 / "high"): the kernels stay exact
    if config.interpreting():
        return config.LIBRARY_PRODUCTS_ON_CPU
    return p.device.type == "cuda"


def _carve(scratch, shapes_dtypes):
    """Tensors of the given (shape, dtype)s laid out one after the other (16-byte aligned) in
    the bytes of ``scratch``, or None where they do not all fit."""
    if scratch is None:
        return None
    raw = scratch.view(-1).view(torch.uint8)
    out, off = [], 0
    for shape, dtype in shapes_dtypes:
        size = shape[0] * shape[1] * dtype.itemsize
        if off + size > raw.numel():
            return None
        out.append(raw[off:off + size].view(dtype).view(shape))
        off = _round_up(off + size, 16)
    return out


def _sweep(p: Problem, lse, cf, scale, p0: int, rows: int, vc: int, *, dx=None, dw=None, db=None,
           library: bool = False, by_row: bool = False, scratch=None, dw_tail: bool = False,
           factor=None, alpha=None, v_start: int = 0):
    """One pass over vocabulary chunks of width vc for the compacted rows [p0, p0 + rows), over
    the columns [v_start, V) (from v_start > 0 without dX: its sum starts at column 0).

    ``library``: the products by cuBLAS, whose sizes are host numbers. With ``by_row`` (dW asked
    for, valid count unknown on the host) D's rows are the tokens' own rows, all N of them, so
    dW[chunk] = D^T x and dX = D W[chunk] take x and dX as they are; otherwise D keeps the
    compacted rows, dW's product takes x's rows gathered in that order, and dX's rows are
    scattered at the end (with every row valid, the compacted positions are the rows: x and dX
    are sliced instead). Rows no kernel writes (ignored tokens, positions past the valid count)
    are zero in D, so the products give them exact zeros. ``scratch``: a buffer nothing reads
    before this sweep ends (the memory-minimal dX sweeps get dW's, which the dW sweep then
    overwrites whole); D and dX's fp32 accumulator go there when they fit. ``dw_tail`` (a dW
    sweep without dX): a chunk's D and fp32 dW go in dW's rows past the chunk, which later
    chunks overwrite, as wide as they fit there while that is wider than vc (_tail_widths).
    ``factor``: the device scalar that multiplies dX and dW as they are finished; ``alpha``: its
    value on the host where known (``gradients``)."""
    lg = p.cfg["logits"]
    store_d = dx is not None or dw is not None
    d_rows = p.N if by_row else rows
    # every row tile holds a valid row (valid count read on the host): the kernels write all of
    # D's rows and db_part; else the tiles past the count exit early and D (cuBLAS reads it
    # whole) and db_part must start at zero
    all_written = not by_row and p.n_valid_host is not None and p0 + rows <= p.n_valid_host
    fill = library and not all_written
    # D's row r is the token row tokens[r]: by_row, or when every row is valid (the compacted
    # positions are then the rows themselves)
    in_order = by_row or p.n_valid_host == p.N
    tokens = slice(0, p.N) if by_row else slice(p0, p0 + rows)
    f32 = torch.float32
    acc_is_dx = dx is not None and library and in_order and dx.dtype == f32
    # dX's fp32 accumulator: cuBLAS accumulates straight into an fp32 dx in the tokens' order;
    # else one of the sweep's own buffers (``want_acc``)
    acc = dx[tokens] if acc_is_dx else None
    want_acc = not acc_is_dx and dx is not None and (library or vc < p.V)
    x_rows = None
    with_dw32 = library and dw is not None and _dw32_needed(dw, alpha)
    if library and dw is not None:
        x_rows = p.x[tokens] if in_order else p.x.index_select(0, p.row_idx[p0:p0 + rows])
    # x's rows in the compacted positions' order for the logits kernel: the gathered ones, or x's
    # own where every row is valid
    x_compact = None if by_row else p.x[tokens] if in_order else x_rows
    tail = dw_tail and dw is not None and dx is None
    widths = _tail_widths(p, d_rows, vc, dw, with_dw32, v_start) if tail else []
    vc_max = max([vc, *widths])
    own = None  # [D, dW32, dX's accumulator] as asked for, of width vc: made when first needed

    def buffers(v0: int, width: int):
        """(D, its row stride, the chunk's fp32 dW, dX's accumulator): from dW's rows past a
        tail chunk, else the sweep's own ones of width vc (from ``scratch`` where they fit),
        made at the first chunk that needs them. D is zero where fill asks (when made)."""
        nonlocal own
        in_tail = tail and width > vc
        w_alloc = width if in_tail else min(vc, p.V)
        pad = _round_up(width if in_tail else vc, 8)  # 16-byte aligned rows of D
        shapes = [((d_rows, pad) if store_d else (1, 1), p.x.dtype)]
        shapes += [((w_alloc, p.H), f32)] * with_dw32
        if in_tail:
            got = _carve(dw[v0 + width:], shapes)
        else:
            if own is None:
                shapes += [((d_rows, p.H), f32)] * want_acc
                own = _carve(scratch, shapes) or [torch.empty(s, dtype=t, device=p.device)
                                                  for s, t in shapes]
                if fill:
                    own[0].zero_()
            got = own
        if in_tail and fill:
            got[0].zero_()
        return (got[0], pad, got[1][:width] if with_dw32 else None,
                got[-1] if want_acc else None)

    m_tiles = triton.cdiv(rows, lg["BLOCK_M"])
    db_flat = (torch.empty(m_tiles * _round_up(vc_max, 8), dtype=f32, device=p.device)
               if db is not None else None)
    # the Triton products divide their sums by this: D's scale, over the factor
    prod_scale = scale if library or factor is None else scale / factor
    v0, i = v_start, 0
    while v0 < p.V:
        width = min(widths[i] if i < len(widths) else vc, p.V - v0)
        d, ldd, dw32, own_acc = buffers(v0, width)
        acc = own_acc if want_acc else acc
        db_part = None
        if db_flat is not None:
            db_part = db_flat[:m_tiles * ldd].view(m_tiles, ldd)
            if not all_written:
                db_part.zero_()
        _grad_logits(p, lse, cf, scale, d, ldd, db_part, p0, rows, v0, width,
                     store_d=store_d, by_row=by_row, x_rows=x_compact)
        if library:
            if dw is not None:
                _dw_product(d[:, :width], x_rows, v0, dw, dw32, factor, alpha)
            if dx is not None:
                _add_products(d[:, :width], p.weight[v0:v0 + width], [(acc, slice(None))],
                              first=v0 == 0)
        else:
            _triton_products(p, d, ldd, prod_scale, p0, rows, v0, width, v0 + width >= p.V,
                             acc, dx, dw)
        if db is not None:
            torch.sum(db_part[:, :width], 0, out=db[v0:v0 + width])
        v0, i = v0 + width, i + 1
    if library and dx is not None:
        if in_order:
            _times(acc, factor, out=None if acc_is_dx else dx[tokens])
        else:
            dx.index_copy_(0, p.row_idx[p0:p0 + rows], _times(acc, factor).to(dx.dtype))


def _dw_product(d, x_rows, v0: int, dw, dw32, factor, alpha):
    """dW's rows [v0, v0 + width) = D^T x_rows over every row at once (cuBLAS; D: rows x width,
    from column v0), times the factor and rounded once (if at all): with the factor on the host
    (``alpha``) as the product's own scalar straight into dW, else through the fp32 ``dw32``
    where dW is 16-bit."""
    width = d.shape[1]
    if alpha is not None:
        gemm_into(d.t(), x_rows, dw[v0:v0 + width], alpha=alpha)
    elif dw32 is None:
        _times(gemm_f32(d.t(), x_rows, dw[v0:v0 + width]), factor)
    else:
        _times(gemm_f32(d.t(), x_rows, dw32), factor, out=dw[v0:v0 + width])


def _add_products(d, w_chunk, accs, first: bool):
    """acc (fp32) += D[rows] W[chunk] for each (acc, rows) part of dX's accumulator (cuBLAS);
    written (not added) where ``first``."""
    for acc, rows in accs:
        gemm_f32(d[rows], w_chunk, acc, accumulate=not first)


def _dw32_needed(dw, alpha) -> bool:
    """Whether a 16-bit dW's chunks go through an fp32 buffer: where the factor that multiplies
    them before their rounding is on the device only (``alpha`` None)."""
    return dw.dtype != torch.float32 and alpha is None


def _grad_logits(p: Problem, lse, cf, scale, d, ldd: int, db_part, p0: int, rows: int, v0: int,
                 width: int, *, store_d: bool = True, by_row: bool = False, x_rows=None):
    """D = dz * scale for the compacted rows [p0, p0 + rows) and the columns [v0, v0 + width)
    into ``d`` (row stride ``ldd``; with ``by_row`` its rows are the tokens' own), and with
    ``db_part`` db's partial sums per row tile (grad_logits.py). ``x_rows``: x's rows of those
    positions in their order, contiguous (x's own where every row is valid, or gathered), or
    None. The kernel reads them and writes D (not by_row) through TMA descriptors where
    these allow (problem.descriptor_ok): without the tiles' pointers in registers, the wide
    heads' 128 x 256 tile does not spill."""
    lg = p.cfg["logits"]
    # (fp32's exact dot, on the FMA units, keeps x's pointers, as it keeps W's: problem.Problem's
    # W_DESC)
    fp32 = p.x.dtype == torch.float32 and not config.interpreting()
    x_desc = x_rows is not None and descriptor_ok(x_rows) and not fp32
    d_desc = store_d and not by_row and d.data_ptr() % 16 == 0 and ldd * d.element_size() % 16 == 0
    gl = grad_logits_options(p.cfg["grad_logits"], fp32=fp32, d_desc=d_desc,
                             w_desc=p.flags["W_DESC"])
    x_src = (TensorDescriptor.from_tensor(x_rows, [lg["BLOCK_M"], lg["BLOCK_K"]]) if x_desc
             else p.x)
    d_dst = (TensorDescriptor(d, [rows, width], [ldd, 1], [lg["BLOCK_M"],
                                                           lg["BLOCK_N"] // gl["SPLIT"]])
             if d_desc else d)
    tiles = (triton.cdiv(rows, lg["BLOCK_M"]), triton.cdiv(width, lg["BLOCK_N"]))
    programs = p.cfg["grad_logits"].get("programs") or config.sm_count(p.device)
    grid = (min(tiles[0] * tiles[1], programs),) if gl["PERSISTENT"] else tiles
    grad_logits_kernel[grid](
        x_src, p.w_src, p.bias_arg, p.cw_arg, p.target, p.row_idx, p.n_valid,
        lse, *cf, scale, d_dst, ldd, db_part if db_part is not None else d,
        p0, rows, v0, width, p.V, p.H, p.softcap_arg,
        HAS_CW=p.class_weight is not None, STORE_D=store_d, D_BY_ROW=by_row,
        NEED_DB=db_part is not None, X_DESC=x_desc, D_DESC=d_desc, **p.flags, **lg, **gl)


def _times(t, factor, out=None):
    """``t * factor`` (``factor`` a device scalar, or None for 1) into ``out``, rounded to its
    dtype, or into ``t`` in place. Returns the result."""
    if out is None:
        out = t
        if factor is None:
            return t
    elif factor is None:
        return out.copy_(t)
    # (Triton's interpreter casts fp32 to 16 bits by truncation, not to nearest: under it the
    # kernel takes fp32 outputs only)
    if (scalable([t], [out.dtype], factor) and out.is_contiguous() and out.device == t.device
            and not (config.interpreting() and out.dtype != torch.float32)):
        return scale_into([t], [out.dtype], factor, outs=[out])[0]
    return torch.mul(t, factor, out=out)


def _tail_widths(p: Problem, d_rows: int, vc: int, dw, with_dw32: bool, v_start: int = 0,
                 end: int | None = None) -> list:
    """Widths of the dW sweep's first chunks from column v_start on when each keeps its D
    (d_rows rows) and fp32 dW chunk in dW's rows past it up to row ``end`` (V: still
    unwritten): each the widest multiple of the vocabulary tile that fits there, as long as
    that is wider than vc (the own buffers' width, used for the rest). At BERT's head on 8192
    rows 2688, 2432, ... columns: 30 chunks instead of 60."""
    block_n = p.cfg["logits"]["BLOCK_N"]
    end = p.V if end is None else end
    row_bytes = p.H * dw.element_size()  # one row of dW
    per_col = d_rows * p.x.element_size() + p.H * 4 * with_dw32 + row_bytes
    widths, v0 = [], v_start
    while v0 < end:
        # D and dW32 (width w) within dW's rows [v0 + w, end), less 32 bytes of alignment
        w = ((end - v0) * row_bytes - 32) // per_col // block_n * block_n
        if w <= vc:
            break
        widths.append(w)
        v0 += w
    return widths


def _triton_products(p: Problem, d, ldd, scale, p0, rows, v0, width, last, acc, dx, dw):
    flags = dict(UPCAST=p.flags["UPCAST"], IEEE=p.flags["IEEE"])
    if dw is not None:
        gm = _gemm_cfg(p, width, p.H)
        dw_kernel[(triton.cdiv(width, gm["BLOCK_M"]), triton.cdiv(p.H, gm["BLOCK_N"]))](
            d, ldd, scale, p.x, p.row_idx, p.n_valid, dw, v0, width, p.V, p.H, **flags, **gm)
    if dx is not None:
        gm = _gemm_cfg(p, rows, p.H)
        dx_kernel[(triton.cdiv(rows, gm["BLOCK_M"]), triton.cdiv(p.H, gm["BLOCK_N"]))](
            d, ldd, scale, p.weight, p.row_idx, p.n_valid, acc if acc is not None else dx, dx,
            p0, rows, v0, width, p.V, p.H, ACC_IN=v0 > 0,
            WRITE_FINAL=last, **flags, **gm)


def _dw32_cap(p: Problem, dw32: bool, budget: int) -> int:
    """Widest vocabulary chunk: V, or where cuBLAS's dW products go through fp32 chunks the
    width whose fp32 dW chunk (4 vc H bytes) fits in ``budget`` (at few rows, D's budget alone
    would allow vc = V)."""
    return max(1, budget // (4 * p.H)) if dw32 else p.V


def _low_memory_dx_blocks(p: Problem, n_rows: int, scratch_bytes: int) -> tuple[int, int]:
    """(rows per block, vocabulary chunk width) of the memory-minimal dX sweeps. Each row
    block's fp32 accumulator stays within config.DX_ACC_BYTES_LOW_MEMORY and D within
    D_BYTES_LOW_MEMORY; or, where dW's buffer (``scratch_bytes``: written only by the dW sweep
    that follows) is larger than both together, accumulator and D share that buffer, split so
    that the blocks times their chunks (the launches) are few. BERT's head (59 MiB: 30k x 1024
    bf16): 8192 rows in 2 blocks of 6 chunks (12 launch pairs) instead of 8 blocks of 1024
    rows with 8 chunks each (64)."""
    elt = p.x.element_size()
    block_m = p.cfg["logits"]["BLOCK_M"]
    block_n = p.cfg["logits"]["BLOCK_N"]
    acc_budget, d_budget = config.DX_ACC_BYTES_LOW_MEMORY, config.D_BYTES_LOW_MEMORY
    options = []  # (row blocks x chunks, rows per block, chunk width), fewest blocks first
    if scratch_bytes > acc_budget + d_budget:
        for k in range(1, 17):
            rb = _round_up(triton.cdiv(n_rows, k), block_m)
            d_room = scratch_bytes - _round_up(rb * p.H * 4, 16) - 16  # (carving's alignment)
            if d_room >= rb * block_n * elt:
                vc = _fit(d_room // elt, rb, block_n, p.V)
                options.append((triton.cdiv(n_rows, rb) * triton.cdiv(p.V, vc), rb, vc))
    if options:
        # the tallest blocks (dX products with more output tiles) within 25 % of the fewest
        # launches
        fewest = min(o[0] for o in options)
        return next((rb, vc) for n, rb, vc in options if n <= 1.25 * fewest)
    rb = _fit(acc_budget // 4, p.H, block_m, n_rows)
    return rb, _fit(d_budget // elt, rb, block_n, p.V)


def _low_memory_dw_chunks(p: Problem, n_rows: int, known: bool, library_dw: bool,
                          dw32: bool):
    """(by_row, rows, vc) of the memory-minimal dW/db sweep: D's layout, its rows and the
    vocabulary chunk width, within config.D_BYTES_LOW_MEMORY.

    cuBLAS dW products over the valid rows only take x's rows gathered, which share D's
    budget; the other layout (``by_row``: D spans all N rows, zero where ignored) needs no
    gather but multiplies every row. The gathered layout is taken where the count is known and
    its chunks are at least as wide as the full-row layout's: then it has no more chunks and
    less work in each (MLM: 15 % of 16384 rows valid, chunks 640 vs 256 columns wide)."""
    budget = config.D_BYTES_LOW_MEMORY
    elt = p.x.element_size()
    block_n = p.cfg["logits"]["BLOCK_N"]
    cap = _dw32_cap(p, dw32, config.DX_ACC_BYTES_LOW_MEMORY)
    if not library_dw or (known and n_rows == p.N):  # (no gather: the rows are in order)
        return False, n_rows, _fit(budget // elt, n_rows, block_n, cap)
    vc_all = _fit(budget // elt, p.N, block_n, cap)
    d_budget = budget - n_rows * p.H * elt  # what the gathered rows leave D
    if known and d_budget >= n_rows * block_n * elt:
        vc = _fit(d_budget // elt, n_rows, block_n, cap)
        if vc >= vc_all:
            return False, n_rows, vc
    return True, p.N, vc_all


def _one_sweep_layout(p: Problem, dx, dw, vc: int, alpha=None):
    """(columns of the accumulator's place in dW, the rows of it in dX's own buffer, the first
    part's chunk widths) of _low_memory_one_sweep, or None where it does not apply: cuBLAS
    products, dX and dW asked for, every row valid with the count read (the rows in order),
    and a first part of at least three quarters of the vocabulary (at BERT's head on 8192 rows
    its 0.56 V took 8.3-9.2 ms against the row blocks' 7.5-8.0: H100, NOTES.md #107). dX's
    fp32 accumulator (4 N H bytes) is dX itself where dX is fp32; a 16-bit dX's buffer holds
    its first N // 2 rows, dW's last rows the rest. The first part's chunks keep D (and fp32
    dW chunks where the factor is on the device only) in dW's rows between them and the
    accumulator, as wide as fit (_tail_widths, down to ``vc``, the dW sweep's own width)."""
    if (not config.LOW_MEMORY_ONE_SWEEP or dx is None or dw is None or not library_products(p)
            or p.n_valid_host != p.N):
        return None
    row_bytes = p.H * dw.element_size()
    v_acc, n_top = p.V, p.N
    if dx.dtype != torch.float32:  # (from a row that is a multiple of 8: 16-byte aligned)
        n_top = p.N // 2
        v_acc = (p.V - triton.cdiv((p.N - n_top) * p.H * 4, row_bytes)) // 8 * 8
    widths = _tail_widths(p, p.N, vc, dw, _dw32_needed(dw, alpha), end=max(v_acc, 0))
    # (the columns past the first part start with D in dW's rows before the accumulator)
    room = v_acc * row_bytes >= p.N * p.cfg["logits"]["BLOCK_N"] * p.x.element_size()
    return (v_acc, n_top, widths) if room and 4 * sum(widths) >= 3 * p.V else None


def _low_memory_one_sweep(p: Problem, lse, cf, scale, vc: int, layout, *, dx, dw, db, factor,
                          alpha=None):
    """The memory-minimal gradients in four GEMM-equivalents and a fraction (counting the
    statistics pass) instead of five, where _one_sweep_layout allows: no buffer beyond dX's
    and dW's own, and db's chunk sums. dX = sum over column chunks of D W[chunk] needs an fp32
    accumulator over all rows; dW[chunk] = D^T x needs D over all rows. Both come from one
    D per chunk where the accumulator has a place that nothing else needs until the end: a
    16-bit dX's own buffer holds exactly half of it (rows [0, n_top)), dW's last rows (unwritten
    until the end) the rest. With v1 the first part's end:
      1. columns [v1, V): D in dW's rows before the accumulator (its own D_BYTES_LOW_MEMORY
         where dX is fp32 and the whole accumulator), only for dX's products;
      2. columns [0, v1): per chunk, D (and an fp32 dW chunk where the factor is on the
         device only) in dW's rows past it; dW[chunk] finished, D W[chunk] added into the
         accumulator; then dX finished from the accumulator (its half in dX's buffer in place,
         _finish_top_rows);
      3. columns [v1, V), whose rows of dW the accumulator no longer holds: the dW sweep
         (_sweep with dw_tail), D once more.
    So the logits are computed 1 + (V - v1) / V times after the statistics pass, against twice
    in the row blocks' scheme: v1 is 0.85 V at Llama-3's head (16384 x 4096 x 128256; 0.73 V
    with the whole accumulator in dW), 0.96 V at Gemma-2's (8192 x 2304 x 256000); BERT's
    heads (0.56 V on 8192 rows, 0.26 V on 16384) keep the row blocks."""
    v_acc, n_top, widths = layout
    n_rows = p.N  # (every row valid, in order)
    f32 = torch.float32
    block_n = p.cfg["logits"]["BLOCK_N"]
    elt = p.x.element_size()
    if dx.dtype == f32:
        accs = [(dx, slice(0, n_rows))]
    else:
        top = top_rows_accumulator(dx, n_top)
        bottom = _carve(dw[v_acc:], [((n_rows - n_top, p.H), f32)])[0]
        parts = ((top, slice(0, n_top)), (bottom, slice(n_top, n_rows)))
        accs = [(a, rows) for a, rows in parts if rows.start < rows.stop]
    v1 = sum(widths)
    first = True  # (the accumulator's first product writes it)
    if v1 < p.V:  # 1.
        if dx.dtype == f32:
            wb = _fit(config.D_BYTES_LOW_MEMORY // elt, n_rows, block_n, p.V - v1)
            d = torch.empty((n_rows, wb), dtype=p.x.dtype, device=p.device)
        else:
            wb = _fit(v_acc * p.H * dw.element_size() // elt, n_rows, block_n, p.V - v1)
            d = _carve(dw[:v_acc], [((n_rows, wb), p.x.dtype)])[0]
        for v0 in range(v1, p.V, wb):
            width = min(wb, p.V - v0)
            _grad_logits(p, lse, cf, scale, d, wb, None, 0, n_rows, v0, width, x_rows=p.x)
            _add_products(d[:, :width], p.weight[v0:v0 + width], accs, first)
            first = False
    with_dw32 = _dw32_needed(dw, alpha)
    m_tiles = triton.cdiv(n_rows, p.cfg["logits"]["BLOCK_M"])
    db_flat = (torch.empty(m_tiles * _round_up(max(widths), 8), dtype=f32, device=p.device)
               if db is not None else None)
    v0 = 0
    for width in widths:  # 2. (widths: multiples of the vocabulary tile, so rows of D aligned)
        got = _carve(dw[v0 + width:v_acc], [((n_rows, width), p.x.dtype)] +
                     [((width, p.H), f32)] * with_dw32)
        d = got[0]
        db_part = None if db is None else db_flat[:m_tiles * width].view(m_tiles, width)
        _grad_logits(p, lse, cf, scale, d, width, db_part, 0, n_rows, v0, width, x_rows=p.x)
        _dw_product(d, p.x, v0, dw, got[1] if with_dw32 else None, factor, alpha)
        _add_products(d, p.weight[v0:v0 + width], accs, first)
        first = False
        if db is not None:
            torch.sum(db_part, 0, out=db[v0:v0 + width])
        v0 += width
    if dx.dtype == f32:
        _times(dx, factor)
    else:
        _finish_top_rows(dx, n_top, factor)
        if n_top < n_rows:  # (into dX's bytes past its rows [0, n_top): read already)
            _times(accs[-1][0], factor, out=dx[n_top:])
    if v1 < p.V:  # 3.
        _sweep(p, lse, cf, scale, 0, n_rows, vc, dw=dw, db=db, library=True, dw_tail=True,
               factor=factor, alpha=alpha, v_start=v1)


def top_rows_accumulator(dx, n_top: int):
    """The fp32 accumulator of dX's rows [0, n_top) in the bytes of the 16-bit dX (row r at
    bytes [4 r H, 4 (r + 1) H)): n_top <= N // 2 rows fit."""
    h = dx.shape[1]
    return dx.view(-1).view(torch.uint8)[:n_top * h * 4].view(torch.float32).view(n_top, h)


_FIRST_ROWS_BYTES = 2**20  # (_finish_top_rows' copy; tests make it small)


def _finish_top_rows(dx, n_top: int, factor):
    """dX's rows [0, n_top) from the fp32 accumulator rows that fill dX's own buffer
    (top_rows_accumulator), times the factor and rounded, in place: row r's result goes to
    bytes [2 r H, 2 (r + 1) H), over accumulator rows already read. Rows [a, 2a) in one launch
    read bytes [4 a H, 8 a H) and write [2 a H, 4 a H), apart, over the rows [a / 2, a) that
    the launch before read: so doubling ranges, the first (whose result would overlap its own
    sources) through a copy of at most 1 MiB."""
    acc = top_rows_accumulator(dx, n_top)
    a = min(n_top, max(1, _FIRST_ROWS_BYTES // (4 * dx.shape[1])))
    _times(acc[:a].clone(), factor, out=dx[:a])
    while a < n_top:
        b = min(2 * a, n_top)
        _times(acc[a:b], factor, out=dx[a:b])
        a = b


def gradients(p: Problem, lse, coefs: GradCoefs, *, need_dx: bool, need_dw: bool,
              need_db: bool, low_memory: bool, round_grads: bool = True, factor=None,
              factor_host: Optional[float] = None):
    """(dx, dw, db) in the input dtypes, or without ``round_grads`` in fp32, unrounded (None
    where not asked for); ignored rows get zeros. The products accumulate in fp32 either way:
    the outputs' dtype only decides whether their final stores round. ``factor``: an fp32
    device tensor of one element, or None for 1: the gradients of ``factor`` times the
    coefficients, the factor multiplied into dX, dW and db in fp32 before their one rounding
    (kernels._unit_coefs; no host read). ``factor_host``: its value, where the caller read it
    (with the valid count): cuBLAS's dW products then take it as their scalar and write dW's
    chunks straight in its dtype, without an fp32 chunk each and a rounding pass over it.

    The sweeps cover the first ``p.n_valid_host`` compacted rows when the caller read that
    count (the forward, whose target check syncs anyway), else all N positions (the kernels
    skip the invalid ones by the device-side count; cuBLAS products span them, D zero there)."""
    lse = lse.to(torch.float32).contiguous()
    cf = row_coefs(p, coefs)
    scale = grad_scale(p, cf)
    f32 = torch.float32
    dx = torch.zeros_like(p.x, dtype=None if round_grads else f32) if need_dx else None
    # (the sweep writes every element)
    dw = torch.empty_like(p.weight, dtype=None if round_grads else f32) if need_dw else None
    db32 = torch.empty(p.V, dtype=torch.float32, device=p.device) if need_db else None
    elt = p.x.element_size()
    block_n = p.cfg["logits"]["BLOCK_N"]
    alpha = 1.0 if factor is None else factor_host  # (None: on the device only)
    ov = config.CHUNK_OVERRIDE or {}
    lib = library_products(p)
    dw32 = lib and need_dw and _dw32_needed(dw, alpha)  # (dW's chunks through fp32 buffers)
    known = p.n_valid_host is not None
    n_rows = p.n_valid_host if known else p.N
    if n_rows > 0 and (need_dx or need_dw or need_db):
        if not low_memory:
            vc = ov.get("vc") or _fit(config.D_BYTES // elt, n_rows, block_n,
                                      _dw32_cap(p, dw32, config.D_BYTES))
            _sweep(p, lse, cf, scale, 0, n_rows, vc, dx=dx, dw=dw, db=db32, library=lib,
                   by_row=lib and need_dw and not known, factor=factor, alpha=alpha)
        else:
            by_row, rows, vc = _low_memory_dw_chunks(p, n_rows, known, lib and need_dw, dw32)
            vc = ov.get("vc") or vc
            layout = _one_sweep_layout(p, dx, dw, vc, alpha)
            if layout is not None:
                _low_memory_one_sweep(p, lse, cf, scale, vc, layout, dx=dx, dw=dw, db=db32,
                                      factor=factor, alpha=alpha)
            else:
                if need_dx:
                    scratch = dw  # (None without dW; else written whole by the dW sweep below)
                    rb, rvc = _low_memory_dx_blocks(
                        p, n_rows, 0 if dw is None else dw.numel() * dw.element_size())
                    rb, rvc = ov.get("row_block") or rb, ov.get("row_vc") or rvc
                    for p0 in range(0, n_rows, rb):
                        _sweep(p, lse, cf, scale, p0, min(rb, n_rows - p0), rvc, dx=dx,
                               library=lib, scratch=scratch, factor=factor)
                if need_dw or need_db:
                    _sweep(p, lse, cf, scale, 0, rows, vc, dw=dw, db=db32, library=lib,
                           by_row=by_row, dw_tail=dw is not None, factor=factor, alpha=alpha)
    else:
        if dw is not None:
            dw.zero_()
        if db32 is not None:
            db32.zero_()
    if db32 is not None:
        _times(db32, factor)
    db = db32
    if db32 is not None and round_grads:
        db = db32.to(p.bias.dtype if p.bias is not None else p.weight.dtype)
    return dx, dw, db
