"""The kernels whose tiles fill the registers compile for the H100/H200 (sm_90) on this machine:
Triton's wheel ships ptxas, so no GPU is needed. CI otherwise runs them only under the
interpreter, which accepts code the compiler rejects (a jit function whose returns differ in
type did, once). Every GPU configuration and the flag and dtype combinations the library
launches (tools/sm90_registers.py, which also prints their registers and spills)."""

import importlib.util
import os

import pytest

triton = pytest.importorskip("triton")

TOOL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools",
                    "sm90_registers.py")


def _tool():
    spec = importlib.util.spec_from_file_location("sm90_registers", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_kernels_compile_for_sm90():
    tool = _tool()
    seen, failed = set(), []
    for label, fn, consts, types, warps, stages, dtype in tool.cases(variants=True):
        key = (fn.fn.__name__, tuple(sorted(consts.items(), key=str)),
               tuple(sorted(types.items())), warps, stages, dtype)
        if key in seen:  # (the wide heads' sweep tile is the BERT one)
            continue
        seen.add(key)
        try:
            kernel = tool.compile_sm90(fn, consts, types, warps, stages, dtype)
        except Exception as err:  # noqa: BLE001 (reported below, all at once)
            failed.append(f"{label}: {type(err).__name__}: {str(err)[:300]}")
            continue
        assert kernel.asm["cubin"], label
    assert len(seen) >= 20
    assert not failed, "\n".join(failed)
