"""log_softmax(x @ W.T + b) of 16-bit CUDA inputs by chunks of rows, the logits never all in
memory at once and no host sync (every size is known). Two ways, by ``log_probs_by_tiles``:

- bf16 with TMA-addressable x and W: logits_tiles_kernel (LOG_PROBS) stores U = z - m_t per
  vocabulary tile with the tiles' m_t and sum-exp, and log_probs_tiles_kernel merges a row's
  tiles into its lse and writes U + m_t - lse (6 bytes per logit for bf16);
- otherwise cuBLAS fp32 logits per chunk (W padded to a multiple of 64 rows) and
  log_probs_rows_kernel per row (10 bytes per logit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fused_ce.kernels import config, logits_tiles
from fused_ce.kernels.problem import descriptor_ok
from fused_ce.kernels.row_chunks import (balanced_chunk, chunking, cublas_fp32_out_available,
                                         finished_logits, padded_vocab, padded_weight)

SINGLE_PASS_MAX_V = 32768  # a whole row of logits in one program's registers


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
        z = finished_logits(z_row, cols, mask, bias_ptr, 1.0, HAS_BIAS, False)
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
            z = finished_logits(z_row, cols, mask, bias_ptr, 1.0, HAS_BIAS, False)
            zm = tl.where(mask, z, float("-inf"))
            m_new = tl.maximum(m, tl.max(zm, 0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(zm - m_new), 0)
            m = m_new
        lse = m + tl.log(s)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            mask = cols < V
            z = finished_logits(z_row, cols, mask, bias_ptr, 1.0, HAS_BIAS, False)
            tl.store(o_row + cols, (z - lse).to(out_ptr.dtype.element_ty), mask=mask)


def _row_kernel_shape(v_pad: int) -> tuple[bool, int, int]:
    """(single pass, BLOCK_V, warps) of the log-probabilities row kernel."""
    if v_pad <= SINGLE_PASS_MAX_V:
        block = triton.next_power_of_2(v_pad)
        return True, block, 16 if block >= 16384 else 8
    return False, 4096, 8


def applicable(x: torch.Tensor) -> bool:
    return (x.is_cuda and not config.interpreting() and x.dtype in (torch.bfloat16, torch.float16)
            and not torch.cuda.is_current_stream_capturing()
            and cublas_fp32_out_available(x.device))


def log_probs_by_tiles(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether log_softmax takes the epilogue GEMM (config.LOG_PROBS_EPILOGUE; by default bf16
    CUDA inputs) rather than cuBLAS fp32 logits: x and W addressable by TMA descriptors."""
    wanted = config.LOG_PROBS_EPILOGUE
    if wanted is None:
        wanted = x.is_cuda and not config.interpreting() and x.dtype == torch.bfloat16
    ok_dtype = x.dtype in ((torch.bfloat16, torch.float32) if config.interpreting()
                           else (torch.bfloat16,))
    return (bool(wanted) and ok_dtype and weight.dtype == x.dtype
            and descriptor_ok(x) and descriptor_ok(weight))


def log_softmax(x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """log-probabilities by row chunks (no host sync: sizes are known): the epilogue GEMM's U
    where log_probs_by_tiles, else fp32 cuBLAS logits."""
    if log_probs_by_tiles(x, weight):
        return _log_softmax_tiles(x, weight, bias)
    n, v = x.shape[0], weight.shape[0]
    out = torch.empty((n, v), dtype=x.dtype, device=x.device)
    wp = padded_weight(weight)
    v_pad = wp.shape[0]
    single, block_v, warps = _row_kernel_shape(v_pad)
    n_chunks, c = chunking(n, v_pad * 4, 0)
    z = torch.empty((min(c, max(n, 1)), v_pad), dtype=torch.float32, device=x.device)
    for r0 in range(0, n, c):
        cc = min(c, n - r0)
        torch.mm(x[r0:r0 + cc], wp.t(), out_dtype=torch.float32, out=z[:cc])
        log_probs_rows_kernel[(cc,)](z, v_pad, bias if bias is not None else z, out, r0, v,
                                     HAS_BIAS=bias is not None, SINGLE=single,
                                     BLOCK_V=block_v, num_warps=warps)
    return out


def _log_softmax_tiles(x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """Per chunk of rows, logits_tiles_kernel (LOG_PROBS) stores U = z - m_t in the input dtype
    (V padded to 64) with each (row, tile)'s m_t and sum_j exp(z_j - m_t); then
    log_probs_tiles_kernel merges a row's tiles into its lse and writes U + m_t - lse. Bytes
    per logit: U written and read, the output written (6 for bf16; the fp32 path moves 10). U
    takes at most ROW_CHUNK_BYTES per chunk."""
    n, h = x.shape
    v = weight.shape[0]
    out = torch.empty((n, v), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    cfg = config.current(h)["logits_tiles"]
    width = logits_tiles.tile_width(cfg)
    n_tiles = triton.cdiv(v, width)
    v_pad = padded_vocab(v)
    bm = cfg["BM"]
    per_row = v_pad * x.element_size() + n_tiles * 8  # U and the tile statistics
    c = balanced_chunk(n, max(bm, config.ROW_CHUNK_BYTES // per_row // bm * bm), bm)
    u = torch.empty((c, v_pad), dtype=x.dtype, device=x.device)
    m = torch.empty((c, n_tiles), dtype=torch.float32, device=x.device)
    s = torch.empty((c, n_tiles), dtype=torch.float32, device=x.device)
    w_desc = TensorDescriptor.from_tensor(weight, [cfg["BN"], cfg["BK"]])
    bias_arg = bias if bias is not None else weight
    for r0 in range(0, n, c):
        cc = min(c, n - r0)
        # (the targets, the row list and the other statistics are not read with LOG_PROBS)
        logits_tiles.launch(cfg, x[r0:r0 + cc], w_desc, u, bias_arg, m, m, 0, v, m, s, m, m,
                            n_tiles, HAS_BIAS=bias is not None, HAS_CW=False,
                            WITH_WS=False, LOG_PROBS=True)
        logits_tiles.log_probs_tiles_kernel[(cc,)](
            u, v_pad, m, s, n_tiles, out, r0, v, BLOCK_T=triton.next_power_of_2(n_tiles),
            TILES=cfg["finish_tiles"], BN=width, num_warps=cfg["finish_warps"])
    return out
