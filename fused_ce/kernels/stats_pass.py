"""The statistics pass by the epilogue GEMM: per-row lse, target logit, weighted sum, max,
argmax and nll of ``z = x W^T + b`` without storing logits and without a host sync. It serves
the forward pass without gradients (``torch.no_grad``, eval) and the lse that the vocabulary
sweeps (gradients.py: ``low_memory``, or a step captured into a CUDA graph before any eager
call checked cuBLAS) start from, in place of row_stats.py.

Per chunk of c positions of the stable partition ``p.row_idx`` (valid rows first)::

    xc = x[row_idx[c0 : c0 + c]]       gathered rows (TMA needs them contiguous)
    logits_tiles_kernel (STATS_ONLY)   the persistent TMA GEMM; its epilogue adds the bias,
                                       applies the softcap and writes per (row, vocabulary
                                       tile) m_t = max_j z_j, s_t = sum_j exp(z_j - m_t), the
                                       first column of m_t (and sum_j w_j z_j); no E
    finish_tiles_kernel (no D)         per row: lse = M + log sum_t s_t exp(m_t - M), the
                                       target logit as the dot product x . W_t (+ b_t), nll

Both kernels read the valid count on the device and skip the positions past it, so ignored
rows cost nothing and the sizes on the host are only N's. The chunks bound the tile statistics
(12-16 bytes per row and tile: 3 KB per row at BERT's vocabulary, 12 KB at Llama-3's) by
``config.STATS_TILE_BYTES``: O(N) memory.

Against row_stats.py (per-row pointer gathers of x inside the logits kernel, 128-wide tiles,
vocabulary splits merged by torch ops afterwards) this is the row-chunk path's GEMM, whose
128 x 256 tile and TMA loads run at ~75 % of cuBLAS on an H100 (NOTES.md #54).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import triton

from fused_ce.kernels import config
from fused_ce.kernels.logits_tiles import TileStats, tile_width
from fused_ce.kernels.problem import Problem, descriptor_ok
from fused_ce.kernels.row_chunks import balanced_chunk


def applicable(p: Problem) -> bool:
    """config.STATS_EPILOGUE (None: 16-bit CUDA inputs), x and W addressable by TMA descriptors
    (problem.descriptor_ok). fp32 on a GPU keeps row_stats.py (its exact dot;
    the interpreter runs fp32 here too)."""
    wanted = config.STATS_EPILOGUE
    if wanted is None:
        wanted = p.device.type == "cuda" and not config.interpreting()
    dtypes = ((torch.bfloat16, torch.float16, torch.float32) if config.interpreting()
              else (torch.bfloat16, torch.float16))
    return (bool(wanted) and p.N > 0 and p.x.dtype in dtypes
            and p.weight.dtype == p.x.dtype and descriptor_ok(p.x) and descriptor_ok(p.weight))


def chunk_rows(p: Problem, with_ws: bool) -> int:
    """Positions per chunk: the tile statistics within config.STATS_TILE_BYTES, in as few
    chunks as that allows, balanced, a multiple of the GEMM's row tile (at most N)."""
    cfg = p.cfg["logits_tiles"]
    per_row = triton.cdiv(p.V, tile_width(cfg)) * (16 if with_ws else 12)
    bm = cfg["BM"]
    return balanced_chunk(p.N, max(bm, config.STATS_TILE_BYTES // per_row // bm * bm), bm)


def row_stats(p: Problem, with_ws: bool, cf=None):
    """(lse, target_logit, weighted_sum, max_logit, argmax, nll) per row, zeros (argmax
    ignore_index) on ignored rows: row_stats.combine's contract; with the per-row coefficients
    ``cf`` (gradients.row_coefs) also the row losses (ops.py's loss_i, 0 on ignored rows),
    written by the finish kernel: no torch ops after the pass (NOTES.md #82)."""
    n, dev = p.N, p.device
    c = chunk_rows(p, with_ws)
    f32 = dict(dtype=torch.float32, device=dev)
    # (the ignored rows' zeros and argmax ignore_index: the first finish launch's fill programs)
    lse = torch.empty(n, **f32)
    zt, ws, mx, nll, *loss = torch.empty((4 + (cf is not None), n), **f32).unbind()
    am = torch.empty((n,), dtype=torch.long, device=dev)
    # (what TileStats.finish writes; without coefficients no loss, and lse stands in for it)
    out = SimpleNamespace(lse=lse, zt=zt, ws=ws, mx=mx, am=am, nll=nll,
                          loss=loss[0] if loss else lse)
    ts = TileStats(p, c, with_ws)
    xc = torch.empty((c, p.H), dtype=p.x.dtype, device=dev)
    for c0 in range(0, n, c):
        cc = min(c, n - c0)
        torch.index_select(p.x, 0, p.row_idx[c0:c0 + cc], out=xc[:cc])
        ts.logits(p, xc[:cc], None, c0, p.bias_arg, with_ws)
        ts.finish(p, xc[:cc], None, c0, p.bias_arg, cf, out, with_ws, False,
                  fill_ignored=c0 == 0)
    return (lse, zt, ws, mx, am, nll, *loss)
