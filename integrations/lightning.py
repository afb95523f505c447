"""Lightning adapter: :class:`FusedCrossEntropyCallback` patches every HuggingFace language model
inside a ``LightningModule`` with :func:`fused_ce.patch_hf_model`, so training never builds the
``tokens x vocab`` logits.

Works with the Trainers of both Lightning namespaces, ``lightning.pytorch`` and
``pytorch_lightning`` (separate class trees, see :class:`FusedCrossEntropyCallback`). Importing
this module imports neither: the namespace classes live in ``_lightning_ns_{l,pl,both}.py`` and
are loaded when the callback is constructed.

When it patches (a model built in ``configure_model`` does not exist yet at ``setup``):

* ``setup``: checks the strategy (DeepSpeed ZeRO-3 and tensor parallelism are refused here, with an
  error, instead of computing a wrong loss) and patches every model that exists already, before
  the strategy moves or wraps it (what FSDP needs: the patch verifies the model with a tiny
  forward pass on the unsharded model).
* ``on_fit_start`` / ``on_validation_start`` / ``on_test_start`` / ``on_predict_start``: patches
  the models built since (in ``configure_model``), before the first step. Under FSDP such a model
  is already wrapped then and cannot be verified: the callback stops with an error that says to
  build it in ``__init__`` or to call ``patch_hf_model`` at the end of ``configure_model``.

Patching is idempotent: a model that is already patched keeps its patch (only ``keep_logits`` is
updated). After the first training step, rank zero reports once, through Lightning's rank-zero
logger, what was patched and how much logits memory each step avoids (rows x vocab x bytes of the
logits an unpatched model would build, per device).
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional

import torch
from torch import nn

__all__ = ["FusedCrossEntropyCallback", "UnsupportedStrategyError"]

_NAMESPACES = ("lightning.pytorch", "pytorch_lightning")
_KEEP_LOGITS = ("eval", "always", "never")


class UnsupportedStrategyError(RuntimeError):
    """The Trainer's strategy partitions the output embedding in a way the fused loss cannot see."""


# --------------------------------------------------------------------------------------------
# Hooks put on each patched model. Module-level classes holding plain data, so that a model
# carrying them still pickles (torch.save of the whole model, ddp_spawn, deepcopy).
# --------------------------------------------------------------------------------------------

class _TapState:
    """What the taps of one patched model saw; read and reset by the callback."""

    def __init__(self, causal: bool, want_accuracy: bool):
        self.causal = causal
        self.want_accuracy = want_accuracy
        self.first_step = None       # (rows, vocab, dtype, has_bias) of the first training call
        self.pending = None          # (target, ignore index) of the current training forward
        self.correct = None          # accumulated tensors (no host sync in the step)
        self.valid = None
        self.no_stats = False        # a training output carried no fused_ce_stats

    def __getstate__(self):
        state = dict(self.__dict__)
        state["pending"] = state["correct"] = state["valid"] = None
        return state


def _target_of(kwargs, causal: bool):
    """The per-position target the patched model's loss uses (HF's shift for causal LMs)."""
    labels = kwargs.get("labels")
    if labels is None:
        return None
    if causal:
        shift = kwargs.get("shift_labels")
        if shift is not None:
            return shift
        ignore = kwargs.get("ignore_index", -100)
        return nn.functional.pad(labels, (0, 1), value=ignore)[..., 1:]
    return labels


class _ModelTap:
    """Forward pre-hook (``with_kwargs=True``, prepended so it sees ``labels`` before the patch's
    own hook takes them) on a patched model."""

    def __init__(self, state: _TapState):
        self.state = state

    def __call__(self, module, args, kwargs):
        state = self.state
        state.pending = None
        labels = kwargs.get("labels")
        if labels is None or not module.training:
            return None
        head = module.get_output_embeddings()
        if state.first_step is None:
            device_type = labels.device.type
            if torch.is_autocast_enabled(device_type):
                dtype = torch.get_autocast_dtype(device_type)
            else:
                dtype = head.weight.dtype
            state.first_step = (labels.numel(), head.out_features, dtype, head.bias is not None)
        if state.want_accuracy:
            ignore = kwargs.get("ignore_index", -100) if state.causal else -100
            state.pending = (_target_of(kwargs, state.causal), ignore)
        return None


class _OutputTap:
    """Forward hook on a patched model, registered after the patch's own hook: token accuracy of
    the labelled rows, read from the statistics the fused pass attached to the output
    (``out.fused_ce_stats``, see :func:`fused_ce.patch_hf_model`): no extra pass, no sync."""

    def __init__(self, state: _TapState):
        self.state = state

    def __call__(self, module, args, output):
        state = self.state
        pending, state.pending = state.pending, None
        if pending is None:
            return None
        stats = getattr(output, "fused_ce_stats", None)
        if stats is None:  # e.g. return_dict=False: a tuple carries no statistics
            state.no_stats = True
            return None
        target, ignore = pending
        correct = stats.correct.sum()
        valid = (target != ignore).sum().to(correct.device)
        state.correct = correct if state.correct is None else state.correct + correct
        state.valid = valid if state.valid is None else state.valid + valid
        return None


# --------------------------------------------------------------------------------------------
# The callback
# --------------------------------------------------------------------------------------------

class FusedCrossEntropyCallback:
    """Lightning callback: every HuggingFace language model in the LightningModule computes its
    loss with ``fused_ce`` (see :func:`fused_ce.patch_hf_model`).

    Args:
        keep_logits: passed to :func:`fused_ce.patch_hf_model`: ``"eval"`` (default) builds no
            logits in training and runs the model unchanged in eval mode (validation metrics that
            need the logits keep working); ``"always"`` / ``"never"``.
        log_token_accuracy: log ``train/token_accuracy`` (fraction of labelled tokens whose
            argmax is the label) each training step, read from the statistics the fused pass
            puts on the model output (``out.fused_ce_stats``): no extra pass over the head. A
            model called with ``return_dict=False`` returns tuples, which carry none: then
            nothing is logged and the callback warns once. Under DDP the value is over all
            ranks' tokens.
        namespace: the Lightning ``Callback`` base(s) of the instance: ``"lightning"``
            (``lightning.pytorch``), ``"pytorch_lightning"``, ``"both"``, or ``"auto"`` (default):
            the namespace(s) already imported in this process (you import one to build a
            Trainer), or every installed one if none is imported yet.

    ``FusedCrossEntropyCallback(...)`` returns an instance of a subclass that also derives from
    the chosen ``Callback`` class(es), so ``isinstance(cb, lightning.pytorch.Callback)`` (or
    ``pytorch_lightning.Callback``) holds and either Trainer accepts it. After the first training
    step :attr:`report` holds what was reported (a dict), and :attr:`patched` the dotted names (in
    the LightningModule) of the patched models.
    """

    def __new__(cls, *args, **kwargs):
        if cls is FusedCrossEntropyCallback:
            cls = _callback_class(kwargs.get("namespace", "auto"))
        return super().__new__(cls)

    def __init__(self, keep_logits: str = "eval", log_token_accuracy: bool = False, *,
                 namespace: str = "auto"):
        if isinstance(keep_logits, bool) or keep_logits not in _KEEP_LOGITS:
            raise ValueError(f"keep_logits: expected one of {', '.join(map(repr, _KEEP_LOGITS))}, "
                             f"got {keep_logits!r}")
        if not isinstance(log_token_accuracy, bool):
            raise TypeError(f"log_token_accuracy: expected a bool, got {log_token_accuracy!r}")
        self.keep_logits = keep_logits
        self.log_token_accuracy = log_token_accuracy
        self.patched: list[str] = []
        self.report: Optional[dict] = None
        self._taps: dict[str, _TapState] = {}
        self._handles: list = []
        self._warned_no_stats = False

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_handles"] = []
        return state

    def __repr__(self):
        return (f"{type(self).__name__}(keep_logits={self.keep_logits!r}, "
                f"log_token_accuracy={self.log_token_accuracy})")

    # ---------------------------------------------------------------- Lightning hooks
    def setup(self, trainer, pl_module, stage: str) -> None:
        _check_strategy(trainer.strategy)
        self._patch(trainer, pl_module)

    def on_fit_start(self, trainer, pl_module) -> None:
        self._patch(trainer, pl_module, required=True)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._patch(trainer, pl_module, required=not _fitting(trainer))

    def on_test_start(self, trainer, pl_module) -> None:
        self._patch(trainer, pl_module, required=True)

    def on_predict_start(self, trainer, pl_module) -> None:
        self._patch(trainer, pl_module, required=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.report is None and any(t.first_step for t in self._taps.values()):
            self._report(trainer)
        if self.log_token_accuracy:
            correct = valid = None
            if not self._warned_no_stats and any(t.no_stats for t in self._taps.values()):
                self._warned_no_stats = True
                _rank_zero(trainer, "warn")(
                    "FusedCrossEntropyCallback(log_token_accuracy=True): a training forward "
                    "returned no fused_ce_stats (a tuple: return_dict=False?), so its token "
                    "accuracy is not logged")
            for tap in self._taps.values():
                if tap.valid is not None:
                    correct = tap.correct if correct is None else correct + tap.correct
                    valid = tap.valid if valid is None else valid + tap.valid
                tap.correct = tap.valid = None
            if valid is None:
                return
            pair = torch.stack([correct.double(), valid.double()])
            pair = trainer.strategy.reduce(pair, reduce_op="sum")
            # nan when no token was labelled, like linear_cross_entropy's accuracy
            pl_module.log("train/token_accuracy", (pair[0] / pair[1]).float(), on_step=True,
                          on_epoch=False, prog_bar=True)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        # the taps go; the patch stays (the model keeps computing its loss fused). A later
        # fit/validate with this callback installs fresh taps (and reports nothing again).
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._taps = {}

    # ---------------------------------------------------------------- implementation
    def _patch(self, trainer, pl_module, required: bool = False) -> None:
        import fused_ce

        models = _find_hf_models(pl_module)
        if not models:
            if required and not self.patched:
                _rank_zero(trainer, "warn")(
                    f"FusedCrossEntropyCallback: found no HuggingFace model with an output "
                    f"embedding (get_output_embeddings()) in {type(pl_module).__name__}; nothing "
                    f"was patched and the loss is computed as the module does it")
            return
        for name, model in models:
            if _under_fsdp(pl_module, model) and not fused_ce.is_patched(model):
                raise RuntimeError(
                    f"FusedCrossEntropyCallback: the HuggingFace model {name or '<root>'} "
                    f"({type(model).__name__}) is already wrapped by FSDP, so it cannot be patched "
                    f"now (the patch checks the model with a forward pass on unsharded weights). "
                    f"Under FSDP build the model in the LightningModule's __init__ (it is then "
                    f"patched at setup, before wrapping), or call fused_ce.patch_hf_model(model) "
                    f"at the end of configure_model")
            try:
                fused_ce.patch_hf_model(model, keep_logits=self.keep_logits)
            except ValueError as exc:
                raise ValueError(f"FusedCrossEntropyCallback: cannot patch {name or '<root>'}: "
                                 f"{exc}") from exc
            key = name or "<root>"
            if key not in self.patched:
                self.patched.append(key)
            if key not in self._taps:
                self._install_taps(key, model)

    def _install_taps(self, key: str, model) -> None:
        can_generate = getattr(model, "can_generate", None)
        causal = bool(can_generate()) if callable(can_generate) else False
        state = _TapState(causal=causal, want_accuracy=self.log_token_accuracy)
        self._taps[key] = state
        self._handles.append(model.register_forward_pre_hook(
            _ModelTap(state), with_kwargs=True, prepend=True))
        if self.log_token_accuracy:
            self._handles.append(model.register_forward_hook(_OutputTap(state)))

    def _report(self, trainer) -> None:
        models, total = [], 0
        for key, tap in self._taps.items():
            if tap.first_step is None:
                continue
            rows, vocab, dtype, has_bias = tap.first_step
            nbytes = rows * vocab * _itemsize(dtype)
            total += nbytes
            models.append({"name": key, "rows": rows, "vocab": vocab,
                           "dtype": str(dtype).replace("torch.", ""), "bias": has_bias,
                           "logits_bytes": nbytes})
        self.report = {"patched": list(self.patched), "keep_logits": self.keep_logits,
                       "models": models, "logits_bytes_per_step": total}
        lines = [f"fused_ce: FusedCrossEntropyCallback patched {len(self.patched)} HuggingFace "
                 f"model(s) (keep_logits={self.keep_logits!r}): {', '.join(self.patched)}."]
        for m in models:
            lines.append(f"  {m['name']}: logits avoided per training step (per device): "
                         f"{m['rows']} rows x {m['vocab']} vocab x {_itemsize_str(m['dtype'])} "
                         f"= {_fmt_bytes(m['logits_bytes'])}")
        if len(models) > 1:
            lines.append(f"  total: {_fmt_bytes(total)} per step")
        _rank_zero(trainer, "info")("\n".join(lines))


def _callback_class(namespace: str):
    """The subclass of FusedCrossEntropyCallback deriving from the chosen Callback base(s)."""
    if namespace == "auto":
        imported = [ns for ns in _NAMESPACES if ns in sys.modules]
        if len(imported) == 2:
            namespace = "both"
        elif imported:
            namespace = "lightning" if imported[0] == "lightning.pytorch" else "pytorch_lightning"
        else:
            installed = [ns for ns in _NAMESPACES if _installed(ns)]
            if not installed:
                raise ImportError("FusedCrossEntropyCallback needs Lightning: pip install "
                                  "lightning (or pytorch-lightning), e.g. pip install "
                                  "'fused_ce[lightning]'")
            namespace = "both" if len(installed) == 2 else (
                "lightning" if installed[0] == "lightning.pytorch" else "pytorch_lightning")
    names = {"lightning": "LightningFusedCrossEntropyCallback",
             "pytorch_lightning": "PLFusedCrossEntropyCallback",
             "both": "BothFusedCrossEntropyCallback"}
    if namespace not in names:
        raise ValueError(f"namespace: expected 'auto', 'lightning', 'pytorch_lightning' or "
                         f"'both', got {namespace!r}")
    try:
        module = importlib.import_module("fused_ce.integrations._lightning_ns_"
                                         + ("both" if namespace == "both" else
                                            "l" if namespace == "lightning" else "pl"))
    except ImportError as exc:
        pkg = {"lightning": "lightning", "pytorch_lightning": "pytorch-lightning",
               "both": "lightning pytorch-lightning"}[namespace]
        raise ImportError(f"FusedCrossEntropyCallback(namespace={namespace!r}) needs "
                          f"{pkg}: pip install {pkg} ({exc})") from exc
    return getattr(module, names[namespace])


def _installed(namespace: str) -> bool:
    import importlib.util

    top = namespace.split(".")[0]
    try:
        return importlib.util.find_spec(top) is not None and (
            top == namespace or importlib.util.find_spec(namespace) is not None)
    except (ImportError, ValueError):
        return False


def _fitting(trainer) -> bool:
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    return getattr(fn, "value", fn) == "fit"


def _find_hf_models(root: nn.Module):
    """(dotted name, model) of the outermost transformers PreTrainedModels with an output
    embedding under ``root`` (a model inside a patched one is not visited)."""
    transformers = sys.modules.get("transformers")
    if transformers is None:  # no transformers model can exist without transformers imported
        return []
    base = transformers.PreTrainedModel
    found = []

    def visit(module, prefix):
        if isinstance(module, base):
            try:
                head = module.get_output_embeddings()
            except (NotImplementedError, AttributeError):
                head = None
            if head is not None:
                found.append((prefix, module))
                return
        for child_name, child in module.named_children():
            visit(child, f"{prefix}.{child_name}" if prefix else child_name)

    visit(root, "")
    return found


def _under_fsdp(root: nn.Module, model: nn.Module) -> bool:
    """Whether FSDP (1) has wrapped ``model`` or any module inside it, or holds its parameters
    in a wrapper around it (then the model's own parameters are shards)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return False
    wrapper = getattr(fsdp, "FullyShardedDataParallel", None)
    if wrapper is None:
        return False
    if any(isinstance(m, wrapper) for m in model.modules()):
        return True
    return any(isinstance(m, wrapper) and any(sub is model for sub in m.modules())
               for m in root.modules())


def _check_strategy(strategy) -> None:
    names = [c.__name__ for c in type(strategy).__mro__]
    if "DeepSpeedStrategy" in names:
        config = getattr(strategy, "config", None) or {}
        stage = (config.get("zero_optimization") or {}).get("stage")
        if stage == 3:
            raise UnsupportedStrategyError(
                "FusedCrossEntropyCallback: DeepSpeed ZeRO stage 3 partitions every parameter, "
                "including the output embedding that the fused loss reads, across ranks; this "
                "strategy is not supported (the loss could be wrong). Use DeepSpeed stage 1 or 2, "
                "strategy='ddp', or strategy='fsdp'.")
    if "ModelParallelStrategy" in names:
        tp = getattr(strategy, "_tensor_parallel_size", 1)
        if tp not in (1, "auto"):
            raise UnsupportedStrategyError(
                f"FusedCrossEntropyCallback: ModelParallelStrategy with tensor_parallel_size={tp} "
                f"may shard the output embedding over the vocabulary; the HuggingFace patch "
                f"computes the loss from the local weight and is not supported there. Use "
                f"fused_ce.linear_cross_entropy(..., process_group=...) (vocab-parallel) in your "
                f"training_step instead.")


def _rank_zero(trainer, level: str):
    """``rank_zero_info`` / ``rank_zero_warn`` of the trainer's own Lightning namespace."""
    top = type(trainer).__module__.split(".")[0]
    ns = "pytorch_lightning" if top == "pytorch_lightning" else "lightning.pytorch"
    module = importlib.import_module(f"{ns}.utilities.rank_zero")
    return getattr(module, f"rank_zero_{level}")


def _itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _itemsize_str(dtype_name: str) -> str:
    n = _itemsize(getattr(torch, dtype_name))
    return f"{n} bytes ({dtype_name})"


def _fmt_bytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"
