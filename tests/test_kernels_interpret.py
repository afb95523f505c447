"""The Triton kernels under the Triton interpreter on the CPU (CI has no GPU).

The interpreter must be switched on before triton compiles anything, and other test files of the
same pytest process may already have imported triton; so the cases
(tests/_kernels_interpret_cases.py) run in a child pytest process started with
TRITON_INTERPRET=1. Its report is shown here when it fails.
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

HERE = os.path.dirname(os.path.abspath(__file__))


def test_kernels_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "FUSED_CE_BACKEND": "triton"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         os.path.join(HERE, "_kernels_interpret_cases.py")],
        env=env, cwd=os.path.dirname(HERE), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail("interpreter cases failed:\n" + proc.stdout[-6000:] + proc.stderr[-3000:])
