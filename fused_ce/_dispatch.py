"""Which backend computes a call: the Triton kernels on CUDA, the chunked PyTorch path elsewhere.

``FUSED_CE_BACKEND`` (read at each call) overrides the choice: ``torch`` forces the PyTorch path,
``triton`` forces the kernels (on the CPU they run under ``TRITON_INTERPRET=1``), ``auto`` (the
default) picks the kernels when they support the device.
"""

from __future__ import annotations

import os

from torch import Tensor

from fused_ce import reference

_CHOICES = ("auto", "torch", "triton")


def _kernels():
    try:
        from fused_ce import kernels
    except ImportError:  # no triton on this platform
        return None
    return kernels


def backend_for(x: Tensor):
    choice = os.environ.get("FUSED_CE_BACKEND", "auto")
    if choice not in _CHOICES:
        raise ValueError(f"FUSED_CE_BACKEND: expected one of {_CHOICES}, got {choice!r}")
    if choice == "torch":
        return reference
    kernels = _kernels() if (choice == "triton" or x.device.type == "cuda") else None
    if kernels is not None and kernels.supports(x):
        return kernels
    if choice == "triton":
        raise RuntimeError(f"FUSED_CE_BACKEND=triton: the Triton kernels cannot run on {x.device} "
                           f"(on a CPU set TRITON_INTERPRET=1 before importing triton)")
    return reference
