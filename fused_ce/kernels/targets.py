"""One scan of the targets: the valid rows compacted in order, their count and the count of
out-of-range targets, in one or two launches and no host synchronization.

A row is valid when its target is not ``ignore_index``; a valid target outside ``[0, V)`` is
out of range (an error, or a column of another shard in the vocab-parallel path). The order of
``row_idx`` is a stable partition: the valid rows first, then the ignored ones, each in their
original order. Block b's rows go to::

    valid row:    (valid rows in blocks < b) + (valid rows before it in block b)
    ignored row:  n_valid + (ignored rows in blocks < b) + (ignored rows before it in block b)

so ``count_kernel`` writes per-block counts and ``place_kernel`` sums the earlier blocks' counts
(a loop over the block counts: O(N / BLOCK) per program) and the exclusive cumulative sums
within its block. Up to the configuration's ``ONE_PROGRAM_ROWS`` rows one program does both in
turn instead (``scan_kernel``: one launch, ~28 us of host time less for ~16 us more GPU time
at 16k rows, NOTES.md #79).
Deterministic: no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

@triton.jit
def _flags(target_ptr, offs, N, V, ignore_index):
    in_range = offs < N
    t = tl.load(target_ptr + offs, mask=in_range, other=0)
    valid = in_range & (t != ignore_index)
    bad = valid & ((t < 0) | (t >= V))
    return in_range, valid, bad


@triton.jit
def _block_counts(target_ptr, offs, N, V, ignore_index):
    """(valid rows, out-of-range targets) among the rows ``offs``."""
    _, valid, bad = _flags(target_ptr, offs, N, V, ignore_index)
    return tl.sum(valid.to(tl.int32), 0), tl.sum(bad.to(tl.int32), 0)


@triton.jit
def _place_block(target_ptr, row_idx_ptr, offs, start, before, total, N, V, ignore_index):
    """Writes the positions of the block of rows ``offs`` (from ``start``) in row_idx (module
    doc), given the valid rows in the blocks before it and in all; returns its valid rows."""
    in_range, valid, _ = _flags(target_ptr, offs, N, V, ignore_index)
    v = valid.to(tl.int32)
    ign = (in_range & ~valid).to(tl.int32)
    pos_valid = before + tl.cumsum(v, 0) - v
    pos_ignored = total + (start - before) + tl.cumsum(ign, 0) - ign
    pos = tl.where(valid, pos_valid.to(tl.int64), pos_ignored.to(tl.int64))
    tl.store(row_idx_ptr + pos, offs.to(tl.int64), mask=in_range)
    return tl.sum(v, 0)


@triton.jit
def count_kernel(target_ptr, part_ptr, N, V, ignore_index, n_blocks, BLOCK: tl.constexpr):
    """part[b] = valid rows of block b, part[n_blocks + b] = its out-of-range targets."""
    b = tl.program_id(0)
    offs = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    n_valid, n_bad = _block_counts(target_ptr, offs, N, V, ignore_index)
    tl.store(part_ptr + b, n_valid)
    tl.store(part_ptr + n_blocks + b, n_bad)


@triton.jit
def place_kernel(target_ptr, part_ptr, row_idx_ptr, counts_ptr, N, V, ignore_index, n_blocks,
                 BLOCK: tl.constexpr, PART_BLOCK: tl.constexpr):
    """row_idx (module doc); program 0 also writes counts = [n_valid, n_out_of_range]."""
    b = tl.program_id(0)
    before = 0  # valid rows in blocks < b
    total = 0
    bad = 0
    for q0 in range(0, n_blocks, PART_BLOCK):
        q = q0 + tl.arange(0, PART_BLOCK)
        c = tl.load(part_ptr + q, mask=q < n_blocks, other=0)
        before += tl.sum(tl.where(q < b, c, 0), 0)
        total += tl.sum(c, 0)
        bad += tl.sum(tl.load(part_ptr + n_blocks + q, mask=q < n_blocks, other=0), 0)
    start = b.to(tl.int64) * BLOCK
    _place_block(target_ptr, row_idx_ptr, start + tl.arange(0, BLOCK), start, before, total, N,
                 V, ignore_index)
    if b == 0:
        tl.store(counts_ptr, total)
        tl.store(counts_ptr + 1, bad)


@triton.jit
def scan_kernel(target_ptr, row_idx_ptr, counts_ptr, N, V, ignore_index, BLOCK: tl.constexpr):
    """row_idx and counts (module doc) by one program: a pass counting the valid rows, then a
    pass placing each block's rows after the blocks before it."""
    lanes = tl.arange(0, BLOCK)
    total = 0
    bad = 0
    for b0 in range(0, N, BLOCK):
        n_valid, n_bad = _block_counts(target_ptr, b0 + lanes, N, V, ignore_index)
        total += n_valid
        bad += n_bad
    before = 0  # valid rows in the blocks before
    for b0 in range(0, N, BLOCK):
        before += _place_block(target_ptr, row_idx_ptr, b0 + lanes, b0, before, total, N, V,
                               ignore_index)
    tl.store(counts_ptr, total)
    tl.store(counts_ptr + 1, bad)


def scan_targets(target: torch.Tensor, ignore_index: int, vocab: int, cfg: dict):
    """(row_idx int64 (N,), counts int32 (2,) = [n_valid, n_out_of_range]) of a contiguous
    target vector (module doc); ``cfg``: config's "scan" entry (rows per program, block counts
    summed per step)."""
    n = target.shape[0]
    row_idx = torch.empty(n, dtype=torch.int64, device=target.device)
    counts = torch.empty(2, dtype=torch.int32, device=target.device)
    if n == 0:
        return row_idx, counts.zero_()
    if n <= cfg["ONE_PROGRAM_ROWS"]:
        scan_kernel[(1,)](target, row_idx, counts, n, vocab, ignore_index,
                          BLOCK=cfg["ONE_BLOCK"], num_warps=cfg["one_warps"])
        return row_idx, counts
    block, part_block = cfg["BLOCK"], cfg["PART_BLOCK"]
    n_blocks = triton.cdiv(n, block)
    part = torch.empty(2 * n_blocks, dtype=torch.int32, device=target.device)
    count_kernel[(n_blocks,)](target, part, n, vocab, ignore_index, n_blocks, BLOCK=block,
                              num_warps=4)
    place_kernel[(n_blocks,)](target, part, row_idx, counts, n, vocab, ignore_index, n_blocks,
                              BLOCK=block, PART_BLOCK=part_block, num_warps=4)
    return row_idx, counts
