"""Shared pieces of the Lightning tests: a tiny BERT masked-LM LightningModule for each Lightning
namespace, deterministic data, and ``train()`` that returns the per-step losses and the final
weights. Used in-process by tests/test_lightning.py and from subprocesses by
tests/_lightning_ddp_worker.py (module-level classes, so ``ddp_spawn`` can pickle them)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

VOCAB = 997          # not a multiple of 8 on purpose
SEQ = 16
BATCH = 4
N_EXAMPLES = 64


def bert_config():
    from transformers import BertConfig

    return BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=2, intermediate_size=64, max_position_embeddings=SEQ,
                      hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)


def dataset(seed: int = 0, data: str = "mlm") -> TensorDataset:
    """Random tokens, 15 % of them labelled and replaced by a [MASK] id in the input. ``mlm``: the
    label is the original token; ``constant``: the label is always token 7 (learnt in a few
    steps, so token accuracy goes from 0 to 1 within a short test)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (N_EXAMPLES, SEQ), generator=g)
    labels = ids.clone()
    masked = torch.rand(N_EXAMPLES, SEQ, generator=g) < 0.15
    masked[:, 0] = True                          # at least one label per row
    labels[~masked] = -100
    if data == "constant":
        labels[masked] = 7
    ids = torch.where(masked, torch.full_like(ids, 4), ids)   # 4 = [MASK] of this toy vocab
    return TensorDataset(ids, labels)


class _MLMImpl:
    """BertForMaskedLM inside a LightningModule, built in __init__ or in configure_model."""

    def __init__(self, build_in: str = "init", lr: float = 3e-3, result_dir=None,
                 data: str = "mlm"):
        super().__init__()
        self.data = data
        self.step_accuracy = []
        self.build_in = build_in
        self.result_dir = result_dir
        self.lr = lr
        self.model = None
        self.step_losses = []
        if build_in == "init":
            self._build()

    def _build(self):
        from transformers import BertForMaskedLM

        # the same weights wherever it is built, and the global RNG (dropout) left alone, so a
        # model built in configure_model trains exactly like one built in __init__
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1234)
            self.model = BertForMaskedLM(bert_config())

    def configure_model(self):
        if self.model is None:
            self._build()

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        out = self.model(input_ids=ids, labels=labels)
        self.step_losses.append(float(out.loss.detach()))
        if out.logits is not None:       # keep_logits="always" (or no patch): an oracle accuracy
            valid = labels != -100
            correct = (out.logits.argmax(-1) == labels) & valid
            self.step_accuracy.append(float(correct.sum() / valid.sum()))
        return out.loss

    def validation_step(self, batch, batch_idx):
        ids, labels = batch
        out = self.model(input_ids=ids, labels=labels)
        assert out.logits is not None      # keep_logits="eval": validation still sees logits
        self.log("val_loss", out.loss)

    def on_train_end(self):
        """With ``result_dir``: each rank writes its losses (and rank 0 the final weights), so
        that multi-process runs (ddp_spawn returns nothing) can be compared."""
        if self.result_dir is None:
            return
        import json
        from pathlib import Path

        from fused_ce.integrations.lightning import FusedCrossEntropyCallback

        out = Path(self.result_dir)
        cbs = [c for c in self.trainer.callbacks if isinstance(c, FusedCrossEntropyCallback)]
        rank = self.trainer.global_rank
        (out / f"rank{rank}.json").write_text(json.dumps({
            "rank": rank, "world_size": self.trainer.world_size, "losses": self.step_losses,
            "report": cbs[0].report if cbs else None, "patched": cbs[0].patched if cbs else None,
        }))
        if rank == 0:
            state = {k: v.detach().cpu().clone() for k, v in self.state_dict().items()}
            torch.save(state, out / "weights.pt")

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return DataLoader(dataset(0, self.data), batch_size=BATCH, shuffle=False)

    def val_dataloader(self):
        return DataLoader(dataset(1), batch_size=BATCH * 4, shuffle=False)


def _module_class(namespace: str):
    if namespace == "lightning":
        from tests._lightning_ns import MLMModuleL
        return MLMModuleL
    from tests._lightning_ns import MLMModulePL
    return MLMModulePL


def trainer_module(namespace: str):
    if namespace == "lightning":
        import lightning.pytorch as L
        return L
    import pytorch_lightning as pl
    return pl


def train(namespace: str = "lightning", fused: bool = True, *, build_in: str = "init",
          steps: int = 6, strategy="auto", devices=1, precision="32-true", callback=None,
          val: bool = False, extra_callbacks=(), result_dir=None, data: str = "mlm",
          logger=False, lr: float = 3e-3, accelerator: str = "cpu", deterministic: bool = True):
    """Fit ``steps`` steps; returns (module, trainer, callback)."""
    L = trainer_module(namespace)
    L.seed_everything(7, workers=True)
    module = _module_class(namespace)(build_in=build_in, result_dir=result_dir, data=data, lr=lr)
    callbacks = list(extra_callbacks)
    if fused:
        if callback is None:
            import fused_ce
            callback = fused_ce.FusedCrossEntropyCallback()
        callbacks.append(callback)
    trainer = L.Trainer(
        accelerator=accelerator, devices=devices, strategy=strategy, precision=precision,
        max_steps=steps, callbacks=callbacks, logger=logger, log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, deterministic=deterministic,
        limit_val_batches=1 if val else 0, num_sanity_val_steps=0,
        val_check_interval=2 if val else None,
        check_val_every_n_epoch=1)
    trainer.fit(module)
    return module, trainer, callback
