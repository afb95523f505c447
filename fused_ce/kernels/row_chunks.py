"""The fast path for vocabularies whose fp32 dW fits comfortably (BERT-class heads): three
cuBLAS GEMMs per row chunk, the softmax work in one Triton kernel between them.

The weight is copied once per call into ``Wp`` with V padded to a multiple of 64 (zero rows):
cuBLAS runs 2-3x slower when V is not a multiple of 8 (measured on the H200: 240 vs 530-690
TFLOP/s at V=30258; NOTES.md). Per chunk of c compacted valid rows::

    Z  = x_c @ Wp.T                    cuBLAS, fp32 output (c x Vpad)
    finish_rows_kernel                 per row: + bias, softcap, online lse / max / argmax /
                                       target logit / sum_j w_j z_j; then dz (input dtype) -> D,
                                       zero in the padded columns. When a whole row fits one
                                       program (Vpad <= 32768) Z is read once and D is written
                                       over Z's own row (no second buffer).
    dX[rows_c]  = D @ Wp               cuBLAS, fp32 output, rounded once into dX (full
                                       vocabulary in one product; the fp32 output also keeps
                                       cuBLAS from reducing split-K partials in 16 bits)
    dW32       += D.T @ x_c            cuBLAS into an fp32 accumulator (no bf16 drift); a single
                                       chunk writes dW directly (one product over all rows)
    db32       += column sums of D     (fp32)

Three GEMM-equivalents. Workspace: Z (and D when rows do not fit one program) within
config.ROW_CHUNK_BYTES, Wp, and the fp32 dW (4 V H bytes) when there are several chunks.
cuBLAS needs the number of valid rows on the host: this path synchronises once per call (one read
of two scalars), so it is not used while a CUDA graph is being captured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fused_ce.kernels import config
from fused_ce.kernels.logits import tanh
from fused_ce.kernels.problem import Problem

SINGLE_PASS_MAX_V = 32768  # a whole row of logits in one program's registers


@triton.jit
def _finished_logits(z_row, cols, mask, bias_ptr, softcap, HAS_BIAS: tl.constexpr,
                     HAS_SOFTCAP: tl.constexpr):
    """fp32 GEMM output + bias (once), then the softcap; masked columns read 0."""
    z = tl.load(z_row + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        z += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        z = softcap * tanh(z / softcap)
    return z


@triton.jit
def _grad(z, cols, mask, lse, alpha, tgt, c_tgt, c_smooth, cw_ptr, softcap,
          HAS_CW: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """dz of one row's logits (module doc of grad_logits.py), 0 on masked columns."""
    dz = alpha * tl.exp(z - lse) - tl.where(cols == tgt, c_tgt, 0.0)
    if HAS_CW:
        dz -= c_smooth * tl.load(cw_ptr + cols, mask=mask, other=0.0)
    else:
        dz -= c_smooth
    if HAS_SOFTCAP:
        u = z / softcap
        dz *= 1.0 - u * u
    return tl.where(mask, dz, 0.0)


@triton.jit
def finish_rows_kernel(z_ptr, ldz, d_ptr, ldd, bias_ptr, cw_ptr, target_ptr, row_idx_ptr, c0,
                       c_tgt_ptr, c_smooth_ptr, c_prob_ptr, c_lse_sq_ptr, scale_ptr,
                       lse_ptr, zt_ptr, ws_ptr, max_ptr, am_ptr, V, VPAD, softcap,
                       HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_CW: tl.constexpr,
                       WITH_WS: tl.constexpr, NEED_D: tl.constexpr, SINGLE: tl.constexpr,
                       BLOCK_V: tl.constexpr):
    """One program per row of the chunk. SINGLE: BLOCK_V >= VPAD, the row is loaded once and
    D may alias Z (every load precedes every store through the lse dependency)."""
    r = tl.program_id(0)
    row = tl.load(row_idx_ptr + c0 + r)
    tgt = tl.load(target_ptr + row)
    z_row = z_ptr + r.to(tl.int64) * ldz
    m = float("-inf")
    s = 0.0
    best = float("-inf")
    am = 0
    zt = 0.0
    ws = 0.0
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        mask = cols < V
        z = _finished_logits(z_row, cols, mask, bias_ptr, softcap, HAS_BIAS, HAS_SOFTCAP)
        zm = tl.where(mask, z, float("-inf"))
        tile_max = tl.max(zm, 0)
        m_new = tl.maximum(m, tile_max)
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(zm - m_new), 0)
        m = m_new
        # first column attaining the max; a later tile must be strictly larger to win
        tile_arg = tl.min(tl.where(zm == tile_max, cols, 2147483647), 0)
        am = tl.where(tile_max > best, tile_arg, am)
        best = tl.maximum(best, tile_max)
        zt += tl.sum(tl.where((cols == tgt) & mask, z, 0.0), 0)
        if WITH_WS:
            if HAS_CW:
                w = tl.load(cw_ptr + cols, mask=mask, other=0.0)
                ws += tl.sum(tl.where(mask, z * w, 0.0), 0)
            else:
                ws += tl.sum(tl.where(mask, z, 0.0), 0)
    lse = m + tl.log(s)
    tl.store(lse_ptr + row, lse)
    tl.store(zt_ptr + row, zt)
    tl.store(ws_ptr + row, ws)
    tl.store(max_ptr + row, m)
    tl.store(am_ptr + row, am.to(tl.int64))
    if NEED_D:
        alpha = tl.load(c_prob_ptr + row) + 2.0 * tl.load(c_lse_sq_ptr + row) * lse
        c_tgt = tl.load(c_tgt_ptr + row)
        c_smooth = tl.load(c_smooth_ptr + row)
        scale = tl.load(scale_ptr)
        d_row = d_ptr + r.to(tl.int64) * ldd
        if SINGLE:
            cols = tl.arange(0, BLOCK_V)
            mask = cols < V
            z = _finished_logits(z_row, cols, mask, bias_ptr, softcap, HAS_BIAS, HAS_SOFTCAP)
            dz = _grad(z, cols, mask, lse, alpha, tgt, c_tgt, c_smooth, cw_ptr, softcap,
                       HAS_CW, HAS_SOFTCAP)
            tl.store(d_row + cols, (dz * scale).to(d_ptr.dtype.element_ty), mask=cols < VPAD)
        else:
            for v0 in range(0, VPAD, BLOCK_V):
                cols = v0 + tl.arange(0, BLOCK_V)
                mask = cols < V
                z = _finished_logits(z_row, cols, mask, bias_ptr, softcap, HAS_BIAS,
                                     HAS_SOFTCAP)
                dz = _grad(z, cols, mask, lse, alpha, tgt, c_tgt, c_smooth, cw_ptr, softcap,
                           HAS_CW, HAS_SOFTCAP)
                tl.store(d_row + cols, (dz * scale).to(d_ptr.dtype.element_ty),
                         mask=cols < VPAD)


_PROBE = {}


def cublas_fp32_out_available(device: torch.device) -> bool:
    """Whether torch.mm / torch.addmm take ``out_dtype=float32`` for 16-bit CUDA inputs (an fp32
    result/accumulator straight from cuBLAS), checked once against an fp32 product."""
    key = str(device)
    if key not in _PROBE:
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


def chunking(rows: int, bytes_per_row: int) -> tuple[int, int]:
    """(number of chunks, rows per chunk, a multiple of 8) for Z + D within ROW_CHUNK_BYTES;
    one chunk when everything fits in twice that (no fp32 dW accumulator then)."""
    if rows * bytes_per_row <= 2 * config.ROW_CHUNK_BYTES:
        return 1, max(rows, 1)
    c_max = max(64, config.ROW_CHUNK_BYTES // bytes_per_row)
    n_chunks = triton.cdiv(rows, c_max)
    return n_chunks, triton.cdiv(triton.cdiv(rows, n_chunks), 8) * 8


def applicable(p: Problem, low_memory: bool) -> bool:
    return (not low_memory and p.device.type == "cuda" and not config.interpreting()
            and p.x.dtype in (torch.bfloat16, torch.float16)
            and p.V * p.H * 4 <= config.ROW_CHUNK_MAX_DW32_BYTES
            and not torch.cuda.is_current_stream_capturing()
            and cublas_fp32_out_available(p.device))


def padded_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight with V rounded up to a multiple of 64 by zero rows (fast cuBLAS shapes)."""
    v = weight.shape[0]
    v_pad = (v + 63) // 64 * 64
    if v_pad == v:
        return weight
    wp = torch.empty((v_pad, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    wp[:v] = weight
    wp[v:] = 0
    return wp


def _row_kernel_shape(v_pad: int) -> tuple[bool, int, int]:
    """(single pass, BLOCK_V, warps) of the per-row kernels."""
    if v_pad <= SINGLE_PASS_MAX_V:
        block = triton.next_power_of_2(v_pad)
        return True, block, 16 if block >= 16384 else 8
    return False, 4096, 8


def forward_with_grads(p: Problem, cf, d_scale, with_ws, need_dx, need_dw, need_db):
    """RowStats fields and (dx, dw, db) in one sweep over row chunks (see the module doc)."""
    n, v, h = p.N, p.V, p.H
    inv_scale = 1.0 / d_scale  # (host values: read together with the valid-row count)
    nv = int(p.n_valid_host)
    dev = p.device
    lse = torch.zeros(n, dtype=torch.float32, device=dev)
    zt, ws, mx = (torch.zeros_like(lse) for _ in range(3))
    am = torch.full((n,), p.ignore_index, dtype=torch.long, device=dev)
    dx = torch.zeros_like(p.x) if need_dx else None
    need_d = need_dx or need_dw or need_db
    wp = padded_weight(p.weight)
    v_pad = wp.shape[0]
    single, block_v, warps = _row_kernel_shape(v_pad)
    elt = p.x.element_size()
    n_chunks, c = chunking(nv, v_pad * (4 if single or not need_d else 4 + elt))
    # one chunk: dW comes out of a single product over all rows, rounded once
    dw_pad = (torch.empty((v_pad, h), dtype=p.weight.dtype, device=dev)
              if need_dw and n_chunks == 1 else None)
    dw32 = (torch.zeros((v_pad, h), dtype=torch.float32, device=dev)
            if need_dw and dw_pad is None else None)
    db32 = torch.zeros(v_pad, dtype=torch.float32, device=dev) if need_db else None
    if nv > 0:
        rows = p.row_idx[:nv]
        xv = p.x if nv == n else p.x.index_select(0, rows)
        z = torch.empty((min(c, nv), v_pad), dtype=torch.float32, device=dev)
        if single:  # D written over Z's rows: the first half of each fp32 row
            d, ldd = z.view(p.x.dtype), 2 * v_pad
        else:
            d = torch.empty((min(c, nv), v_pad), dtype=p.x.dtype, device=dev)
            ldd = v_pad
        scale_t = torch.full((1,), d_scale, dtype=torch.float32, device=dev)
        for c0 in range(0, nv, c):
            cc = min(c, nv - c0)
            xc = xv[c0:c0 + cc]
            torch.mm(xc, wp.t(), out_dtype=torch.float32, out=z[:cc])
            finish_rows_kernel[(cc,)](
                z, v_pad, d, ldd, p.bias_arg, p.cw_arg, p.target, p.row_idx, c0, *cf,
                scale_t, lse, zt, ws, mx, am, v, v_pad, p.softcap_arg,
                HAS_BIAS=p.bias is not None, HAS_SOFTCAP=p.softcap is not None,
                HAS_CW=p.class_weight is not None, WITH_WS=with_ws, NEED_D=need_d,
                SINGLE=single, BLOCK_V=block_v, num_warps=warps)
            dc = d[:cc, :v_pad]
            if need_dx:
                dxc = torch.mm(dc, wp, out_dtype=torch.float32).mul_(inv_scale).to(p.x.dtype)
                if nv == n:
                    dx[c0:c0 + cc] = dxc
                else:
                    dx.index_put_((rows[c0:c0 + cc],), dxc)
            if dw_pad is not None:
                torch.addmm(dw_pad, dc.t(), xc, beta=0, alpha=inv_scale, out=dw_pad)
            elif need_dw:
                torch.addmm(dw32, dc.t(), xc, alpha=inv_scale, out_dtype=torch.float32,
                            out=dw32)
            if need_db:
                db32 += dc.sum(0, dtype=torch.float32) * inv_scale
    dw = None
    if dw32 is not None:
        dw = dw32[:v].to(p.weight.dtype)
    elif dw_pad is not None:
        dw = dw_pad[:v] if nv > 0 else dw_pad[:v].zero_()
    db = None
    if db32 is not None:
        db = db32[:v].to(p.bias.dtype if p.bias is not None else p.weight.dtype)
    return (lse, zt, ws, mx, am), (dx, dw, db)


@triton.jit
def log_probs_rows_kernel(z_ptr, ldz, bias_ptr, out_ptr, r0, V,
                          HAS_BIAS: tl.constexpr, SINGLE: tl.constexpr, BLOCK_V: tl.constexpr):
    """out[r0 + r] = z + b - lse(z + b) for one row of an fp32 logits chunk."""
    r = tl.program_id(0)
    z_row = z_ptr + r.to(tl.int64) * ldz
    o_row = out_ptr + (r0 + r).to(tl.int64) * V
    if SINGLE:  # the whole row in registers: Z read once
        cols = tl.arange(0, BLOCK_V)
        mask = cols < V
        z = _finished_logits(z_row, cols, mask, bias_ptr, 1.0, HAS_BIAS, False)
        zm = tl.where(mask, z, float("-inf"))
        m = tl.max(zm, 0)
        lse = m + tl.log(tl.sum(tl.exp(zm - m), 0))
        tl.store(o_row + cols, (z - lse).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        m = float("-inf")
        s = 0.0
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            mask = cols < V
            z = _finished_logits(z_row, cols, mask, bias_ptr, 1.0, HAS_BIAS, False)
            zm = tl.where(mask, z, float("-inf"))
            m_new = tl.maximum(m, tl.max(zm, 0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(zm - m_new), 0)
            m = m_new
        lse = m + tl.log(s)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            mask = cols < V
            z = _finished_logits(z_row, cols, mask, bias_ptr, 1.0, HAS_BIAS, False)
            tl.store(o_row + cols, (z - lse).to(out_ptr.dtype.element_ty), mask=mask)


def log_softmax_applicable(x: torch.Tensor) -> bool:
    return (x.is_cuda and not config.interpreting() and x.dtype in (torch.bfloat16, torch.float16)
            and not torch.cuda.is_current_stream_capturing()
            and cublas_fp32_out_available(x.device))


def log_softmax(x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """log-probabilities through fp32 cuBLAS logits chunks (no host sync: sizes are known)."""
    n, v = x.shape[0], weight.shape[0]
    out = torch.empty((n, v), dtype=x.dtype, device=x.device)
    wp = padded_weight(weight)
    v_pad = wp.shape[0]
    single, block_v, warps = _row_kernel_shape(v_pad)
    n_chunks, c = chunking(n, v_pad * 4)
    z = torch.empty((min(c, max(n, 1)), v_pad), dtype=torch.float32, device=x.device)
    for r0 in range(0, n, c):
        cc = min(c, n - r0)
        torch.mm(x[r0:r0 + cc], wp.t(), out_dtype=torch.float32, out=z[:cc])
        log_probs_rows_kernel[(cc,)](z, v_pad, bias if bias is not None else z, out, r0, v,
                                     HAS_BIAS=bias is not None, SINGLE=single,
                                     BLOCK_V=block_v, num_warps=warps)
    return out
