"""Inputs of one call, normalised once: contiguous tensors, fp32 per-row/per-column vectors, the
compacted list of valid rows (on the device, no host sync) and the compile-time flags."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from fused_ce.kernels import config


def compact_rows(target: Tensor, ignore_index: int) -> tuple[Tensor, Tensor, Tensor]:
    """(valid mask, row ids with the valid rows first in their original order, number of valid
    rows as a 1-element int32 device tensor). A stable sort of the "ignored" flag: deterministic
    and free of host synchronisation (kernels read the count from device memory)."""
    valid = target != ignore_index
    row_idx = torch.argsort((~valid).to(torch.int8), stable=True)
    n_valid = valid.sum(dtype=torch.int32).reshape(1)
    return valid, row_idx, n_valid


class Problem:
    def __init__(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                 ignore_index: int, softcap: Optional[float], class_weight: Optional[Tensor]):
        if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
            raise ValueError(f"fused_ce.kernels: expected x (N, H) and weight (V, H), got "
                             f"{tuple(x.shape)} and {tuple(weight.shape)}")
        if weight.dtype != x.dtype:
            weight = weight.to(x.dtype)
        self.x = x.contiguous()
        self.weight = weight.contiguous()
        self.bias = None if bias is None else bias.contiguous()
        self.target = target.contiguous()
        self.ignore_index = ignore_index
        self.softcap = None if softcap is None else float(softcap)
        self.class_weight = (None if class_weight is None
                             else class_weight.to(torch.float32).contiguous())
        self.N, self.H = x.shape
        self.V = weight.shape[0]
        self.device = x.device
        self.valid, self.row_idx, self.n_valid = compact_rows(self.target, ignore_index)
        self.n_valid_host: Optional[int] = None  # set by the paths that read it (one sync)
        self.cfg = config.current(self.H)
        lg = self.cfg["logits"]
        self.flags = dict(
            HAS_BIAS=self.bias is not None,
            HAS_SOFTCAP=self.softcap is not None,
            UPCAST=config.interpreting(),
            IEEE=x.dtype == torch.float32,
            EVEN_K=self.H % lg["BLOCK_K"] == 0,
        )

    @property
    def bias_arg(self) -> Tensor:
        # a valid pointer is needed even when HAS_BIAS is off; the kernel never reads it
        return self.bias if self.bias is not None else self.weight

    @property
    def cw_arg(self) -> Tensor:
        return self.class_weight if self.class_weight is not None else self.weight

    @property
    def softcap_arg(self) -> float:
        return self.softcap if self.softcap is not None else 1.0

