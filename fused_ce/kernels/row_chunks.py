"""The default CUDA path for 16-bit losses with gradients: three cuBLAS GEMMs per chunk of valid
rows, the softmax work in one memory-bound Triton kernel between them.

Per chunk of c compacted valid rows ``x_c`` (dW accumulated across chunks)::

    Z  = x_c @ W.T                     cuBLAS, fp32 output, in rows padded to a multiple of 64
                                       columns, on V a multiple of 64 (split_weight: W's first
                                       V64 rows and a small GEMM for the rest, for one chunk and
                                       the first of several; the others use a padded copy of W)
    finish_rows_kernel                 per row: + bias (once), softcap; pass 1 folds the row into
                                       lane-wise running max / sum-exp / argmax / sum_j w_j z_j
                                       and reduces them once, then writes the row's statistics
                                       and loss; pass 2 writes dz (input dtype) over the first
                                       half of Z's own row. With a given lse (the backward of
                                       reduction='none') pass 1 is skipped.
    dX32[rows_c] = D @ W               cuBLAS, fp32 output (which also keeps cuBLAS from
                                       reducing split-K partials in 16 bits)
    dW32        += D.T @ x_c           cuBLAS accumulating into fp32 (no bf16 drift); a single
                                       chunk writes it from one product over all rows
    db32        += 1 @ D               a (1 x c) GEMM into fp32: D's column sums (c rounded up
                                       to a multiple of 8 by zero rows of D: DB_ROWS_ALIGN);
                                       on the epilogue path below, the sum of the column sums
                                       that the kernel writing D leaves per 64 rows

The gradients are returned in fp32, unrounded: the backward of the summed loss multiplies them
by the upstream gradient and rounds each element once (scale.py). Rounded here and scaled
there, a gradient would be rounded twice: on the H200 with an upstream gradient of 0.37, dX's
error against fp64 was 3.1e-3 that way vs 1.8e-3 for eager bf16 (NOTES.md #32).

Where logits_tiles.applicable (bf16, not a softcap with label smoothing, TMA-addressable x
and W; by default at any valid count), the first two steps are instead a Triton logits GEMM
whose epilogue writes E = exp(z - tile max) and the tiles' statistics, and a per-row kernel
that writes the statistics and D over E (logits_tiles.py: 6 bytes per logit instead of 14,
and half the workspace per row). Where all N rows would take that path, its first chunk's
GEMM is launched before the host read of the valid count (_FirstTileChunk), so that the GPU is
busy while the host waits and sets up (where a configured min_rows and the count rule the path
out, that kernel computes nothing and the chunk is dropped). With the tile
configuration's "overlap" (on at BERT-class heads, config.py), from OVERLAP_MIN_CHUNKS chunks,
each next chunk's GEMM runs on a second stream beside a chunk's memory-bound statistics and D
pass (_GemmAhead).

Three GEMM-equivalents instead of the four of a recompute scheme. Workspace: Z or E (within
``row_chunk_budget``, or up to twice that for fewer than 2 config.ROW_CHUNK_SPLIT_MIN_ROWS
valid rows in one chunk: at BERT's head 256 MiB, a quarter of the valid rows' beyond 16k
tokens; twice that with the GEMM ahead), the fp32 gradients (4 (N + V) H bytes, or
4 (valid rows + V) H with ``compact_dx``: twice the 16-bit ones) and, with several chunks,
the padded copy of W when V is not a multiple of 64. cuBLAS
sizes its products by the number of valid rows: the caller reads it on the host once per call
(with the fp16 gradient scale and the count of out-of-range targets; the read starts
asynchronously and is waited for after the launches that do not need it, the epilogue path's
first GEMM among them). While a CUDA graph is captured nothing may wait on the host: then the
chunks span all N compacted positions, the count stays on the device, and the kernels write
zero rows of D for the positions past it, so that the products over whole chunks add nothing
for the ignored rows; they cost their GEMM time (H100, NOTES.md #91: a captured BERT step
3.0 ms against the vocabulary sweep's 4.5, the MLM step 3.5 against 4.6 and the eager step's
2.2).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from fused_ce.kernels import config, logits_tiles, row_ref
from fused_ce.kernels.logits import cap_derivative, tanh
from fused_ce.kernels.problem import Problem
from fused_ce.kernels.row_loss import (grad_coefs, smoothing, store_ignored_stats,
                                       store_row_stats)


@triton.jit
def finished_logits(z_row, cols, mask, bias_ptr, softcap, HAS_BIAS: tl.constexpr,
                    HAS_SOFTCAP: tl.constexpr):
    """fp32 GEMM output + bias (once), then the softcap; masked columns read 0."""
    z = tl.load(z_row + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        z += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        z = softcap * tanh(z / softcap)
    return z


@triton.jit
def _fold_init(BLOCK_V: tl.constexpr):
    """Empty lane-wise accumulators of _fold_block: max, sum-exp, argmax, weighted sum."""
    return (tl.full((BLOCK_V,), float("-inf"), tl.float32), tl.zeros((BLOCK_V,), tl.float32),
            tl.zeros((BLOCK_V,), tl.int32), tl.zeros((BLOCK_V,), tl.float32))


@triton.jit
def _fold_block(z, cols, V, m, s, arg, ws, cw_ptr, WITH_WS: tl.constexpr, HAS_CW: tl.constexpr):
    """Folds one block of a row's finished logits (columns ``cols``) into the lane-wise online
    log-sum-exp: lane l sees columns l, l + BLOCK_V, ...; each keeps its own running max m_l
    and s_l = sum exp(z - m_l); store_row_stats merges them once at the end (lse = M + log
    sum_l s_l exp(m_l - M)). No cross-lane work here."""
    zm = tl.where(cols < V, z, float("-inf"))
    # strictly greater: a lane keeps its first maximum (columns ascend); NaN wins, so it
    # reaches the lse like in torch.logsumexp
    better = (zm > m) | (zm != zm)
    arg = tl.where(better, cols, arg)
    m_new = tl.where(better, zm, m)
    # (-inf - -inf is NaN: lanes that saw no finite logit yet add nothing)
    s = (tl.where(m_new == m, s, s * tl.exp(m - m_new))
         + tl.where(zm == float("-inf"), 0.0, tl.exp(zm - m_new)))
    if WITH_WS:
        if HAS_CW:
            ws += tl.where(cols < V, z * tl.load(cw_ptr + cols, mask=cols < V, other=0.0), 0.0)
        else:
            ws += tl.where(cols < V, z, 0.0)
    return m_new, s, arg, ws


@triton.jit
def _grad(z, cols, valid, lse, alpha, tgt, c_tgt, c_smooth, cw_ptr, softcap,
          HAS_CW: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """dz of one row's logits (module doc of grad_logits.py), 0 on columns not ``valid``."""
    dz = (alpha * tl.exp(z - lse) - tl.where(cols == tgt, c_tgt, 0.0)
          - smoothing(cols, valid, c_smooth, cw_ptr, HAS_CW))
    if HAS_SOFTCAP:
        dz *= cap_derivative(z, softcap)
    return tl.where(valid, dz, 0.0)


@triton.jit(do_not_specialize=["c0", "n_rows", "n_grid"])  # (logits_tiles_kernel's comment)
def finish_rows_kernel(z_ptr, ldz, d_ptr, ldd, bias_ptr, cw_ptr, target_ptr, row_idx_ptr, c0,
                       n_rows, c_tgt_ptr, c_smooth_ptr, c_prob_ptr, c_lse_sq_ptr, scale_ptr,
                       lse_ptr, zt_ptr, ws_ptr, max_ptr, am_ptr, nll_ptr, loss_ptr, V, VPAD,
                       softcap, n_grid, count_ptr, n_all, ignore_index,
                       HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                       HAS_CW: tl.constexpr, WITH_WS: tl.constexpr, NEED_D: tl.constexpr,
                       LSE_IN: tl.constexpr, HAS_SCALE: tl.constexpr, D_OVER_Z: tl.constexpr,
                       BLOCK_V: tl.constexpr, FILL: tl.constexpr = 0):
    """One program per row r < ``n_grid`` of the chunk (compacted position c0 + r). Z and the
    bias are readable in columns [0, VPAD) (VPAD a multiple of 16: the loads vectorize), the
    logits are the columns [0, V). Writes the row's statistics and its loss (ops.py's loss_i;
    unless LSE_IN: then ``lse_ptr`` is read) and, with NEED_D, dz * scale into D's columns
    [0, VPAD) (0 past V; scale read from ``scale_ptr`` with HAS_SCALE, else 1). Programs
    n_rows <= r < n_grid (padding rows: see DB_ROWS_ALIGN) and rows past the valid count
    (``count_ptr``, on the device: chunks sized without it) write a zero row of D and nothing
    else. With FILL, programs r >= n_grid write the statistics of the ignored rows
    (the row list's positions from the valid count ``count_ptr`` up to ``n_all``), FILL of them
    each (row_loss.store_ignored_stats)."""
    r = tl.program_id(0).to(tl.int64)
    if FILL > 0:
        if r >= n_grid:
            store_ignored_stats(row_idx_ptr, tl.load(count_ptr) + (r - n_grid) * FILL, n_all,
                                ignore_index, lse_ptr, zt_ptr, ws_ptr, max_ptr, am_ptr, nll_ptr,
                                loss_ptr, FILL)
            return
    lanes = tl.arange(0, BLOCK_V)
    d_row = d_ptr + r * ldd
    if (r >= n_rows) | (c0 + r >= tl.load(count_ptr)):
        for v0 in range(0, VPAD, BLOCK_V):
            cols = v0 + lanes
            tl.store(d_row + cols, tl.zeros((BLOCK_V,), d_ptr.dtype.element_ty),
                     mask=cols < VPAD)
        return
    row = tl.load(row_idx_ptr + c0 + r)
    tgt = tl.load(target_ptr + row)
    z_row = z_ptr + r * ldz
    if LSE_IN:
        lse = tl.load(lse_ptr + row)
    else:
        m, s, arg, ws = _fold_init(BLOCK_V)
        for v0 in range(0, VPAD, BLOCK_V):
            cols = v0 + lanes
            z = finished_logits(z_row, cols, cols < VPAD, bias_ptr, softcap, HAS_BIAS,
                                HAS_SOFTCAP)
            m, s, arg, ws = _fold_block(z, cols, V, m, s, arg, ws, cw_ptr, WITH_WS, HAS_CW)
        has_t = (tgt >= 0) & (tgt < V)  # else the target is a column of another shard
        zt = tl.where(has_t, finished_logits(z_row, tl.where(has_t, tgt, 0), True, bias_ptr,
                                             softcap, HAS_BIAS, HAS_SOFTCAP), 0.0)
        lse = store_row_stats(m, s, arg, ws, row, tgt, zt, V, c_tgt_ptr, c_smooth_ptr,
                              c_prob_ptr, c_lse_sq_ptr, lse_ptr, zt_ptr, ws_ptr, max_ptr,
                              am_ptr, nll_ptr, loss_ptr, WITH_WS, True)
    if NEED_D:
        alpha, c_tgt, c_smooth = grad_coefs(row, lse, c_tgt_ptr, c_smooth_ptr, c_prob_ptr,
                                            c_lse_sq_ptr)
        scale = tl.load(scale_ptr) if HAS_SCALE else 1.0
        for v0 in range(0, VPAD, BLOCK_V):
            cols = v0 + lanes
            z = finished_logits(z_row, cols, cols < VPAD, bias_ptr, softcap, HAS_BIAS,
                                HAS_SOFTCAP)
            dz = _grad(z, cols, cols < V, lse, alpha, tgt, c_tgt, c_smooth, cw_ptr, softcap,
                       HAS_CW, HAS_SOFTCAP)
            if D_OVER_Z:
                # D's bytes [2 v0, 2 v0 + 2 BLOCK_V) overlap Z's columns [v0 / 2, v0 / 2 +
                # BLOCK_V / 2), which other warps may not have read yet in the first two
                # blocks: every warp finishes this block's loads before anyone stores.
                tl.debug_barrier()
            tl.store(d_row + cols, (dz * scale).to(d_ptr.dtype.element_ty), mask=cols < VPAD)


_PROBE = {}


def cublas_fp32_out_available(device: torch.device, probe: bool = True) -> bool:
    """Whether torch.mm / torch.addmm take ``out_dtype=float32`` for 16-bit CUDA inputs (an fp32
    result/accumulator straight from cuBLAS), checked once against an fp32 product. With
    ``probe`` False a device not checked yet reads as without them (the check waits for its
    result on the host: not possible while a CUDA graph is captured)."""
    key = str(device)
    if key not in _PROBE:
        if not probe:
            return False
        try:
            a = torch.randn(24, 40, device=device).to(torch.bfloat16)
            b = torch.randn(40, 16, device=device).to(torch.bfloat16)
            ref = a.float() @ b.float()
            out = torch.empty(24, 24, device=device)[:, :16]
            torch.mm(a, b, out_dtype=torch.float32, out=out)
            acc = ref.clone()
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            _PROBE[key] = bool(torch.allclose(out, ref, atol=1e-3, rtol=1e-3)
                               and torch.allclose(acc, 2 * ref, atol=1e-3, rtol=1e-3))
        except Exception:  # older torch: no fp32-output GEMM for 16-bit inputs
            _PROBE[key] = False
    return _PROBE[key]


def gemm_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *, alpha: float = 1.0,
              accumulate: bool = False) -> torch.Tensor:
    """out (fp32) = alpha * a @ b (+ out when accumulating), products accumulated in fp32.
    CUDA 16-bit inputs: one cuBLAS call with an fp32 result. Elsewhere (fp32 inputs, the CPU
    under the Triton interpreter) an fp32 GEMM."""
    beta = 1.0 if accumulate else 0.0
    if a.is_cuda and a.dtype != torch.float32:
        return torch.addmm(out, a, b, beta=beta, alpha=alpha, out_dtype=torch.float32, out=out)
    return torch.addmm(out, a.float(), b.float(), beta=beta, alpha=alpha, out=out)


def gemm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *,
              alpha: float = 1.0) -> torch.Tensor:
    """out = alpha * a @ b in out's dtype: the products summed in fp32, times alpha, rounded
    once. For a 16-bit out, cuBLAS's reduced-precision reductions (split-K partial sums added
    in 16 bits, which torch allows by default) are disallowed for the call
    (``exact_16bit_reductions``)."""
    if out.dtype == torch.float32:
        return gemm_f32(a, b, out, alpha=alpha)
    with exact_16bit_reductions(out.dtype):
        return torch.addmm(out, a, b, beta=0.0, alpha=alpha, out=out)


@contextlib.contextmanager
def exact_16bit_reductions(dtype: torch.dtype):
    """torch.backends.cuda.matmul's allow_{bf16,fp16}_reduced_precision_reduction off for
    ``dtype`` within the block, restored after (with its split-K part where torch has one)."""
    m = torch.backends.cuda.matmul
    name = ("allow_bf16_reduced_precision_reduction" if dtype == torch.bfloat16
            else "allow_fp16_reduced_precision_reduction")
    allowed = getattr(m, name)
    if not allowed:
        yield
        return
    split_k = getattr(m, name + "_split_k", None)
    setattr(m, name, False)
    try:
        yield
    finally:
        setattr(m, name, True if split_k is None else (True, split_k))


def applicable(p: Problem, low_memory: bool, host_read: bool = True) -> bool:
    """The default for losses with gradients: 16-bit CUDA inputs (fp32 ones keep the exact
    Triton path); config.ROW_CHUNKS_ON_CPU lets the interpreter tests run it on the CPU.
    ``host_read``: whether the caller may wait on the host for the valid count (not while a
    CUDA graph is captured: forward_with_grads then runs without it)."""
    if low_memory or p.N == 0 or not config.ROW_CHUNKS:
        return False
    if p.device.type != "cuda":
        return config.interpreting() and config.ROW_CHUNKS_ON_CPU
    return (not config.interpreting() and p.x.dtype in (torch.bfloat16, torch.float16)
            and cublas_fp32_out_available(p.device, probe=host_read))


def chunking(rows: int, bytes_per_row: int, dw32_bytes: int,
             grads16_bytes: int = 0) -> tuple[int, int]:
    """(number of chunks, rows per chunk) of ``rows`` rows of Z; ``dw32_bytes``: the fp32 dW
    accumulator's size with gradients, else 0; ``grads16_bytes``: the size of the gradients
    the backward will return in the input dtype. Z may take ``row_chunk_budget`` bytes; all
    rows go in one chunk when they fit in that, or in twice that where two chunks would hold
    fewer than config.ROW_CHUNK_SPLIT_MIN_ROWS rows each (then dW is one product, not
    accumulated).
    Chunks are balanced, and a multiple of 128 rows (whole GEMM tiles) when the budget allows
    that many."""
    budget = row_chunk_budget(dw32_bytes, rows if dw32_bytes else 0, bytes_per_row,
                              grads16_bytes)
    size = rows * bytes_per_row
    if size <= budget or (size <= 2 * budget and rows < 2 * config.ROW_CHUNK_SPLIT_MIN_ROWS):
        return 1, max(rows, 1)
    c_max = max(1, budget // bytes_per_row)
    align = 128 if c_max >= 128 else 1
    c = balanced_chunk(rows, c_max // align * align, align)
    return triton.cdiv(rows, c), c


def balanced_chunk(rows: int, c_max: int, align: int) -> int:
    """Rows per chunk of ``rows`` in as few chunks of at most c_max (a multiple of ``align``)
    as possible, balanced, rounded up to a multiple of ``align`` (at most ``rows``)."""
    return min(rows, c_max, triton.cdiv(triton.cdiv(rows, triton.cdiv(rows, c_max)), align)
               * align)


def row_chunk_budget(dw32_bytes: int, rows: int = 0, bytes_per_row: int = 0,
                     grads16_bytes: int = 0) -> int:
    """Bytes of Z: the largest of ROW_CHUNK_BYTES, half the fp32 dW accumulator and the Z of
    1 / ROW_CHUNKS_FEW of ``rows`` (rows of ``bytes_per_row``; given with gradients), at most
    the larger of ROW_CHUNK_BYTES_MAX and ``grads16_bytes``. Each chunk reads and writes that
    accumulator once (8 V H bytes) and runs its own db product: with Z at half the accumulator
    a chunk holds enough rows (>= ~1000 at H = 4096) for that traffic to stay a small part of
    the chunk's GEMM time, and with at most ~ROW_CHUNKS_FEW chunks their count stays small
    where V H is (H200: Llama-3 head 95 ms with 512 MiB, 88 ms with 1 GiB; BERT head on 16k
    tokens 7.07-7.11 ms in 8 chunks of 2048 rows, 6.66-6.70 ms in 4 of 4096; NOTES.md).

    The cap grows to ``grads16_bytes`` because the peak is the backward's anyway: it holds the
    fp32 gradients and their rounded copies at once (scale.py), and Z is freed before it. So
    a Z of that size costs no peak memory (H100, NOTES.md #57: Llama-3's and Gemma-2's heads
    in 4 chunks instead of 5, 3 % faster at the same peak)."""
    few = triton.cdiv(rows, config.ROW_CHUNKS_FEW)
    if few >= 128:
        few = triton.cdiv(few, 128) * 128
    return min(max(config.ROW_CHUNK_BYTES_MAX, grads16_bytes),
               max(config.ROW_CHUNK_BYTES, dw32_bytes // 2, few * bytes_per_row))


def padded_vocab(v: int) -> int:
    """V rounded up to a multiple of 64: the GEMMs' vocabulary size."""
    return triton.cdiv(v, 64) * 64


def padded_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight with V rounded up to a multiple of 64 by zero rows (fast cuBLAS shapes)."""
    v = weight.shape[0]
    v_pad = padded_vocab(v)
    if v_pad == v:
        return weight
    wp = torch.empty((v_pad, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    wp[:v] = weight
    wp[v:] = 0
    return wp


def _padded_bias(bias, v_pad: int, device) -> torch.Tensor:
    """The bias in fp32, zero past V, so that finish_rows_kernel's loads of [0, VPAD) are in
    bounds (the epilogue path's kernels take the bias as given)."""
    bp = torch.zeros(v_pad, dtype=torch.float32, device=device)
    if bias is not None:
        bp[:bias.shape[0]] = bias
    return bp


def split_weight(weight: torch.Tensor) -> list:
    """Row ranges of W for GEMMs without a padded copy: W's first V64 rows (V rounded down to a
    multiple of 64, a view, fast in cuBLAS) and the < 64 left in a second, small GEMM. (H200,
    session 3: at one chunk this saves the copy, MLM 1.47 vs 1.53 ms and 60 MiB less, but it
    costs ~0.06 ms per chunk in the small GEMMs: BERT 8k, four chunks, 3.93 vs 3.68 ms. So
    several chunks use the padded copy, made once per call.)"""
    v = weight.shape[0]
    v64 = v // 64 * 64
    return [(a, b) for a, b in ((0, v64), (v64, v)) if b > a]


class _Outputs:
    """What forward_with_grads writes: the per-row statistics and loss (unless ``lse_in`` is
    given) and the fp32 gradients. ``dx_rows``: None where dx32 has a row per row of x, else
    dx32 holds the valid rows only, row k being x's row ``dx_rows[k]`` (set by forward_with_grads
    once the valid count is known)."""

    def __init__(self, p: Problem, lse_in, need_dx: bool):
        n, dev = p.N, p.device
        f32 = dict(dtype=torch.float32, device=dev)
        if lse_in is None:
            self.lse = torch.empty(n, **f32)
            self.rest = torch.empty((5, n), **f32)
            self.zt, self.ws, self.mx, self.nll, self.loss = self.rest.unbind()
            self.am = torch.empty(n, dtype=torch.long, device=dev)
        else:
            self.lse = lse_in.to(torch.float32).contiguous()
            self.rest = None
            self.zt = self.ws = self.mx = self.am = self.nll = self.loss = self.lse  # not written
        self.dx32 = torch.empty(p.x.shape, **f32) if need_dx else None
        self.dx_rows = None
        self.dw32 = self.db32 = None

    def zero_ignored(self, p: Problem, stats: bool = True):
        """The rows no kernel writes (ignored targets): zero statistics (unless ``stats`` is
        False: the finish kernels' fill programs write them), argmax ignore_index, zero dx rows
        (all of a full dx: the valid rows are written later)."""
        if self.rest is not None and stats:
            self.lse.zero_()
            self.rest.zero_()
            self.am.fill_(p.ignore_index)
        if self.dx32 is not None and self.dx_rows is None:
            self.dx32.zero_()


# The db product ones(1, k) @ D reduces over k = a chunk's rows. cuBLAS runs it as a gemv at
# 1.4 TB/s when k is not a multiple of 8 and as a GEMM at 3.1 TB/s when it is (H200, k = 2458,
# MLM's valid rows: 109 vs 49 us; NOTES.md #31): D gets zero rows up to the next multiple.
DB_ROWS_ALIGN = 8


def _db_rows(rows: int) -> int:
    return triton.cdiv(rows, DB_ROWS_ALIGN) * DB_ROWS_ALIGN


class _FirstTileChunk:
    """The epilogue path's workspace for chunks of ``c`` rows, and its first chunk's logits
    GEMM, launched before the host read of the valid count: over the first min(c, N) rows of
    the stable partition ``p.row_idx`` (the valid rows first), of which the kernel computes
    those below the count it reads on the device. It runs while the host waits for the count
    and then sets up the rest (about 0.3 ms at the BERT shapes, NOTES.md #52). Where the count
    then rules the path out (fewer valid rows than ``logits_tiles.min_valid_rows``), the kernel
    has computed nothing (before, with min_rows 4096, 0.3 ms of GEMM at MLM, NOTES.md #74)."""

    def __init__(self, p: Problem, c: int, with_ws: bool, need_db: bool, bias, refs):
        rows = min(c, p.N)
        self.d, self.ts, self.db_parts = _tile_workspace(p, rows, with_ws, need_db)
        self.x = p.x.index_select(0, p.row_idx[:rows])  # (its first n_valid: x's valid rows)
        self.ts.logits(p, self.x, self.d, 0, bias, with_ws,
                       min_count=logits_tiles.min_valid_rows(p), refs=refs)


def _tile_workspace(p: Problem, rows: int, with_ws: bool, need_db: bool):
    """The epilogue path's per-chunk buffers for chunks of up to ``rows`` rows: E (then D over
    it) in the input dtype, the tile statistics and, with a bias, db's partial column sums
    (written with D)."""
    v_pad = padded_vocab(p.V)
    d = torch.empty((rows, v_pad), dtype=p.x.dtype, device=p.device)
    ts = logits_tiles.TileStats(p, rows, with_ws)
    db_parts = (torch.empty((logits_tiles.db_part_rows(ts.cfg, rows), v_pad),
                            dtype=torch.float32, device=p.device) if need_db else None)
    return d, ts, db_parts


class _NoStream:
    """Stands for a CUDA stream and its events where there are none (the interpreter tests):
    the work runs in program order, so every wait is already met."""

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self):
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _GemmAhead:
    """With config.OVERLAP_MIN_CHUNKS chunks or more on the epilogue path and the tile
    configuration's "overlap": chunk i + 1's logits GEMM runs on a second stream, into a second
    E buffer and tile statistics, while chunk i's statistics and D pass (memory-bound) runs on
    the current stream, which then runs chunk i's products. The GEMM of chunk i + 1 waits for
    the products of chunk i - 1, the last reader of its buffer; the statistics of chunk i wait
    for its GEMM. Costs the second buffer (one chunk's E and statistics). The GEMM keeps one
    program per SM, so the D pass runs beside it only where its program fits in what the GEMM
    leaves of an SM's registers (its ``db_warps``; tools/probe_overlap.py)."""

    def __init__(self, p: Problem, workspace, rows: int, with_ws: bool, n_chunks: int, refs):
        # (with two chunks the second buffer would take back the memory that cutting the rows
        # in two saved: config.OVERLAP_MIN_CHUNKS)
        self.on = n_chunks >= config.OVERLAP_MIN_CHUNKS and p.cfg["logits_tiles"]["overlap"]
        if not self.on:
            return
        self.p, self.with_ws, self.refs = p, with_ws, refs
        self.bufs = [workspace, _tile_workspace(p, rows, with_ws, False)[:2]]
        if p.device.type == "cuda":
            self.main = torch.cuda.current_stream(p.device)
            self.side = torch.cuda.Stream(device=p.device)
            self.on_side = lambda: torch.cuda.stream(self.side)
        else:
            self.main = self.side = _NoStream()
            self.on_side = lambda: self.side
        self.side.wait_stream(self.main)  # x's gathered rows, the count
        self.freed = [None, None]  # per buffer: its last reader's products are done
        self.ready = None  # the GEMM of the chunk about to be finished is done
        self.i = 0

    def chunk(self, c0: int, xv: torch.Tensor, c: int, nv: int, bias):
        """Before chunk i (rows c0 of ``xv``) is finished: launches chunk i + 1's GEMM on the
        side stream and makes the current stream wait for chunk i's; returns chunk i's (E
        buffer, tile statistics)."""
        i, nxt = self.i, c0 + c
        if nxt < nv:
            d, ts = self.bufs[(i + 1) % 2]
            with self.on_side():
                if self.freed[(i + 1) % 2] is not None:
                    self.side.wait_event(self.freed[(i + 1) % 2])
                ts.logits(self.p, xv[nxt:min(nxt + c, nv)], d, nxt, bias, self.with_ws,
                          refs=self.refs)
                ready = self.side.record_event()
        if self.ready is not None:
            self.main.wait_event(self.ready)
        self.ready = ready if nxt < nv else None
        return self.bufs[i % 2]

    def release(self):
        """After chunk i's products: its buffer may take chunk i + 2's GEMM."""
        self.freed[self.i % 2] = self.main.record_event()
        self.i += 1


def _sweep_chunks(p: Problem, cf, scale, d_scale, nv, all_valid, c, with_ws, need_d, lse_in,
                  bp, out: _Outputs, tiles: bool, first, refs):
    """The chunk loop of forward_with_grads (its workspaces, the padded weight among them, are
    freed on return) over the compacted positions [0, nv), with the epilogue logits where
    ``tiles``; ``all_valid``: the count was read and every row is valid (the compacted
    positions are then x's rows); ``first``: a _FirstTileChunk whose logits GEMM is the first
    chunk's, or None. Otherwise nothing is launched before the first chunk's logits GEMM but
    the gather of x's valid rows: the GPU waits for it since the host read. ``refs``: a
    row_ref.RowRefs (the epilogue path only: E against one reference per row, so that
    dX = s (E W) + D_t W_t and dW = E^T (s x) + the target terms), or None."""
    n, v, h, dev = p.N, p.V, p.H, p.device
    inv_scale = 1.0 / d_scale
    v_pad = padded_vocab(v)
    several = triton.cdiv(nv, c) > 1
    split = split_weight(p.weight)
    rows = p.row_idx[:nv]
    if all_valid:
        xv = p.x
    elif first is not None and nv <= first.x.shape[0]:  # gathered already
        xv = first.x[:nv]
    else:
        xv = p.x.index_select(0, rows)
    if refs is not None:
        refs.chunk_buffers(min(c, nv))
    if first is not None:
        d, ts, db_parts = first.d, first.ts, first.db_parts
    elif tiles:
        d, ts, db_parts = _tile_workspace(p, min(c, nv), with_ws, out.db32 is not None)
    if tiles:
        # (also while a graph is captured: the side stream forks from the capturing one and
        # joins it again at each chunk's wait)
        ahead = _GemmAhead(p, (d, ts), min(c, nv), with_ws, triton.cdiv(nv, c), refs)
    else:
        db_parts = None
        # db's product's row of ones (the epilogue path sums db_parts instead)
        ones = (torch.ones((1, _db_rows(min(c, nv))), dtype=p.x.dtype, device=dev)
                if out.db32 is not None else None)
        # Z: fp32 logits in columns [0, V) of rows v_pad wide (columns past V: zeros from a
        # padded W, or never written; the kernel reads them, aligned, and masks them out; rows
        # rounded up for the db product: DB_ROWS_ALIGN)
        z = torch.empty((_db_rows(min(c, nv)), v_pad), dtype=torch.float32, device=dev)
        # D (input dtype) over the first half of each fp32 row of Z: row stride 2 * v_pad
        d = z.view(p.x.dtype) if p.x.element_size() == 2 else torch.empty_like(z)
    # dX's chunk product: straight into dX32 when every row is valid or it holds the valid
    # rows only (out.dx_rows), else into gathered rows copied to theirs
    dx_c = (torch.empty((min(c, nv), h), dtype=torch.float32, device=dev)
            if out.dx32 is not None and not all_valid and out.dx_rows is None else None)
    w, parts = p.weight, split  # the first chunk's logits come from W itself
    fin = p.cfg["row_finish"]
    for c0 in range(0, nv, c):
        cc = min(c, nv - c0)
        xc = xv[c0:c0 + cc]
        if not tiles:
            for a, b in parts:
                gemm_f32(xc, w[a:b].t(), z[:cc, a:b])
        else:
            # (the first chunk's GEMM may be _FirstTileChunk's; the others may come ahead)
            if (c0 == 0 and first is None) or (c0 > 0 and not ahead.on):
                ts.logits(p, xc, d, c0, bp, with_ws, refs=refs)
            if ahead.on:
                d, ts = ahead.chunk(c0, xv, c, nv, bp)
        if c0 == 0:  # launched behind the first GEMM
            # dX's rows that no chunk covers (the finish kernels write the ignored rows'
            # statistics; positions spanning all N, as under capture, cover every row)
            if nv < n:
                out.zero_ignored(p, stats=False)
            if several:  # the padded copy serves every product from here on
                w = padded_weight(p.weight)
                parts = [(0, w.shape[0])]
        if tiles:
            n_parts = ts.finish(p, xc, d, c0, bp, cf, out, with_ws, need_d, db_parts,
                                fill_ignored=c0 == 0 and not all_valid, refs=refs)
        else:
            # with db's product, D's rows [cc, db_rows(cc)) are zeroed by the same launch, and
            # the first chunk's launch writes the ignored rows' statistics (FILL set either
            # way: one compiled kernel, as for logits_tiles.finish_tiles_kernel)
            grid_rows = _db_rows(cc) if out.db32 is not None else cc
            fill = fin["fill_rows"]
            fill_programs = (triton.cdiv(n, fill) if c0 == 0 and not all_valid and not lse_in
                             else 0)
            finish_rows_kernel[(grid_rows + fill_programs,)](
                z, v_pad, d, d.shape[1], bp, p.cw_arg, p.target, p.row_idx, c0, cc, *cf,
                scale if scale is not None else z, out.lse, out.zt, out.ws, out.mx, out.am,
                out.nll, out.loss, v, v_pad, p.softcap_arg, grid_rows, p.n_valid, n,
                p.ignore_index, FILL=fill,
                HAS_BIAS=p.bias is not None, HAS_SOFTCAP=p.softcap is not None,
                HAS_CW=p.class_weight is not None, WITH_WS=with_ws, NEED_D=need_d, LSE_IN=lse_in,
                HAS_SCALE=scale is not None, D_OVER_Z=d.data_ptr() == z.data_ptr(),
                BLOCK_V=fin["BLOCK_V"], num_warps=fin["num_warps"])
        v_gemm = parts[-1][1]  # V, or v_pad with the padded copy (its columns past V are 0)
        dc = d[:cc, :v_gemm]
        if out.dx32 is not None:
            dst = out.dx32[c0:c0 + cc] if dx_c is None else dx_c[:cc]
            for i, (a, b) in enumerate(parts):
                gemm_f32(dc[:, a:b], w[a:b], dst, alpha=inv_scale, accumulate=i > 0)
            if refs is not None:  # D = diag(s) E + the target terms
                refs.dx_rows(dst, w)
            if dx_c is not None:
                out.dx32.index_copy_(0, rows[c0:c0 + cc], dst)
        x_dw = xc if refs is None else refs.xs[:cc]  # (D^T x = E^T (s x) + the target terms)
        for a, b in parts if out.dw32 is not None else ():
            gemm_f32(dc[:, a:b].t(), x_dw, out.dw32[a:b], alpha=inv_scale, accumulate=c0 > 0)
        if refs is not None and out.dw32 is not None:
            refs.dw_targets(out.dw32, xc)
        if db_parts is not None:  # (D unscaled: bf16, or fp32 under the interpreter)
            if c0 == 0:
                torch.sum(db_parts[:n_parts], 0, out=out.db32[0])
            else:
                out.db32[0] += db_parts[:n_parts].sum(0)
        elif out.db32 is not None:  # column sums of D as a (1 x cc') @ D product into fp32
            # over all v_pad columns (D is 0 past V): cuBLAS's kernel for the 30522 columns of
            # BERT's head took 124 us, for 30528 74 us (H100, MLM's rows, NOTES.md #75)
            k = _db_rows(cc)
            gemm_f32(ones[:, :k], d[:k, :v_pad], out.db32, alpha=inv_scale, accumulate=c0 > 0)
        if tiles and ahead.on:
            ahead.release()


def _copy_bytes(t: torch.Tensor) -> int:
    """Bytes per element of the backward's rounded copy of a gradient for ``t``."""
    return 0 if t.dtype == torch.float32 else t.element_size()


def forward_with_grads(p: Problem, cf, read, scale, with_ws: bool, need_dx: bool,
                       need_dw: bool, need_db: bool, lse_in=None, read_arrived=lambda: False,
                       compact_dx: bool = False):
    """((lse, target_logit, weighted_sum, max_logit, argmax, nll, loss), (dx, dw, db), dx_rows)
    in one sweep over row chunks (module doc), the gradients in fp32. ``compact_dx``: where
    some rows are ignored, dx holds the valid rows only, row k being x's row dx_rows[k]
    (``p.row_idx``: valid rows first; dx_rows None otherwise): no N x H fp32 buffer zeroed for
    the ignored rows and copied into (MLM: 54 of its 64 MiB). ``cf``: the per-row
    coefficients (gradients.row_coefs); ``read``: waits for the started host read of the valid
    count (kernels.CountRead), sets ``p.n_valid_host`` and returns D's scale; called once the
    launches that do not depend on it are queued; None where nothing may wait on the host
    (CUDA-graph capture; fp16's D scale then stays in the products until they are done, and
    is divided out on the device): the chunks then span all N compacted positions, and the
    kernels give the rows past the device's valid count zero rows of D, so that the dX, dW and
    db products over whole chunks add nothing for them; ``scale``: the power of two dz is
    stored with (gradients.grad_scale, fp16 only: a device tensor, also in that read), None
    for 1;
    ``read_arrived``: whether that read has already arrived (then nothing is speculated).
    With ``lse_in`` the statistics are not computed (None is returned for them) and the
    gradients use the given lse.

    The GEMMs run on V a multiple of 64 (``split_weight`` or a padded copy): cuBLAS is 2.5-3x
    slower on V = 30258 or with K = 30258 (H200, NOTES.md)."""
    n, v, h, dev = p.N, p.V, p.H, p.device
    v_pad = padded_vocab(v)
    out = _Outputs(p, lse_in, need_dx and not compact_dx)
    # the backward's rounded copies of dW and dX (none for fp32: scaled in place): Z may be
    # as large (row_chunk_budget)
    grads16 = h * (v * need_dw * _copy_bytes(p.weight) + n * need_dx * _copy_bytes(p.x))
    # Where the epilogue path would serve all N rows, its first logits GEMM is launched before
    # the host read of the valid count, chunked as if every row were valid; if the count then
    # rules the path out (fewer than a configured min_rows valid; the default is 0), that
    # launch computed nothing. Not where the count is on the host already
    # (fused_ce.prepare_targets, made early).
    first = refs = None
    tiles_all = logits_tiles.applicable(p, lse_in, n, with_ws)
    if tiles_all and row_ref.applicable(p, with_ws, need_dx, need_dw, need_db):
        refs = row_ref.RowRefs(p)  # (launched before any logits GEMM)
    if read is not None and tiles_all and not read_arrived():
        _, c = chunking(n, logits_tiles.bytes_per_row(p, v_pad), v * h * 4, grads16)
        first = _FirstTileChunk(p, c, with_ws, need_db, p.bias_arg, refs)
    # nv: the compacted positions the chunks cover (all N where the count stays on the device)
    d_scale, nv = (read(), p.n_valid_host) if read is not None else (1.0, n)
    all_valid = read is not None and nv == n  # then the compacted positions are x's rows
    tiles = logits_tiles.applicable(p, lse_in, nv, with_ws)
    # the epilogue kernels read the bias as given (masked past V), finish_rows_kernel an fp32
    # copy padded to v_pad
    bp = p.bias_arg if tiles or p.bias is None else _padded_bias(p.bias, v_pad, dev)
    if first is not None and tiles:
        n_chunks = triton.cdiv(nv, c)
    else:
        first = None
        n_chunks, c = chunking(nv, logits_tiles.bytes_per_row(p, v_pad) if tiles else v_pad * 4,
                               v * h * 4, grads16)
    if need_dw:
        # written, not added to, by the first chunk: no zero fill (2 GiB at Llama-3's head);
        # padded rows when several chunks run the GEMMs on the padded weight
        out.dw32 = torch.empty((v if n_chunks == 1 else v_pad, h), dtype=torch.float32,
                               device=dev)
    if need_db:
        out.db32 = torch.empty((1, v_pad), dtype=torch.float32, device=dev)
    if need_dx and compact_dx:
        out.dx32 = torch.empty((nv, h), dtype=torch.float32, device=dev)
        out.dx_rows = None if all_valid else p.row_idx
    if nv > 0:
        _sweep_chunks(p, cf, scale, d_scale, nv, all_valid, c, with_ws,
                      need_dx or need_dw or need_db, lse_in is not None, bp, out, tiles, first,
                      refs if tiles else None)
        if read is None and scale is not None:
            # fp16 without the host read: the products kept D's scale (their alpha is a host
            # number); a power of two, divided out exactly on the device
            torch._foreach_div_([g for g in (out.dx32, out.dw32, out.db32) if g is not None],
                                scale.reshape(()))
    else:  # no valid row: zero gradients
        out.zero_ignored(p)
        for g in (out.dw32, out.db32):
            if g is not None:
                g.zero_()
    dw = out.dw32[:v] if out.dw32 is not None else None
    db = out.db32[0, :v] if out.db32 is not None else None
    stats = (None if lse_in is not None
             else (out.lse, out.zt, out.ws, out.mx, out.am, out.nll, out.loss))
    return stats, (out.dx32, dw, db), out.dx_rows
