"""fused_ce: the loss of a model's output projection (linear + bias + log-softmax + NLL) as one
fused, chunked op that never holds the full ``tokens x vocab`` logits.

Importing ``fused_ce`` imports neither transformers nor lightning: the integrations below are
loaded on first use.
"""

from fused_ce.api import (LinearCrossEntropyStats, PreparedTargets, linear_cross_entropy,
                          linear_log_softmax, prepare_targets)
from fused_ce.modules import FusedCrossEntropy, FusedLinearLogSoftmax

__version__ = "0.1.0"

# name -> module (under fused_ce.integrations) that defines it; resolved lazily.
_LAZY = {
    "patch_hf_model": "hf",
    "unpatch_hf_model": "hf",
    "is_patched": "hf",
    "FusedCrossEntropyCallback": "lightning",
}

__all__ = ["linear_cross_entropy", "linear_log_softmax", "FusedCrossEntropy",
           "FusedLinearLogSoftmax", "LinearCrossEntropyStats", "prepare_targets",
           "PreparedTargets", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module = importlib.import_module(f"fused_ce.integrations.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'fused_ce' has no attribute {name!r}")
