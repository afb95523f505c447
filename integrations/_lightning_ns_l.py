"""``FusedCrossEntropyCallback`` as a ``lightning.pytorch.Callback`` (loaded on demand)."""

from lightning.pytorch import Callback

from fused_ce.integrations.lightning import FusedCrossEntropyCallback


class LightningFusedCrossEntropyCallback(FusedCrossEntropyCallback, Callback):
    """:class:`~fused_ce.integrations.lightning.FusedCrossEntropyCallback` for
    ``lightning.pytorch`` Trainers."""
