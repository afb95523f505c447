"""Tile shapes and workspace budgets. Fixed per device kind (no autotuning): a new number of rows
never triggers a re-tune, only the grid changes. ``CONFIG`` is module state so a benchmark can
try variants; the library never changes it."""

import os

import torch

# On the H200 (Hopper: tl.dot lowers to wgmma). "logits": the fused logits+epilogue kernels
# (statistics, gradient of the logits, log-probabilities); "gemm": the dX and dW products.
GPU = {
    "logits": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    "gemm": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3),
    # grad_logits.py's program order and epilogue (the sweeps' logits gradient): GROUP_M row
    # tiles per group of output tiles (0: every row tile of one column tile in turn), SPLIT
    # column parts of the epilogue, PERSISTENT: one program per multiprocessor taking the tiles
    # in turn (its loop FLATTENed). The 128 x 128 tile does not spill (sm_90, Triton 3.6: 238
    # registers) and BERT's x (32 MiB at 16384 rows) stays in L2. (D and x through descriptors,
    # gradients._grad_logits, took low_memory at BERT's heads from 10.6 to 8.3 ms at 8k tokens,
    # 24.6 to 15.7 at 16k, 7.4 to 5.5 at MLM: H100, same call, NOTES.md #102)
    "grad_logits": dict(SPLIT=1, GROUP_M=0, PERSISTENT=False, FLATTEN=False),
    # programs per multiprocessor the statistics pass aims for (vocabulary splits fill the
    # machine when few rows are valid)
    "stats_programs_per_sm": 8,
    # row-chunk path: the per-row finish kernel (row_chunks.py), memory-bound; 8 warps measured
    # fastest at V = 30k, 128k and 256k (NOTES.md, session 3); fill_rows as logits_tiles'
    "row_finish": dict(BLOCK_V=2048, num_warps=8, fill_rows=1024),
    # targets.py: rows per program of the target scan, block counts summed per step; up to
    # ONE_PROGRAM_ROWS rows one program in ONE_BLOCK-row steps. GPU time (H100, 15 % valid,
    # tools/probe_scan.py): two launches 3.9-4.2 us at 4k-64k rows; one program (8192 rows x
    # 16 warps) 9.3 us at 4k, 20.0 at 16k, 82 at 64k. One launch is ~28 us of host time less
    # (NOTES.md #79): worth it where the step waits for the host (MLM), up to 16k rows
    "scan": dict(BLOCK=1024, PART_BLOCK=1024, ONE_PROGRAM_ROWS=16384, ONE_BLOCK=8192,
                 one_warps=16),
    # scale.py: elements per program of the backward's in-place gradient scaling
    "scale": dict(BLOCK=4096, num_warps=4),
    # total_loss.py: rows per step of the one-program sum of the row losses
    "total_loss": dict(BLOCK=4096, num_warps=8),
    # logits_tiles.py: the persistent logits GEMM with the softmax epilogue (one program per
    # SM), and the per-row finish over TILES vocabulary tiles per step; "use": the row-chunk
    # path's default logits (else cuBLAS fp32 Z + finish_rows_kernel); split: the epilogue's
    # column parts (vocabulary tiles of BN / split columns). H100, same call, epilogue vs fp32
    # Z (NOTES.md #41): BERT heads 3.48-3.59 vs 3.86-4.02 ms at 8k tokens (647 vs 447 MiB:
    # one chunk), 6.73-6.94 vs 7.09-7.20 at 16k (495 vs 723 MiB), but MLM's 2458 valid rows
    # 1.93-2.76 vs 1.77-2.34, so min_rows = 4096 valid rows for it; after #51 and #54 (the
    # epilogue's db and slimmer tiles) MLM measured 1.37-1.53 vs 1.40-1.46 ms at 359 vs 496
    # MiB (H100, same call, NOTES.md #76): from any count now. db_*: d_tiles_kernel's tile (rows,
    # vocabulary tiles, warps) for D with db's partial sums; (64, 4, 4), (32, 16, 8), (128, 16,
    # 8) and (64, 8, 4) within the spread on an H100 (NOTES.md #51). overlap: the next chunk's
    # GEMM on a second stream beside a chunk's D pass (row_chunks._GemmAhead): H100, bert16k
    # 6.22 / 6.23 -> 6.01 / 5.90 ms for one more chunk's E (503 -> 776 MiB); bert8k (one chunk)
    # unchanged; at 4 D warps no gain (NOTES.md #60).
    # fill_rows: ignored rows per program of the finish kernel's fill programs (their statistics
    # 0, instead of three torch fills of every row before the pass; NOTES.md #85).
    # stats_stages: the pipeline stages of the statistics pass (stats_pass.py: no E staged in
    # shared memory, so 4 stages fit: 197 KB on sm_90). H100, evaluation at BERT's head
    # (16384 rows), 3 -> 4 stages in four rounds over two sessions: 2.29 -> 2.21, 2.41 ->
    # 2.25, 2.47 -> 2.26, 2.44 -> 2.40 ms; Llama-3's head 1.7-3 % slower every round (25.0 ->
    # 25.6 ... 25.6 -> 26.1 ms), so wide heads keep 3 (NOTES.md #65)
    # row_ref: E against one reference logit per row where it applies (row_ref.py: no db, no
    # label smoothing), so that the D pass runs only for rows that cannot keep it. H100, same
    # call, two rounds (NOTES.md #95): Gemma-2's head 46.91 / 46.70 -> 44.83 / 44.67 ms,
    # Llama-3's 93.3 / 80.42 -> 91.0 / 80.45; H100, thirty-fifth session, same call, two rounds
    # (NOTES.md #99): Gemma-2 47.12 / 46.88 -> 44.62 / 44.92, Gemma-2 with Zipf targets 50.72 /
    # 50.57 -> 48.32 / 48.17, Llama-3 91.04 / 80.98 -> 91.16 / 79.09; a small LM's head without
    # a bias (16384 x 896 x 151936, NOTES.md #100) 26.34 -> 24.46 (torch.compile 26.60). BERT's
    # heads have a bias (db needs the D pass), so they are not affected
    # target_rows: rows per step of row_ref.dw_targets_kernel's loop over a run of equal targets;
    # row_ref_min_v: the smallest vocabulary that takes row references (row_ref.applicable)
    "logits_tiles": dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=3, flatten=True,
                         split=2, finish_tiles=16, finish_warps=8, finish_block_h=1024,
                         use=True, min_rows=0, db_rows=64, db_tiles=16, db_warps=8,
                         overlap=True, stats_stages=4, fill_rows=1024, row_ref=True,
                         target_rows=16, row_ref_min_v=8192),
}
# Wide heads (H >= 2048): a 128x256 sweep tile and 128x128 products measured faster (H200,
# Llama-3 shape: stats pass 39.8 vs 48.4 ms, forward+grads 183 vs 195 ms with W read through
# pointers; H100 with W's descriptor, NOTES.md #40: sweep 132.5-133.5 vs 137.8-138.2 ms by
# pointers, low_memory 186-196 vs 227-231 with a 128x128 tile).
GPU_WIDE = {
    **GPU,
    "logits": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3),
    "gemm": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
    # the 128 x 256 tile spilled 968 bytes a thread (sm_90, Triton 3.6), none with D through its
    # descriptor and the epilogue on column halves; at 16384 rows x 4096 one row tile after
    # another reads x's 128 MiB from HBM once per column tile, in groups of 16 row tiles the
    # programs running together share 16 row tiles and ~8 column tiles (~32 MiB) in L2. H100,
    # low_memory, same call (NOTES.md #102): Gemma-2 90.1 ms before these, 85.0 with them one
    # tile a program, 79.6 / 78.1 persistent; Llama-3 143.3, 139.7, 127.8 / 127.4
    "grad_logits": dict(SPLIT=2, GROUP_M=16, PERSISTENT=True, FLATTEN=True),
    # the epilogue logits for wide heads: H100, same call: Gemma-2's head 51.2 vs 61.7 ms,
    # Llama-3's 90.2-93.6 vs 91.8-92.3 (NOTES.md #41)
    # (no second stream: a second E is 1 GiB at Llama-3's head, and it was not measured there)
    "logits_tiles": {**GPU["logits_tiles"], "overlap": False,
                     "stats_stages": 3},
}
# Under TRITON_INTERPRET=1 (CI on CPU): small tiles, several splits, so every masking and merge
# path runs on small shapes.
INTERPRETER = {
    "logits": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16),
    "gemm": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16),
    "grad_logits": dict(SPLIT=2, GROUP_M=2, PERSISTENT=True, FLATTEN=False, programs=3),
    "stats_splits": 3,
    "row_finish": dict(BLOCK_V=32, num_warps=1, fill_rows=4),
    "scan": dict(BLOCK=16, PART_BLOCK=2, ONE_PROGRAM_ROWS=40, ONE_BLOCK=8, one_warps=1),
    "scale": dict(BLOCK=16, num_warps=1),
    "total_loss": dict(BLOCK=8, num_warps=1),
    "logits_tiles": dict(BM=16, BN=32, BK=16, num_warps=1, num_stages=1, flatten=False,
                         split=2, finish_tiles=2, finish_warps=1, finish_block_h=16, programs=3,
                         use=False, min_rows=0, db_rows=3, db_tiles=2, db_warps=1,
                         overlap=False, stats_stages=1, fill_rows=4, row_ref=False,
                         target_rows=2, row_ref_min_v=8),
}
# Bytes of the logits-gradient workspace D per sweep: default mode, memory-minimal mode. The
# latter's 12 MiB and the 4 MiB below make the 16 MiB beyond the gradients (measured:
# 9-13 MiB at its shapes); 12 rather than 8 means fewer launches at BERT's heads, where
# low_memory is launch-bound (NOTES.md #108).
D_BYTES = 64 * 2**20
D_BYTES_LOW_MEMORY = 12 * 2**20
# Memory-minimal mode computes dX in row blocks whose fp32 accumulator stays under this.
DX_ACC_BYTES_LOW_MEMORY = 4 * 2**20
# Row-chunk cuBLAS path (row_chunks.py), the default for 16-bit losses with gradients on CUDA:
# bytes of the fp32 logits chunk Z, the largest of ROW_CHUNK_BYTES, half the fp32 dW
# accumulator and (with gradients) 1 / ROW_CHUNKS_FEW of all valid rows' Z, at most
# ROW_CHUNK_BYTES_MAX (all valid rows go in one chunk when they fit in that, or in twice that
# with fewer than 2 ROW_CHUNK_SPLIT_MIN_ROWS rows; row_chunks.row_chunk_budget). ROW_CHUNKS =
# False forces the all-Triton vocabulary sweep; ROW_CHUNKS_ON_CPU runs the path under the
# interpreter (tests).
ROW_CHUNK_BYTES = 256 * 2**20
ROW_CHUNK_BYTES_MAX = 2**30
ROW_CHUNKS_FEW = 4
# Rows that fit in twice the budget but not in it go in two chunks where each keeps at least
# ROW_CHUNK_SPLIT_MIN_ROWS rows (else in one: below ~2k rows cuBLAS loses speed, and a second
# chunk costs a dozen launches of host time, which sets the pace at MLM's 2458 valid rows), and
# the second stream's GEMM ahead (logits_tiles "overlap") runs only from OVERLAP_MIN_CHUNKS
# chunks (with two, its second buffer would take back what the split saved). H100, same call,
# two rounds (NOTES.md #84): bert8k 2.98 -> 3.06-3.07 ms at 662 -> 465 MiB (2 chunks of 4096
# rows instead of one of 8192; torch.compile 3.98 ms / 549 MiB); bert16k and MLM unchanged.
# bert16k without the overlap: 5.90-5.96 -> 6.09-6.10 ms at 775 -> 502 MiB, less than 15 %
# ahead of torch.compile: kept.
ROW_CHUNK_SPLIT_MIN_ROWS = 2048
OVERLAP_MIN_CHUNKS = 3
ROW_CHUNKS = True
ROW_CHUNKS_ON_CPU = False
# The row-chunk path's logits by a Triton GEMM whose epilogue does the softmax's first pass
# (logits_tiles.py) where it applies (bf16, not a softcap with label smoothing) instead of
# cuBLAS + finish_rows_kernel:
# None takes the tile configuration's "use" and "min_rows", True / False force either (the bench
# methods fused_ce_epilogue / fused_ce_fp32z, tests).
LOGITS_EPILOGUE = None
# log_softmax's logits by that Triton GEMM too (logits_tiles.py, LOG_PROBS: U = z - m_t stored,
# 6 bytes per logit instead of the fp32 path's 10): None for bf16 CUDA inputs whose rows TMA
# descriptors can address, True also under the interpreter (tests, fp32), False never (the
# cuBLAS fp32 path; bench method fused_ce_fp32z).
LOG_PROBS_EPILOGUE = None
# The statistics pass (no gradients: torch.no_grad; the lse the vocabulary sweeps start from)
# by the epilogue GEMM without E (stats_pass.py) instead of row_stats.py: None for 16-bit CUDA
# inputs whose rows TMA descriptors can address, True also under the
# interpreter (tests, fp32), False never. STATS_TILE_BYTES bounds its per-(row, tile)
# statistics: the rows per chunk.
STATS_EPILOGUE = None
STATS_TILE_BYTES = 64 * 2**20
# The sweeps' dX/dW products by cuBLAS for bf16/fp32 (gradients.library_products); the ON_CPU
# switch runs that branch under the interpreter (tests).
LIBRARY_PRODUCTS = True
LIBRARY_PRODUCTS_ON_CPU = False
# low_memory's gradients in one sweep where every row is valid (gradients._low_memory_one_sweep:
# dX's fp32 accumulator in dW's buffer), instead of dX's row blocks and then the dW sweep.
# H100, same call, two rounds (NOTES.md #103; bench methods fused_ce_lowmem_one_sweep and
# fused_ce_lowmem_blocks): Gemma-2's head 79.6 / 78.1 -> 65.1 / 66.0 ms, Llama-3's 127.8 /
# 127.4 -> 120.0 / 118.5, the same memory and errors
LOW_MEMORY_ONE_SWEEP = True
# The sweeps' logits kernels (logits.py) read a 16-bit W through a TMA tensor descriptor where
# its rows are 16-byte aligned (else, and for fp32, through a pointer per element).
W_DESCRIPTOR = True
# Test hook: force small workspaces so that CI exercises multi-chunk sweeps on small shapes.
CHUNK_OVERRIDE = None  # e.g. {"vc": 64, "row_block": 16, "row_vc": 48}

CONFIG = {"gpu": GPU, "gpu_wide": GPU_WIDE, "interpreter": INTERPRETER}
WIDE_H = 2048


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def current(hidden: int = 0) -> dict:
    """Tile configuration: depends on the hidden size only (never on the number of rows)."""
    if interpreting():
        return CONFIG["interpreter"]
    return CONFIG["gpu_wide"] if hidden >= WIDE_H else CONFIG["gpu"]


_PROPERTIES = {}


def _properties(device: torch.device):
    """The CUDA device's properties, asked once per device (torch asks the driver on every
    ``get_device_capability``: ~20 us of host time, twice per loss call, NOTES.md #72)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _PROPERTIES:
        _PROPERTIES[idx] = torch.cuda.get_device_properties(idx)
    return _PROPERTIES[idx]


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return _properties(device).multi_processor_count


def capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA device."""
    props = _properties(device)
    return props.major, props.minor
