"""``FusedCrossEntropyCallback`` as a ``pytorch_lightning.Callback`` (loaded on demand)."""

from pytorch_lightning import Callback

from fused_ce.integrations.lightning import FusedCrossEntropyCallback


class PLFusedCrossEntropyCallback(FusedCrossEntropyCallback, Callback):
    """:class:`~fused_ce.integrations.lightning.FusedCrossEntropyCallback` for
    ``pytorch_lightning`` Trainers."""
