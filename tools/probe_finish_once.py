"""A one-read finish for the row-chunk path, timed alone (H200, ninth session; NOTES.md #33):
Z read once, dz left factored as ``dz_i = s_i E_i + dt_i e_{t_i}`` with E = exp(z - c) written
in the same pass (c: the row's first-block max, raised by powers of two when a later block
exceeds it by more than 64, E rescaled exactly), s_i = alpha_i exp(c - lse_i) and the target
entry dt_i kept in fp32. Not library code: the version built into the library (these kernels'
``block_max`` mode, with the products' row scaling and a sorted per-class sum of the target
entries) ran slower there than the two-pass finish, and was taken out; the variants say why.

    python tools/probe_finish_once.py

* ``block_max``: that version (the lane-wise online fold of finish_rows_kernel, plus a
  cross-warp block max per block for the shift's rescale).
* ``prefetch``: the same, with the next block's loads issued before this block's reduction.
* ``lanewise``: no block max: c from the first block only, each lane flags z - c > HEADROOM
  (E clamped there; a flagged row would need a repair, not written here), a barrier before
  each store (E over Z), or ``lanewise_nobar`` without it (E in its own buffer only).
* ``lean``: one exp per logit: the lse from S = sum_j exp(z_j - c) (E's own sum, target
  excluded) instead of the lane-wise online fold (two more exps per logit), prefetch and the
  block max kept; ``lean_nomax`` without the block max (a ceiling, not a correct kernel).
"""
import os
import sys

import torch
import triton
import triton.language as tl
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fused_ce.kernels import row_chunks  # noqa: E402
from fused_ce.kernels.row_chunks import _fold_block, _fold_init, finished_logits  # noqa: E402
from fused_ce.kernels.row_loss import store_row_stats  # noqa: E402


@triton.jit
def _tail(m, s, arg, ws, zt_lanes, c, row, tgt, V, c_tgt_ptr, c_smooth_ptr, c_prob_ptr,
          c_lse_sq_ptr, lse_ptr, zt_ptr, ws_ptr, max_ptr, am_ptr, nll_ptr, loss_ptr, s_ptr,
          dt_ptr, r):
    zt = tl.sum(zt_lanes, 0)
    lse = store_row_stats(m, s, arg, ws, row, tgt, zt, V, c_tgt_ptr, c_smooth_ptr, c_prob_ptr,
                          c_lse_sq_ptr, lse_ptr, zt_ptr, ws_ptr, max_ptr, am_ptr, nll_ptr,
                          loss_ptr, False, True)
    alpha = tl.load(c_prob_ptr + row) + 2.0 * tl.load(c_lse_sq_ptr + row) * lse
    tl.store(s_ptr + r, alpha * tl.exp(c - lse))
    tl.store(dt_ptr + r, alpha * tl.exp(zt - lse) - tl.load(c_tgt_ptr + row))


@triton.jit
def _raise_shift(e_row, v0, bm, c, acc, lanes, VPAD, BLOCK_V: tl.constexpr):
    """When block max bm exceeds the shift c by more than 64: c raised by k ln 2 >= bm - c, and
    E written so far (columns [0, v0)) and the running sum ``acc`` scaled by 2^-k (exact)."""
    if (bm - c > 64.0) & (bm < float("inf")):
        k = tl.ceil((bm - c) * 1.4426950408889634)
        f = tl.exp2(-k)
        tl.debug_barrier()  # the earlier blocks' stores of every warp
        for u0 in range(0, v0, BLOCK_V):
            u = u0 + lanes
            prev = tl.load(e_row + u, mask=u < VPAD, other=0.0).to(tl.float32)
            tl.store(e_row + u, (prev * f).to(e_row.dtype.element_ty), mask=u < VPAD)
        acc *= f
        c += k * 0.6931471805599453
    return c, acc


@triton.jit
def _row_start(z_ptr, ldz, e_ptr, lde, bias_ptr, target_ptr, row_idx_ptr, V, VPAD,
               BLOCK_V: tl.constexpr):
    """This program's row of Z and of E, its row index and target, the first block of its
    logits and the shift c (the first block's max; 0 where that is not finite)."""
    r = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK_V)
    row = tl.load(row_idx_ptr + r)
    z_row = z_ptr + r * ldz
    z0 = finished_logits(z_row, lanes, lanes < VPAD, bias_ptr, 1.0, True, False)
    c = tl.max(tl.where(lanes < V, z0, float("-inf")), 0)
    c = tl.where(tl.abs(c) < float("inf"), c, 0.0)
    return r, lanes, e_ptr + r * lde, row, tl.load(target_ptr + row), z_row, z0, c


@triton.jit
def once_kernel(z_ptr, ldz, e_ptr, lde, bias_ptr, target_ptr, row_idx_ptr, c_tgt_ptr,
                c_smooth_ptr, c_prob_ptr, c_lse_sq_ptr, lse_ptr, zt_ptr, ws_ptr, max_ptr, am_ptr,
                nll_ptr, loss_ptr, s_ptr, dt_ptr, flag_ptr, V, VPAD, MODE: tl.constexpr,
                BLOCK_V: tl.constexpr):
    r, lanes, e_row, row, tgt, z_row, z_next, c = _row_start(
        z_ptr, ldz, e_ptr, lde, bias_ptr, target_ptr, row_idx_ptr, V, VPAD, BLOCK_V)
    m, s, arg, ws = _fold_init(BLOCK_V)
    zt_lanes = tl.zeros((BLOCK_V,), tl.float32)
    flag = tl.zeros((BLOCK_V,), tl.int32)
    for v0 in range(0, VPAD, BLOCK_V):
        cols = v0 + lanes
        if MODE == 1:  # prefetch
            z = z_next
            nxt = cols + BLOCK_V
            z_next = finished_logits(z_row, nxt, nxt < VPAD, bias_ptr, 1.0, True, False)
        else:
            z = finished_logits(z_row, cols, cols < VPAD, bias_ptr, 1.0, True, False)
        m, s, arg, ws = _fold_block(z, cols, V, m, s, arg, ws, bias_ptr, False, False)
        zt_lanes += tl.where((cols == tgt) & (cols < V), z, 0.0)
        if MODE <= 1:
            bm = tl.max(tl.where(cols < V, z, float("-inf")), 0)
            c, _ = _raise_shift(e_row, v0, bm, c, c, lanes, VPAD, BLOCK_V)  # (no sum to scale)
            e = tl.exp(z - c)
        else:
            d = z - c
            flag |= (d > 64.0).to(tl.int32)
            e = tl.exp(tl.minimum(d, 80.0))
            if MODE == 2:
                tl.debug_barrier()
        e = tl.where((cols < V) & (cols != tgt), e, 0.0)
        tl.store(e_row + cols, e.to(e_ptr.dtype.element_ty), mask=cols < VPAD)
    tl.store(flag_ptr + r, tl.max(flag, 0))
    _tail(m, s, arg, ws, zt_lanes, c, row, tgt, V, c_tgt_ptr, c_smooth_ptr, c_prob_ptr,
          c_lse_sq_ptr, lse_ptr, zt_ptr, ws_ptr, max_ptr, am_ptr, nll_ptr, loss_ptr, s_ptr,
          dt_ptr, r)


@triton.jit
def _log1p(y):
    """log(1 + y) to fp32 precision for small y (Kahan: log(u) * y / (u - 1), u = 1 + y)."""
    u = 1.0 + y
    return tl.where(u == 1.0, y, tl.log(u) * (y / (u - 1.0)))


@triton.jit
def lean_kernel(z_ptr, ldz, e_ptr, lde, bias_ptr, target_ptr, row_idx_ptr, c_tgt_ptr,
                c_smooth_ptr, c_prob_ptr, c_lse_sq_ptr, lse_ptr, zt_ptr, ws_ptr, max_ptr, am_ptr,
                nll_ptr, loss_ptr, s_ptr, dt_ptr, flag_ptr, V, VPAD, BLOCK_MAX: tl.constexpr,
                BLOCK_V: tl.constexpr):
    r, lanes, e_row, row, tgt, z_row, z_next, c = _row_start(
        z_ptr, ldz, e_ptr, lde, bias_ptr, target_ptr, row_idx_ptr, V, VPAD, BLOCK_V)
    has_t = (tgt >= 0) & (tgt < V)
    zt = tl.where(has_t, finished_logits(z_row, tl.where(has_t, tgt, 0), True, bias_ptr, 1.0,
                                         True, False), 0.0)
    m = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    arg = tl.zeros((BLOCK_V,), tl.int32)
    acc = tl.zeros((BLOCK_V,), tl.float32)
    for v0 in range(0, VPAD, BLOCK_V):
        cols = v0 + lanes
        z = z_next
        nxt = cols + BLOCK_V
        z_next = finished_logits(z_row, nxt, nxt < VPAD, bias_ptr, 1.0, True, False)
        zm = tl.where(cols < V, z, float("-inf"))
        better = (zm > m) | (zm != zm)
        arg = tl.where(better, cols, arg)
        m = tl.where(better, zm, m)
        if BLOCK_MAX:
            c, acc = _raise_shift(e_row, v0, tl.max(zm, 0), c, acc, lanes, VPAD, BLOCK_V)
        e = tl.where((cols < V) & (cols != tgt), tl.exp(zm - c), 0.0)
        acc += e
        tl.store(e_row + cols, e.to(e_ptr.dtype.element_ty), mask=cols < VPAD)
    mx = tl.max(m, 0)
    am = tl.min(tl.where(m == mx, arg, 2147483647), 0)
    s_nt = tl.sum(acc, 0)
    d = c - zt
    nll_t = tl.where(d <= 1.0, _log1p(s_nt * tl.exp(tl.minimum(d, 1.0))),
                     d + tl.log(s_nt + tl.exp(-d)))
    lse = tl.where(has_t, zt + nll_t, c + tl.log(s_nt))
    nll = tl.where(has_t & (tl.abs(mx) < float("inf")), nll_t, lse - zt)
    tl.store(lse_ptr + row, lse)
    tl.store(nll_ptr + row, nll)
    tl.store(max_ptr + row, mx)
    tl.store(am_ptr + row, am.to(tl.int64))
    alpha = tl.load(c_prob_ptr + row) + 2.0 * tl.load(c_lse_sq_ptr + row) * lse
    tl.store(loss_ptr + row, tl.load(c_tgt_ptr + row) * nll + tl.load(c_lse_sq_ptr + row) * lse * lse)
    tl.store(s_ptr + r, alpha * tl.exp(c - lse))
    tl.store(dt_ptr + r, alpha * tl.exp(-nll) - tl.load(c_tgt_ptr + row))


def bench_ms(fn):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=30, rep=150, return_mode="median")


def check_lean(device="cuda"):
    """The lean kernel's lse, nll and dz against torch (fp64) on random rows, two of them with
    a logit far above their first block (the rescale)."""
    vv, vp, rows = 3001, 3008, 64
    g = torch.Generator(device=device).manual_seed(0)
    zz = torch.randn(rows, vp, device=device, generator=g) * 3
    zz[:2, 2500] += 150.0
    bp = torch.randn(vp, device=device, generator=g)
    tgt = torch.randint(0, vv, (rows,), device=device, generator=g)
    tgt[0] = 2500
    tgt[5] = zz[5, :vv].add(bp[:vv]).argmax()
    ee = torch.empty(rows, vp, device=device)
    idx = torch.arange(rows, device=device)
    cf = [torch.full((rows,), 0.5, device=device) for _ in range(4)]
    cf[1] = torch.zeros(rows, device=device)
    cf[3] = torch.zeros(rows, device=device)
    st = [torch.empty(rows, device=device) for _ in range(4)] + [
        torch.empty(rows, device=device, dtype=torch.long)] + [
        torch.empty(rows, device=device) for _ in range(4)]
    flag = torch.empty(rows, device=device, dtype=torch.int32)
    z64 = (zz[:, :vv] + bp[:vv]).double()
    lse64 = torch.logsumexp(z64, 1)
    nll64 = lse64 - z64.gather(1, tgt[:, None])[:, 0]
    lean_kernel[(rows,)](zz.clone(), vp, ee, vp, bp, tgt, idx, *cf, *st, flag, vv, vp,
                         BLOCK_MAX=True, BLOCK_V=1024, num_warps=4)
    lse, nll, s_i, dt = st[0], st[5], st[7], st[8]
    dz = s_i[:, None].double() * ee[:, :vv].double()
    dz[torch.arange(rows), tgt] = dt.double()
    p64 = torch.softmax(z64, 1)
    dz64 = 0.5 * p64
    dz64[torch.arange(rows), tgt] -= 0.5
    print(f"  lean check: lse {(lse - lse64).abs().max().item():.2e} nll abs "
          f"{(nll - nll64).abs().max().item():.2e} rel "
          f"{((nll - nll64).abs() / nll64.abs().clamp_min(1e-30)).max().item():.2e} dz rel "
          f"{((dz - dz64).norm() / dz64.norm()).item():.2e}", flush=True)


def main():
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    check_lean()
    for vv in (30258, 128256, 256000):
        vp = row_chunks.padded_vocab(vv)
        rows = min(2048, (256 * 2**20) // (vp * 4))
        zz = torch.randn(rows, vp, device="cuda")
        ee = torch.empty(rows, vp, device="cuda", dtype=torch.bfloat16)
        bp = torch.randn(vp, device="cuda")
        tgt = torch.randint(0, vv, (rows,), device="cuda")
        idx = torch.arange(rows, device="cuda")
        cf = [torch.full((rows,), 1.0 / rows, device="cuda") for _ in range(4)]
        st = [torch.empty(rows, device="cuda") for _ in range(4)] + [
            torch.empty(rows, device="cuda", dtype=torch.long)] + [
            torch.empty(rows, device="cuda") for _ in range(4)]  # ..., nll, loss, s, dt
        flag = torch.empty(rows, device="cuda", dtype=torch.int32)
        gb = rows * vp * 6 / 1e9
        for mode, name in ((0, "block_max"), (1, "prefetch"), (2, "lanewise"),
                           (3, "lanewise_nobar")):
            for bv, nw in ((1024, 4), (2048, 8)):
                fn = lambda: once_kernel[(rows,)](  # noqa: E731
                    zz, vp, ee, vp, bp, tgt, idx, *cf, *st, flag, vv, vp, MODE=mode,
                    BLOCK_V=bv, num_warps=nw)
                ms = bench_ms(fn)
                print(f"  V={vv:<6} rows={rows:<5} {name:<15} BLOCK_V={bv:<5} warps={nw:<2} "
                      f"{ms:7.3f} ms {gb / ms:6.2f} TB/s", flush=True)
        for bm, name in ((True, "lean"), (False, "lean_nomax")):
            for bv, nw in ((1024, 4), (2048, 8), (4096, 8), (2048, 16)):
                fn = lambda: lean_kernel[(rows,)](  # noqa: E731
                    zz, vp, ee, vp, bp, tgt, idx, *cf, *st, flag, vv, vp, BLOCK_MAX=bm,
                    BLOCK_V=bv, num_warps=nw)
                ms = bench_ms(fn)
                print(f"  V={vv:<6} rows={rows:<5} {name:<15} BLOCK_V={bv:<5} warps={nw:<2} "
                      f"{ms:7.3f} ms {gb / ms:6.2f} TB/s", flush=True)
        del zz, ee


if __name__ == "__main__":
    main()
