"""The shared inner piece of every kernel: one (rows x vocab) tile of the logits.

``z = x[rows] @ W[cols].T + b[cols]`` accumulated in fp32 over K = H in BLOCK_K steps, then the
optional softcap ``z = c * tanh(z / c)``. Every pass (statistics, gradient, log-probabilities)
computes its logits with this one function and the same BLOCK_K, so a logit has the same fp32
value (same products, same summation order) in the forward and the backward.
"""

import triton
import triton.language as tl


@triton.jit
def mma(a, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """acc += a @ b in fp32. UPCAST: the Triton interpreter computes 16-bit dots wrongly
    (triton-lang/triton#11584), so there operands are widened first. IEEE: exact fp32 products
    (fp32 inputs) instead of TF32."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def tanh(u):
    """tanh in fp32 to a few ulps of its value, NaN stays NaN. For |u| >= 1/4 through exp of a
    non-positive argument (no overflow): (1 - e) / (1 + e) with e = exp(-2|u|). Below 1/4 that
    form loses tanh's relative precision (1 - e cancels: its absolute error ~6e-8 is all of a
    tiny tanh's value, which is what a softcap far above the logits feeds), so there the Taylor
    series u (1 - u^2/3 + 2u^4/15 - 17u^6/315 + 62u^8/2835), whose first omitted term is
    below 1e-8 of u at |u| = 1/4."""
    e = tl.exp(-2.0 * tl.abs(u))
    t = (1.0 - e) / (1.0 + e)
    t = tl.where(u < 0, -t, t)
    s = u * u
    p = u * (1.0 + s * (-1.0 / 3.0 + s * (2.0 / 15.0 + s * (-17.0 / 315.0 + s * (62.0 / 2835.0)))))
    return tl.where(tl.abs(u) < 0.25, p, t)


@triton.jit
def cap_derivative(z, softcap):
    """The softcap's derivative at a capped logit z = c tanh(y / c): dz/dy = 1 - (z / c)^2 (a
    logit's gradient with a softcap is the capped one's times this)."""
    u = z / softcap
    return 1.0 - u * u


@triton.jit
def logits_tile(x_ptr, w_src, bias_ptr, rows, row_mask, col0, cols, col_mask, H, softcap,
                HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr,
                IEEE: tl.constexpr, EVEN_K: tl.constexpr, W_DESC: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                X_DESC: tl.constexpr = False, row0=0):
    """fp32 logits of rows ``rows`` (original row ids, BLOCK_M) and columns ``cols`` =
    ``col0 + arange(BLOCK_N)``. Masked rows/columns read zeros. ``w_src``: W's tensor
    descriptor (W_DESC; block [BLOCK_N, BLOCK_K], it reads zeros past V and H) or a pointer to
    W. The descriptor keeps W's tile out of the registers (a pointer per element of a 64 x 256
    operand tile takes 128 of a thread's 255 registers at 8 warps, and the epilogue then
    spills) and lets the compiler pipeline the K loop (NOTES.md #40). ``x_ptr`` likewise: with
    X_DESC x's descriptor (block [BLOCK_M, BLOCK_K]) read at the rows ``row0 + arange(BLOCK_M)``
    (consecutive; masked rows are read as they are: their logits go unused), instead of
    BLOCK_M x BLOCK_K pointers in registers. Offsets are int64: rows * H and cols * H exceed
    2**31."""
    offs_k = tl.arange(0, BLOCK_K)
    if not X_DESC:
        x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * H + offs_k[None, :]
    if not W_DESC:
        w_ptrs = w_src + cols.to(tl.int64)[None, :] * H + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(H, BLOCK_K)):
        kk = k * BLOCK_K + offs_k
        if X_DESC:
            a = x_ptr.load([row0, k * BLOCK_K])
        elif EVEN_K:
            a = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
        else:
            a = tl.load(x_ptrs, mask=row_mask[:, None] & (kk[None, :] < H), other=0.0)
        if W_DESC:
            b = w_src.load([col0, k * BLOCK_K]).T
        elif EVEN_K:
            b = tl.load(w_ptrs, mask=col_mask[None, :], other=0.0)
        else:
            b = tl.load(w_ptrs, mask=col_mask[None, :] & (kk[:, None] < H), other=0.0)
        acc = mma(a, b, acc, UPCAST, IEEE)
        if not X_DESC:
            x_ptrs += BLOCK_K
        if not W_DESC:
            w_ptrs += BLOCK_K
    # The bias is added once, after the whole K reduction (not per K block).
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_SOFTCAP:
        acc = softcap * tanh(acc / softcap)
    return acc
