"""The test LightningModule of tests/_lightning_models.py for each Lightning namespace."""

import lightning.pytorch as L
import pytorch_lightning as pl

from tests._lightning_models import _MLMImpl


class MLMModuleL(_MLMImpl, L.LightningModule):
    pass


class MLMModulePL(_MLMImpl, pl.LightningModule):
    pass
