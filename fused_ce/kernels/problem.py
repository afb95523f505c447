"""Inputs of one call, normalised once: contiguous tensors, fp32 per-row/per-column vectors, the
compacted list of valid rows with the valid and out-of-range counts (targets.py: on the device,
no host sync) and the compile-time flags."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from fused_ce.kernels import config
from fused_ce.kernels.targets import scan_targets


class Problem:
    def __init__(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                 ignore_index: int, softcap: Optional[float], class_weight: Optional[Tensor],
                 scan: Optional[tuple[Tensor, Tensor]] = None):
        """``scan``: (row_idx, counts) of this target, made earlier (kernels.scan_targets)."""
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
        self.cfg = config.current(self.H)
        # row ids, valid rows first in their order; counts = [n_valid, n_out_of_range] (int32,
        # on the device: kernels read n_valid from there)
        self.row_idx, self.counts = scan if scan is not None else scan_targets(
            self.target, ignore_index, self.V, self.cfg["scan"])
        self.n_valid = self.counts[:1]
        self.n_valid_host: Optional[int] = None  # set by the paths that read it (one sync)
        self._valid: Optional[Tensor] = None
        lg = self.cfg["logits"]
        self.flags = dict(
            HAS_BIAS=self.bias is not None,
            HAS_SOFTCAP=self.softcap is not None,
            UPCAST=config.interpreting(),
            IEEE=x.dtype == torch.float32,
            EVEN_K=self.H % lg["BLOCK_K"] == 0,
            # (not for fp32's exact dot: on the FMA units, with the descriptor's tile read
            # transposed from shared memory, it compiled for sm_90 to 10 KB of local memory
            # per thread)
            W_DESC=(config.W_DESCRIPTOR and x.dtype != torch.float32
                    and descriptor_ok(self.weight)),
        )
        self._w_src: Optional[object] = None

    @property
    def valid(self) -> Tensor:
        """Mask of the rows whose target is not ignore_index (made when first asked for)."""
        if self._valid is None:
            self._valid = self.target != self.ignore_index
        return self._valid

    @property
    def w_src(self):
        """W as the logits kernels (logits.py) take it: its tensor descriptor (block
        BLOCK_N x BLOCK_K of the logits tile) where ``flags["W_DESC"]``, else W."""
        if self._w_src is None:
            lg = self.cfg["logits"]
            block = [lg["BLOCK_N"], lg["BLOCK_K"]]
            self._w_src = (TensorDescriptor.from_tensor(self.weight, block)
                           if self.flags["W_DESC"] else self.weight)
        return self._w_src

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


def descriptor_ok(t: Tensor) -> bool:
    """Whether a TMA descriptor can address the contiguous 2-D ``t``: base address and row
    stride multiples of 16 bytes."""
    return t.data_ptr() % 16 == 0 and (t.shape[1] * t.element_size()) % 16 == 0
