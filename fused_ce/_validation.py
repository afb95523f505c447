"""Argument checks shared by the public entry points.

Every check raises before any computation or state change, and its message names the argument,
what was expected and what came.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Optional

import torch
from torch import Tensor

REDUCTIONS = ("mean", "sum", "none")


def _describe(t) -> str:
    if not isinstance(t, Tensor):
        return type(t).__name__
    return f"Tensor(shape={tuple(t.shape)}, dtype={t.dtype}, device={t.device})"


def check_tensor(name: str, t, *, floating: bool = True) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {_describe(t)}")
    if floating and not t.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got dtype {t.dtype}")


def check_linear(input: Tensor, linear_weight: Tensor, linear_bias: Optional[Tensor]) -> None:
    """Shapes, devices and dtypes of ``F.linear(input, linear_weight, linear_bias)``."""
    check_tensor("input", input)
    check_tensor("linear_weight", linear_weight)
    if input.dim() < 1:
        raise ValueError(f"input: expected shape (..., H), got a 0-d tensor")
    if linear_weight.dim() != 2:
        raise ValueError(f"linear_weight: expected shape (V, H), got {tuple(linear_weight.shape)}")
    vocab, hidden = linear_weight.shape
    if input.shape[-1] != hidden:
        raise ValueError(
            f"input: expected last dimension H={hidden} to match linear_weight of shape "
            f"{tuple(linear_weight.shape)}, got input of shape {tuple(input.shape)}")
    if vocab == 0:
        raise ValueError("linear_weight: expected at least one output row (V >= 1), got V=0")
    tensors = {"input": input, "linear_weight": linear_weight}
    if linear_bias is not None:
        check_tensor("linear_bias", linear_bias)
        if tuple(linear_bias.shape) != (vocab,):
            raise ValueError(f"linear_bias: expected shape ({vocab},), got {tuple(linear_bias.shape)}")
        tensors["linear_bias"] = linear_bias
    check_same_device(tensors)


def check_same_device(tensors: dict) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"expected all tensors on one device, got {listing}")


def check_dtypes(tensors: dict, autocast_dtype: Optional[torch.dtype] = None) -> None:
    """Like ``F.linear``, every operand must have one dtype: outside autocast as given, under
    it after autocast's casts (``tensors`` as cast: float64 stays float64)."""
    dtypes = {name: t.dtype for name, t in tensors.items() if t is not None}
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{n} is {d}" for n, d in dtypes.items())
        where = ("(or torch.autocast)" if autocast_dtype is None else
                 f"under torch.autocast to {autocast_dtype}, which leaves float64 as it is")
        raise TypeError(f"expected input, linear_weight and linear_bias of one dtype {where}, "
                        f"got {listing}")


def check_loss_options(target: Tensor, input: Tensor, vocab: int, weight: Optional[Tensor],
                       reduction: str, ignore_index: int, label_smoothing: float, z_loss: float,
                       softcap: Optional[float]) -> tuple:
    """The loss's target, class weights and options (check_options: returned as Python
    numbers)."""
    check_tensor("target", target, floating=False)
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target: expected an int64 (or int32) tensor of class indices, got {target.dtype}")
    if tuple(target.shape) != tuple(input.shape[:-1]):
        raise ValueError(f"target: expected shape {tuple(input.shape[:-1])} (input's shape without "
                         f"its last dimension), got {tuple(target.shape)}")
    if weight is not None:
        check_tensor("weight", weight)
        if tuple(weight.shape) != (vocab,):
            raise ValueError(f"weight: expected class weights of shape ({vocab},), got {tuple(weight.shape)}")
    check_same_device({"input": input, "target": target, "weight": weight})
    return check_options(reduction, ignore_index, label_smoothing, z_loss, softcap)


def _as_int(value):
    """An integer option as F.cross_entropy takes it (a Python or NumPy int, an integer tensor
    of one element), else None; never a bool or a float."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _as_float(value):
    """A real option as F.cross_entropy takes it (a Python or NumPy number, a 0-d tensor),
    else None."""
    if isinstance(value, Tensor):
        return float(value) if value.dim() == 0 and not value.is_complex() else None
    return float(value) if isinstance(value, numbers.Real) else None


def check_options(reduction: str, ignore_index: int, label_smoothing: float, z_loss: float,
                  softcap: Optional[float]) -> tuple:
    """The non-tensor options of the loss (also checked when a loss module is built), returned
    as Python numbers: (reduction, ignore_index, label_smoothing, z_loss, softcap)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
    index = _as_int(ignore_index)
    if index is None:
        raise TypeError(f"ignore_index: expected an int, got {ignore_index!r}")
    smoothing, z, cap = (_as_float(v) for v in (label_smoothing, z_loss, softcap))
    if smoothing is None or not 0.0 <= smoothing <= 1.0:
        raise ValueError(f"label_smoothing: expected a float in [0.0, 1.0], got {label_smoothing!r}")
    if z is None or not (math.isfinite(z) and z >= 0):
        raise ValueError(f"z_loss: expected a finite float >= 0, got {z_loss!r}")
    if softcap is not None and (cap is None or not (math.isfinite(cap) and cap > 0)):
        raise ValueError(f"softcap: expected None or a finite float > 0, got {softcap!r}")
    return reduction, index, smoothing, z, cap


def _cannot_sync() -> bool:
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_target_values(target: Tensor, vocab: int, ignore_index: int) -> None:
    """Targets must be class indices in ``[0, vocab)`` or ``ignore_index``.

    This reads one bool back from the device. While a CUDA graph is being captured or
    torch.compile traces, that is impossible; then the check runs asynchronously on the device
    (``torch._assert_async``), which stops the program at the next synchronization.
    """
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if _cannot_sync():
        torch._assert_async(~bad.any(), "target: class index out of range")
        return
    if bool(bad.any()):
        pos = int(bad.flatten().nonzero()[0])
        value = int(target.flatten()[pos])
        raise ValueError(f"target: expected class indices in [0, {vocab}) or ignore_index="
                         f"{ignore_index}, got {value} at flat position {pos}")
