"""Registers, local-memory spills and shared memory of the library's Triton kernels compiled for
the H100/H200 (sm_90), on any machine: no GPU needed, Triton's wheel ships ptxas and cuobjdump.

    pip install --no-deps --target /tmp/t36 triton==3.6.0    # the device image's Triton
    PYTHONPATH=/tmp/t36:. python tools/sm90_registers.py

A kernel that spills keeps part of its tile in local memory (L1/L2 traffic inside the epilogue);
with a 128 x 256 fp32 accumulator (128 of a thread's 255 registers at 8 warps) one more live copy
of the tile is enough. Prints one line per kernel and configuration: REG (registers per thread),
STACK (bytes of local memory per thread: the spills), the dynamic shared memory in bytes. It also
catches code that the Triton interpreter (CI) runs but the compiler rejects (e.g. a jit function
whose returns differ in type).
"""
import os
import re
import subprocess
import sys
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fused_ce.kernels import (config, grad_logits, log_probs, logits_tiles,  # noqa: E402
                              row_chunks, row_stats)

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                         "cuobjdump")
# pointer arguments by element type; the others are int32 scalars unless named here
BF16_PTRS = {"x_ptr", "w_ptr", "bias_ptr", "cw_ptr", "d_ptr", "e_ptr"}
INT_PTRS = {"target_ptr": "*i64", "row_idx_ptr": "*i32", "n_valid_ptr": "*i32", "a_ptr": "*i32",
            "am_ptr": "*i32"}
FP32_SCALARS = {"softcap"}


def compile_sm90(fn, constexprs: dict, descriptors: dict, num_warps: int, num_stages: int):
    """``fn`` compiled for sm_90; pointers 16-byte aligned (as torch allocates them)."""
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in descriptors:
            signature[name] = descriptors[name]
        elif name.endswith("_ptr"):
            signature[name] = ("*bf16" if name in BF16_PTRS else INT_PTRS.get(name, "*fp32"))
        else:
            signature[name] = "fp32" if name in FP32_SCALARS else "i32"
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]]
             for n, t in signature.items() if t.startswith("*")}
    src = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def usage(kernel) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    reg = re.search(r"REG:(\d+)", out).group(1)
    stack = re.search(r"STACK:(\d+)", out).group(1)
    return f"REG {reg:>3}  STACK {stack:>4}  shared {kernel.metadata.shared}"


def logits_tiles_cases():
    for name in ("gpu", "gpu_wide"):
        cfg = config.CONFIG[name]["logits_tiles"]
        for split in sorted({1, cfg["split"]}):
            for ws in (False, True):
                bs = cfg["BN"] // split
                desc = {"x_desc": f"tensordesc<bf16[{cfg['BM']}, {cfg['BK']}]>",
                        "w_desc": f"tensordesc<bf16[{cfg['BN']}, {cfg['BK']}]>",
                        "e_desc": f"tensordesc<bf16[{cfg['BM']}, {bs}]>"}
                consts = dict(E_DTYPE=tl.bfloat16, HAS_BIAS=True, HAS_CW=False, WITH_WS=ws,
                              UPCAST=False, BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"],
                              SPLIT=split, FLATTEN=cfg["flatten"])
                yield (f"logits_tiles_kernel {name} split {split} ws {int(ws)}",
                       logits_tiles.logits_tiles_kernel, consts, desc, cfg["num_warps"],
                       cfg["num_stages"])
        bs = logits_tiles.tile_width(cfg)
        consts = dict(HAS_CW=False, WITH_WS=False, NEED_D=True, BLOCK_T=256,
                      TILES=cfg["finish_tiles"], BN=bs)
        yield (f"finish_tiles_kernel {name}", logits_tiles.finish_tiles_kernel, consts, {},
               cfg["finish_warps"], 1)


def finish_rows_cases():
    """The row-chunk path's finish kernel after cuBLAS's fp32 logits (BERT-class heads)."""
    fin = config.CONFIG["gpu"]["row_finish"]
    for cw in (False, True):
        consts = dict(HAS_BIAS=True, HAS_SOFTCAP=False, HAS_CW=cw, WITH_WS=True, NEED_D=True,
                      LSE_IN=False, HAS_SCALE=False, D_OVER_Z=True, BLOCK_V=fin["BLOCK_V"])
        yield (f"finish_rows_kernel gpu class weights {int(cw)}", row_chunks.finish_rows_kernel,
               consts, {}, fin["num_warps"], 1)


def sweep_cases():
    """The vocabulary sweeps' fused logits kernels (inference, CUDA-graph capture, low_memory),
    W read through its descriptor and (for comparison) through pointers."""
    for name in ("gpu", "gpu_wide"):
        lg = config.CONFIG[name]["logits"]
        for w_desc in (True, False):
            w = ({"w_src": f"tensordesc<bf16[{lg['BLOCK_N']}, {lg['BLOCK_K']}]>"} if w_desc
                 else {"w_src": "*bf16"})
            tiles = dict(HAS_BIAS=True, HAS_SOFTCAP=False, HAS_CW=False, UPCAST=False,
                         IEEE=False, EVEN_K=True, W_DESC=w_desc, BLOCK_M=lg["BLOCK_M"],
                         BLOCK_N=lg["BLOCK_N"], BLOCK_K=lg["BLOCK_K"])
            how = "W desc" if w_desc else "W ptrs"
            yield (f"row_stats_kernel {name} {how}", row_stats.row_stats_kernel,
                   {**tiles, "WITH_WS": False}, w, lg["num_warps"], lg["num_stages"])
            yield (f"grad_logits_kernel {name} {how}", grad_logits.grad_logits_kernel,
                   {**tiles, "STORE_D": True, "D_BY_ROW": False, "NEED_DB": True}, w,
                   lg["num_warps"], lg["num_stages"])
            consts = {k: v for k, v in tiles.items() if k not in ("HAS_SOFTCAP", "HAS_CW")}
            yield (f"log_probs_kernel {name} {how}", log_probs.log_probs_kernel, consts, w,
                   lg["num_warps"], lg["num_stages"])


def main():
    print(f"triton {triton.__version__}, sm_90")
    for label, fn, consts, desc, warps, stages in [*logits_tiles_cases(), *finish_rows_cases(),
                                                     *sweep_cases()]:
        try:
            print(f"{label:48s} {usage(compile_sm90(fn, consts, desc, warps, stages))}",
                  flush=True)
        except Exception as err:  # noqa: BLE001 (a configuration that does not compile)
            print(f"{label:48s} failed: {type(err).__name__}: {str(err)[:120]}", flush=True)


if __name__ == "__main__":
    main()
