"""FusedCrossEntropyCallback: training with it gives the same per-step losses and final weights as
training without it (the oracle), in both Lightning namespaces, for a model built in
configure_model, under DDP (2 gloo CPU processes, launched as a script) and bf16-mixed; the
one-time report; token accuracy; the unsupported-strategy error."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
L = pytest.importorskip("lightning.pytorch")
pl = pytest.importorskip("pytorch_lightning")

import torch  # noqa: E402

import fused_ce  # noqa: E402
from fused_ce.integrations.lightning import (  # noqa: E402
    FusedCrossEntropyCallback,
    UnsupportedStrategyError,
)
from tests import _lightning_models as models  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "_lightning_ddp_worker.py"


def _close_losses(a, b, rtol=2e-5):
    assert len(a) == len(b) > 0
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= rtol * max(1.0, abs(y)), f"step {i}: {x} vs {y}"


def _close_weights(a, b, atol=2e-5):
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=atol, msg=lambda m: f"{k}: {m}")


def _state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.fixture(scope="module")
def oracle():
    """The run without the callback: the model's own (logits-building) loss."""
    module, _, _ = models.train("lightning", fused=False)
    assert not fused_ce.is_patched(module.model)
    return module.step_losses, _state(module)


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def rank_zero_log():
    """Messages of both namespaces' rank-zero loggers (they may not propagate to the root)."""
    handler = _Capture()
    loggers = [logging.getLogger(n) for n in ("lightning.pytorch.utilities.rank_zero",
                                              "pytorch_lightning.utilities.rank_zero")]
    for lg in loggers:
        lg.addHandler(handler)
    yield handler.messages
    for lg in loggers:
        lg.removeHandler(handler)


@pytest.mark.parametrize("namespace", ["lightning", "pytorch_lightning"])
def test_same_losses_and_weights_both_namespaces(oracle, namespace, rank_zero_log):
    cb = FusedCrossEntropyCallback(namespace=namespace)
    base = L.Callback if namespace == "lightning" else pl.Callback
    other = pl.Callback if namespace == "lightning" else L.Callback
    assert isinstance(cb, base) and not isinstance(cb, other)
    module, trainer, cb = models.train(namespace, fused=True, callback=cb)
    assert type(trainer).__module__.split(".")[0] == namespace.split(".")[0]
    assert fused_ce.is_patched(module.model) and cb.patched == ["model"]
    _close_losses(module.step_losses, oracle[0])
    _close_weights(_state(module), oracle[1])
    # the one-time report, through that namespace's rank-zero logger
    reports = [m for m in rank_zero_log if m.startswith("fused_ce:")]
    assert len(reports) == 1, rank_zero_log
    rows = models.BATCH * models.SEQ
    assert f"{rows} rows x {models.VOCAB} vocab x 4 bytes (float32)" in reports[0]
    assert cb.report["logits_bytes_per_step"] == rows * models.VOCAB * 4
    assert cb.report["patched"] == ["model"]


def test_auto_namespace_is_both_when_both_are_imported():
    cb = fused_ce.FusedCrossEntropyCallback()
    assert isinstance(cb, L.Callback) and isinstance(cb, pl.Callback)
    assert isinstance(cb, FusedCrossEntropyCallback)
    import pickle

    again = pickle.loads(pickle.dumps(cb))
    assert type(again) is type(cb) and again.keep_logits == "eval"
    with pytest.raises(ValueError, match="keep_logits"):
        FusedCrossEntropyCallback(keep_logits="sometimes")
    with pytest.raises(ValueError, match="namespace"):
        FusedCrossEntropyCallback(namespace="keras")


def test_importing_fused_ce_does_not_import_lightning():
    code = ("import sys, fused_ce; assert fused_ce.linear_cross_entropy; "
            "bad = [m for m in ('lightning', 'pytorch_lightning', 'transformers') "
            "if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_model_built_in_configure_model(oracle, rank_zero_log):
    """Not there at setup; patched at on_fit_start, before the first step."""
    seen_at_first_step = []

    class Spy(L.Callback):
        def setup(self, trainer, pl_module, stage):
            seen_at_first_step.append(("setup", pl_module.model is None))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 0:
                seen_at_first_step.append(("step", fused_ce.is_patched(pl_module.model)))

    module, _, cb = models.train("lightning", fused=True, build_in="configure_model",
                                 extra_callbacks=[Spy()])
    assert seen_at_first_step == [("setup", True), ("step", True)]
    assert cb.patched == ["model"]
    _close_losses(module.step_losses, oracle[0])
    _close_weights(_state(module), oracle[1])
    assert len([m for m in rank_zero_log if m.startswith("fused_ce:")]) == 1


def test_idempotent_and_reports_once(oracle, rank_zero_log):
    """A model patched beforehand, a second fit with the same callback: one patch, one set of
    hooks, one report; the losses still match the oracle."""
    from fused_ce.integrations._hf_heads import FusedLossPreHook

    cb = FusedCrossEntropyCallback()
    module, trainer, _ = models.train("lightning", fused=True, callback=cb, steps=3)
    fused_ce.patch_hf_model(module.model)      # the user patches again: still one patch
    trainer2 = L.Trainer(accelerator="cpu", max_steps=2, callbacks=[cb], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0)
    trainer2.fit(module, ckpt_path=None)
    pre = [h for h in module.model._forward_pre_hooks.values() if isinstance(h, FusedLossPreHook)]
    assert len(pre) == 1
    assert cb.patched == ["model"]
    assert len([m for m in rank_zero_log if m.startswith("fused_ce:")]) == 1
    _close_losses(module.step_losses[:3], oracle[0][:3])


def test_validation_keeps_logits_and_loss():
    """keep_logits='eval': validation in the middle of training runs the unpatched way (the
    module asserts that it gets logits); losses and the validation loss match a run without
    the callback that validates at the same steps."""
    base, base_trainer, _ = models.train("lightning", fused=False, val=True, steps=4)
    module, trainer, cb = models.train("lightning", fused=True, val=True, steps=4)
    assert fused_ce.is_patched(module.model)
    _close_losses(module.step_losses, base.step_losses)
    got, want = trainer.callback_metrics["val_loss"], base_trainer.callback_metrics["val_loss"]
    assert abs(float(got) - float(want)) <= 2e-5 * float(want)


def test_bf16_mixed(rank_zero_log):
    """bf16 autocast: the fused loss is within bf16 rounding of the model's own; the report
    counts 2-byte logits."""
    base, _, _ = models.train("lightning", fused=False, precision="bf16-mixed", steps=3)
    module, _, cb = models.train("lightning", fused=True, precision="bf16-mixed", steps=3)
    _close_losses(module.step_losses, base.step_losses, rtol=2e-2)
    assert cb.report["models"][0]["dtype"] == "bfloat16"
    rows = models.BATCH * models.SEQ
    assert cb.report["logits_bytes_per_step"] == rows * models.VOCAB * 2


class _MemoryLogger(L.loggers.Logger):
    """Keeps what is logged, per step."""

    def __init__(self):
        super().__init__()
        self.metrics = []

    name = "memory"
    version = "0"

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.metrics.append((step, dict(metrics)))


def test_log_token_accuracy_matches_logits():
    """train/token_accuracy equals the accuracy of the logits of the same forward pass
    (keep_logits='always' makes the patched model return them as well)."""
    logger = _MemoryLogger()
    cb = FusedCrossEntropyCallback(keep_logits="always", log_token_accuracy=True)
    module, trainer, _ = models.train("lightning", fused=True, callback=cb, steps=5,
                                      data="constant", lr=3e-2, logger=logger)
    logged = [m["train/token_accuracy"] for _, m in logger.metrics if "train/token_accuracy" in m]
    assert len(module.step_accuracy) == 5 and len(logged) == 5, logger.metrics
    for got, want in zip(logged, module.step_accuracy):
        assert abs(got - want) < 1e-6
    assert min(logged) < 0.5 < max(logged), logged      # learnt within the test: not constant


def test_token_accuracy_tap_reads_output_stats():
    """The accuracy tap reads out.fused_ce_stats (no extra pass): counts the correct and the
    non-ignored tokens; an output without statistics (a return_dict=False tuple) is flagged."""
    from types import SimpleNamespace

    from fused_ce.integrations.lightning import _OutputTap, _TapState

    state = _TapState(causal=False, want_accuracy=True)
    tap = _OutputTap(state)
    target = torch.tensor([[3, -100, 5, 7]])
    stats = SimpleNamespace(correct=torch.tensor([[True, False, False, True]]))
    state.pending = (target, -100)
    tap(None, (), SimpleNamespace(fused_ce_stats=stats))
    state.pending = (target, -100)
    tap(None, (), SimpleNamespace(fused_ce_stats=stats))
    assert int(state.correct) == 4 and int(state.valid) == 6 and not state.no_stats
    state.pending = (target, -100)
    tap(None, (), (torch.zeros(1),))
    assert state.no_stats and state.pending is None and int(state.valid) == 6


def test_unsupported_strategy_errors_at_setup():
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    def deepspeed_strategy(stage):
        # deepspeed itself is not installed in CI (its constructor imports it): a DeepSpeedStrategy
        # object carrying the config its constructor would build for this stage
        strategy = DeepSpeedStrategy.__new__(DeepSpeedStrategy)
        strategy.config = {"zero_optimization": {"stage": stage}}
        assert strategy.zero_stage_3 == (stage == 3)
        return strategy

    cb = FusedCrossEntropyCallback()
    module = models._module_class("lightning")()
    with pytest.raises(UnsupportedStrategyError, match="ZeRO stage 3"):
        cb.setup(SimpleNamespace(strategy=deepspeed_strategy(3)), module, "fit")
    assert not fused_ce.is_patched(module.model)          # refused before patching anything
    cb.setup(SimpleNamespace(strategy=deepspeed_strategy(2)), module, "fit")
    assert fused_ce.is_patched(module.model)
    cb.setup(SimpleNamespace(strategy=DDPStrategy()), module, "fit")   # idempotent
    assert cb.patched == ["model"]


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """Two 2-process gloo runs, launched together as scripts (tests/_lightning_ddp_worker.py):
    the oracle (strategy='ddp', no callback) and the callback under 'ddp_spawn' (the callback
    and the module are pickled into the spawned processes) with the model built in
    configure_model. (The callback under 'ddp' with an __init__ model gives the same numbers;
    CI runs the one pair to stay within its time.) Returns name -> (ranks, weights)."""
    root = tmp_path_factory.mktemp("ddp")
    runs = {"oracle": ("ddp", "init", "0"), "ddp_spawn": ("ddp_spawn", "configure_model", "1")}
    procs = {}
    for name, (strategy, build_in, fused) in runs.items():
        env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1")
        for var in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GLOBAL_RANK", "RANK"):
            env.pop(var, None)
        procs[name] = subprocess.Popen(
            [sys.executable, str(WORKER), str(root / name), strategy, "lightning", build_in,
             fused], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name}: {out[-3000:]}{err[-5000:]}"
        ranks = [json.loads((root / name / f"rank{r}.json").read_text()) for r in (0, 1)]
        assert [r["world_size"] for r in ranks] == [2, 2]
        results[name] = (ranks, torch.load(root / name / "weights.pt"))
    return results


def test_ddp_two_processes(ddp_runs):
    ranks, weights = ddp_runs["ddp_spawn"]
    base_ranks, base_weights = ddp_runs["oracle"]
    for r in (0, 1):
        _close_losses(ranks[r]["losses"], base_ranks[r]["losses"])
        assert ranks[r]["patched"] == ["model"]
        assert base_ranks[r]["patched"] is None
    assert ranks[0]["losses"] != ranks[1]["losses"]        # each rank saw its own batches
    _close_weights(weights, base_weights)
    rows = models.BATCH * models.SEQ
    assert ranks[0]["report"]["logits_bytes_per_step"] == rows * models.VOCAB * 4
