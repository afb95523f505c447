"""``nn.Module`` forms of the functional API."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from fused_ce import _validation as check
from fused_ce.api import linear_cross_entropy, linear_log_softmax


class FusedCrossEntropy(nn.Module):
    """Loss module: ``forward(input, linear_weight, target, linear_bias=None)`` ==
    ``F.cross_entropy(F.linear(input, linear_weight, linear_bias), target, weight=self.weight,
    ignore_index=..., reduction=..., label_smoothing=...)`` plus ``z_loss``/``softcap`` (``input``
    (N, H); other leading shapes count as their rows), computed by
    :func:`fused_ce.linear_cross_entropy` without materializing the logits.

    ``weight`` (class weights) is registered as a buffer, like ``nn.CrossEntropyLoss``.
    """

    def __init__(self, weight: Optional[Tensor] = None, ignore_index: int = -100,
                 reduction: str = "mean", label_smoothing: float = 0.0, z_loss: float = 0.0,
                 softcap: Optional[float] = None, *, low_memory: bool = False,
                 return_stats: bool = False, process_group=None):
        super().__init__()
        if weight is not None:
            check.check_tensor("weight", weight)
            if weight.dim() != 1:
                raise ValueError(f"weight: expected class weights of shape (V,), got {tuple(weight.shape)}")
        # Options are checked here too, so a bad module fails at construction, not at step 1.
        (self.reduction, self.ignore_index, self.label_smoothing, self.z_loss,
         self.softcap) = check.check_options(reduction, ignore_index, label_smoothing, z_loss,
                                             softcap)
        self.register_buffer("weight", weight)
        self.low_memory = low_memory
        self.return_stats = return_stats
        self.process_group = process_group

    def forward(self, input: Tensor, linear_weight, target: Tensor,
                linear_bias: Optional[Tensor] = None):
        return linear_cross_entropy(
            input, linear_weight, target, linear_bias=linear_bias, weight=self.weight,
            reduction=self.reduction, ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing, z_loss=self.z_loss, softcap=self.softcap,
            low_memory=self.low_memory, return_stats=self.return_stats,
            process_group=self.process_group)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, softcap={self.softcap}")


class FusedLinearLogSoftmax(nn.Module):
    """``nn.Linear(in_features, out_features, bias)`` followed by ``nn.LogSoftmax(dim=-1)`` as
    one fused op (:func:`fused_ce.linear_log_softmax`). Parameters are initialized and named like
    ``nn.Linear``'s (``weight``, ``bias``), so its ``state_dict`` loads from a Linear layer."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device=None, dtype=None):
        super().__init__()
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        self.in_features = in_features
        self.out_features = out_features
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The same initialization as ``nn.Linear``."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, input: Tensor) -> Tensor:
        return linear_log_softmax(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
