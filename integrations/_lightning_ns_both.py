"""``FusedCrossEntropyCallback`` as a ``Callback`` of both Lightning namespaces at once (loaded
on demand, when both are in use): either Trainer accepts it."""

from lightning.pytorch import Callback as LightningCallback
from pytorch_lightning import Callback as PLCallback

from fused_ce.integrations.lightning import FusedCrossEntropyCallback


class BothFusedCrossEntropyCallback(FusedCrossEntropyCallback, LightningCallback, PLCallback):
    """:class:`~fused_ce.integrations.lightning.FusedCrossEntropyCallback` for ``lightning.pytorch``
    and ``pytorch_lightning`` Trainers."""
