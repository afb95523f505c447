"""log_softmax(x @ W.T + b) written in x's dtype: the logits of each tile are recomputed
(logits.py, the same fp32 values the lse came from) and ``z - lse`` is rounded once."""

import triton
import triton.language as tl

from fused_ce.kernels.logits import logits_tile


@triton.jit
def log_probs_kernel(x_ptr, w_src, bias_ptr, lse_ptr, out_ptr, N, V, H,
                     HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                     EVEN_K: tl.constexpr, W_DESC: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < N
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < V
    z = logits_tile(x_ptr, w_src, bias_ptr, rows, row_mask, pid_n * BLOCK_N, cols, col_mask, H,
                    1.0, HAS_BIAS, False, UPCAST, IEEE, EVEN_K, W_DESC, BLOCK_M, BLOCK_N, BLOCK_K)
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    out = out_ptr + rows.to(tl.int64)[:, None] * V + cols[None, :]
    tl.store(out, (z - lse[:, None]).to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])
