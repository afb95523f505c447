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
                              row_chunks, row_ref, row_stats)

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                         "cuobjdump")
# pointers to the inputs' dtype (x, W, the bias) and to D / E (the input dtype, or fp32 under
# the interpreter); integer pointers; the rest point to fp32 and the scalars are int32 unless
# named here
DATA_PTRS = {"x_ptr", "w_ptr", "w_src", "bias_ptr", "d_ptr", "e_ptr", "u_ptr", "out_ptr",
             "xs_ptr"}
INT_PTRS = {"target_ptr": "*i64", "row_idx_ptr": "*i32", "n_valid_ptr": "*i32", "count_ptr": "*i32",
            "a_ptr": "*i32", "am_ptr": "*i32", "key_ptr": "*i32", "keys_ptr": "*i32",
            "order_ptr": "*i64"}
FP32_SCALARS = {"softcap"}


def compile_sm90(fn, constexprs: dict, types: dict, num_warps: int, num_stages: int,
                 dtype: str = "bf16"):
    """``fn`` compiled for sm_90; ``types``: arguments' types where the defaults above do not
    apply (tensor descriptors); ``dtype``: the element type of DATA_PTRS. Pointers 16-byte
    aligned (as torch allocates them)."""
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in types:
            signature[name] = types[name]
        elif name in DATA_PTRS:
            signature[name] = f"*{dtype}"
        elif name.endswith("_ptr"):
            signature[name] = INT_PTRS.get(name, "*fp32")
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


def logits_tiles_cases(variants: bool):
    """The row-chunk path's epilogue GEMM and its finish (bf16 only)."""
    for name in ("gpu", "gpu_wide"):
        cfg = config.CONFIG[name]["logits_tiles"]
        for split in sorted({1, cfg["split"]}):
            for ws, bias, cw, cap in ([(False, True, False, False), (True, True, False, False),
                                       (False, False, False, True)]
                                      + [(True, False, True, False)] * variants):
                bs = cfg["BN"] // split
                desc = {"x_desc": f"tensordesc<bf16[{cfg['BM']}, {cfg['BK']}]>",
                        "w_desc": f"tensordesc<bf16[{cfg['BN']}, {cfg['BK']}]>",
                        "e_desc": f"tensordesc<bf16[{cfg['BM']}, {bs}]>"}
                consts = dict(E_DTYPE=tl.bfloat16, HAS_BIAS=bias, HAS_CW=cw, WITH_WS=ws,
                              UPCAST=False, BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"],
                              SPLIT=split, FLATTEN=cfg["flatten"], LOG_PROBS=False,
                              STATS_ONLY=False, HAS_SOFTCAP=cap)
                yield (f"logits_tiles_kernel {name} split {split} ws {int(ws)}"
                       + " cw 1 no bias" * cw + " softcap, no bias" * cap,
                       logits_tiles.logits_tiles_kernel, consts, desc,
                       cfg["num_warps"], cfg["num_stages"], "bf16")
            # log_softmax's mode (U = z - m_t, m_t and s_t only)
            yield (f"logits_tiles_kernel {name} split {split} log-probs",
                   logits_tiles.logits_tiles_kernel,
                   {**consts, "HAS_CW": False, "WITH_WS": False, "HAS_BIAS": True,
                    "LOG_PROBS": True, "HAS_SOFTCAP": False}, desc, cfg["num_warps"],
                   cfg["num_stages"], "bf16")
            # the statistics pass (stats_pass.py: no E), bf16 and fp16
            for dt, cap in (("bf16", False), ("fp16", False), ("bf16", True)):
                yield (f"logits_tiles_kernel {name} split {split} stats only {dt}"
                       + " softcap" * cap, logits_tiles.logits_tiles_kernel,
                       {**consts, "HAS_CW": False, "WITH_WS": False, "HAS_BIAS": True,
                        "STATS_ONLY": True, "HAS_SOFTCAP": cap, "e_desc": None},
                       {k: v.replace("bf16", dt) for k, v in desc.items() if k != "e_desc"},
                       cfg["num_warps"], cfg["stats_stages"], dt)
        bs = logits_tiles.tile_width(cfg)
        for ws, cw, need_d, cap, ref in ([(False, False, True, False, False),
                                          (False, False, True, True, False),
                                          (False, False, True, False, True)]
                                         + [(True, True, False, True, False),
                                            (False, True, True, True, True)] * variants):
            consts = dict(HAS_BIAS=not need_d, HAS_CW=cw, WITH_WS=ws, WITH_LOSS=need_d,
                          NEED_D=need_d, HAS_SOFTCAP=cap,
                          BLOCK_T=256, BLOCK_H=cfg["finish_block_h"], TILES=cfg["finish_tiles"],
                          BN=bs, FILL=cfg["fill_rows"], ROW_REF=ref)
            yield (f"finish_tiles_kernel {name}" + " softcap" * (cap and need_d)
                   + " ws cw softcap, no D" * (cw and not need_d) + " cw" * (cw and need_d)
                   + " row refs" * ref, logits_tiles.finish_tiles_kernel, consts, {},
                   cfg["finish_warps"], 1, "bf16")
        # the row references (row_ref.py): E against them in the epilogue, and their kernels
        for split in sorted({1, cfg["split"]}):
            for cap in (False, True):
                bs_e = cfg["BN"] // split
                desc = {"x_desc": f"tensordesc<bf16[{cfg['BM']}, {cfg['BK']}]>",
                        "w_desc": f"tensordesc<bf16[{cfg['BN']}, {cfg['BK']}]>",
                        "e_desc": f"tensordesc<bf16[{cfg['BM']}, {bs_e}]>"}
                yield (f"logits_tiles_kernel {name} split {split} row refs" + " softcap" * cap,
                       logits_tiles.logits_tiles_kernel,
                       dict(E_DTYPE=tl.bfloat16, HAS_BIAS=False, HAS_CW=False, WITH_WS=False,
                            UPCAST=False, BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], SPLIT=split,
                            FLATTEN=cfg["flatten"], LOG_PROBS=False, STATS_ONLY=False,
                            HAS_SOFTCAP=cap, ROW_REF=True),
                       desc, cfg["num_warps"], cfg["num_stages"], "bf16")
        for bias in (False, True):
            yield (f"target_refs_kernel {name}" + " bias softcap" * bias,
                   row_ref.target_refs_kernel,
                   dict(HAS_BIAS=bias, HAS_SOFTCAP=bias, BLOCK_H=cfg["finish_block_h"]), {},
                   cfg["finish_warps"], 1, "bf16")
        yield (f"dx_rows_kernel {name}", row_ref.dx_rows_kernel,
               dict(BLOCK_H=cfg["finish_block_h"]), {}, 4, 1, "bf16")
        yield (f"dw_targets_kernel {name}", row_ref.dw_targets_kernel,
               dict(BLOCK_H=cfg["finish_block_h"], RB=cfg["target_rows"]), {},
               cfg["finish_warps"], 1, "bf16")
        for cw, cap in [(False, False), (False, True)] + [(True, False)] * variants:
            yield (f"d_tiles_kernel {name}" + " cw" * cw + " softcap" * cap,
                   logits_tiles.d_tiles_kernel,
                   dict(HAS_CW=cw, ROWS=cfg["db_rows"], TILES=cfg["db_tiles"], BN=bs,
                        HAS_SOFTCAP=cap), {}, cfg["db_warps"], 1, "bf16")
        yield (f"log_probs_tiles_kernel {name}", logits_tiles.log_probs_tiles_kernel,
               dict(BLOCK_T=256, TILES=cfg["finish_tiles"], BN=bs), {}, cfg["finish_warps"], 1,
               "bf16")


def finish_rows_cases(variants: bool):
    """The row-chunk path's finish kernel after cuBLAS's fp32 logits (BERT-class heads)."""
    fin = config.CONFIG["gpu"]["row_finish"]
    for cw, cap, dtype in ([(False, False, "bf16"), (True, False, "bf16")]
                           + [(True, True, "fp16")] * variants):
        consts = dict(HAS_BIAS=True, HAS_SOFTCAP=cap, HAS_CW=cw, WITH_WS=True, NEED_D=True,
                      LSE_IN=False, HAS_SCALE=dtype == "fp16", D_OVER_Z=True,
                      BLOCK_V=fin["BLOCK_V"], FILL=fin["fill_rows"])
        yield (f"finish_rows_kernel gpu class weights {int(cw)}" + f" softcap {dtype}" * cap,
               row_chunks.finish_rows_kernel, consts, {}, fin["num_warps"], 1, dtype)


def sweep_cases(variants: bool):
    """The vocabulary sweeps' fused logits kernels (inference, CUDA-graph capture, low_memory),
    W read through its descriptor and (for comparison) through pointers; with ``variants``
    also fp16 and fp32 (pointers: kernels.problem), softcap, class weights, H % BLOCK_K != 0."""
    combos = [("bf16", True, False, True), ("bf16", False, False, True)]
    if variants:
        combos += [("fp16", True, True, False), ("fp32", False, True, False),
                   ("fp32", False, False, True)]
    for name in ("gpu", "gpu_wide"):
        lg = config.CONFIG[name]["logits"]
        for dtype, w_desc, flags, even_k in combos:
            w = ({"w_src": f"tensordesc<{dtype}[{lg['BLOCK_N']}, {lg['BLOCK_K']}]>"} if w_desc
                 else {})
            tiles = dict(HAS_BIAS=True, HAS_SOFTCAP=flags, HAS_CW=flags, UPCAST=False,
                         IEEE=dtype == "fp32", EVEN_K=even_k, W_DESC=w_desc,
                         BLOCK_M=lg["BLOCK_M"], BLOCK_N=lg["BLOCK_N"], BLOCK_K=lg["BLOCK_K"])
            how = f"{dtype} W {'desc' if w_desc else 'ptrs'}" + " softcap cw H%BK" * flags
            yield (f"row_stats_kernel {name} {how}", row_stats.row_stats_kernel,
                   {**tiles, "WITH_WS": flags}, w, lg["num_warps"], lg["num_stages"], dtype)
            # grad_logits: x and D through descriptors (every row valid, or gathered: D in
            # compacted order), or through pointers (D by the tokens' rows); the configured
            # epilogue split, and split 1 beside it
            for descs in (True, False):
                opts = grad_logits.grad_logits_options(config.CONFIG[name]["grad_logits"],
                                                       fp32=dtype == "fp32", d_desc=descs,
                                                       w_desc=w_desc)
                x_desc = descs and dtype != "fp32"  # (as gradients._grad_logits launches it)
                for split in sorted({opts["SPLIT"], 1}, reverse=True):
                    types = dict(w)
                    if x_desc:
                        types["x_ptr"] = (f"tensordesc<{dtype}[{lg['BLOCK_M']}, "
                                          f"{lg['BLOCK_K']}]>")
                    if descs:
                        types["d_ptr"] = (f"tensordesc<{dtype}[{lg['BLOCK_M']}, "
                                          f"{lg['BLOCK_N'] // split}]>")
                    yield (f"grad_logits_kernel {name} {how} split {split}"
                           + (" x,D desc" if descs else " x,D ptrs"),
                           grad_logits.grad_logits_kernel,
                           {**tiles, "STORE_D": True, "D_BY_ROW": not descs, "NEED_DB": True,
                            **opts, "SPLIT": split, "X_DESC": x_desc, "D_DESC": descs}, types,
                           lg["num_warps"], lg["num_stages"], dtype)
            consts = {k: v for k, v in tiles.items() if k not in ("HAS_SOFTCAP", "HAS_CW")}
            yield (f"log_probs_kernel {name} {how}", log_probs.log_probs_kernel, consts, w,
                   lg["num_warps"], lg["num_stages"], dtype)


def cases(variants: bool = False):
    """(label, kernel, constexprs, types, warps, stages, dtype) of the kernels whose tiles
    fill the registers, in the GPU configurations; ``variants``: also the other flag and dtype
    combinations the library launches (tests/test_compile_sm90.py compiles them all)."""
    return [*logits_tiles_cases(variants), *finish_rows_cases(variants), *sweep_cases(variants)]


def main():
    print(f"triton {triton.__version__}, sm_90")
    for label, fn, consts, types, warps, stages, dtype in cases("--variants" in sys.argv):
        try:
            kernel = compile_sm90(fn, consts, types, warps, stages, dtype)
            print(f"{label:56s} {usage(kernel)}", flush=True)
        except Exception as err:  # noqa: BLE001 (a configuration that does not compile)
            print(f"{label:56s} failed: {type(err).__name__}: {str(err)[:120]}", flush=True)


if __name__ == "__main__":
    main()
