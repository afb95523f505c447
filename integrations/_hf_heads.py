"""Runtime pieces of the HuggingFace patch (see ``fused_ce.integrations.hf``).

Everything here is a module-level class so that a patched model survives ``copy.deepcopy``,
``pickle`` / ``torch.save`` of the whole model and ``ddp_spawn``. Nothing here imports
transformers: HF objects are handled by duck typing (``get_output_embeddings``, ``ModelOutput``
dataclasses).

How one training step flows through a patched model::

    model(input_ids, labels=...)                       # nn.Module.__call__
      _FusedLossPreHook   takes labels (+ num_items_in_batch, shift_labels, ...) out of the
                          kwargs, so the model computes no loss, and leaves a _Call on the head
      model.forward       unchanged HF code; calls the head once with its hidden states
        FusedLMHead.forward   reads weight/bias now (FSDP has them unsharded inside this forward),
                              computes the fused loss and its statistics (return_stats=True: no
                              extra pass), returns a (..., 0) placeholder as "logits"
      _FusedLossPostHook  puts the loss into the output (first field; plus an MoE model's
                          ``router_aux_loss_coef * aux_loss``, as its forward adds with labels),
                          logits=None, attaches the statistics as the plain attribute
                          ``fused_ce_stats``, clears the _Call
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fused_ce

KEEP_LOGITS = ("eval", "always", "never")
CALL_ATTR = "_fused_ce_call"
# The attribute of a fused call's ModelOutput that holds its fused_ce.LinearCrossEntropyStats.
STATS_ATTR = "fused_ce_stats"

# Extra losses of pretraining heads: (label kwarg, output field of its logits). The model adds
# CE(those logits, that label) to the LM loss, and computes no loss unless both labels are given.
AUX_HEADS = (("next_sentence_label", "seq_relationship_logits"),
             ("sentence_order_label", "sop_logits"))

# MoE causal LMs (Mixtral, Qwen2/3-MoE, OLMoE, DBRX, Jamba, GraniteMoe, PhiMoE, JetMoe, ...):
# called with ``output_router_logits`` (argument or config) their output carries the router
# load-balancing loss ``aux_loss``, and when given labels their forward does
# ``loss += coef * aux_loss.to(loss.device)``. Where ``coef`` is read from, relative to the model,
# in the order tried (transformers 5.x): ``self.router_aux_loss_coef`` (most; DBRX copies its
# ``config.ffn_config.moe_loss_weight`` there), ``self.aux_loss_coef`` (JetMoe),
# ``self.config.router_aux_loss_coef``, ``self.config.text_config.router_aux_loss_coef``
# (vision-language MoE heads). The patch-time check verifies the one found (hf._verify).
ROUTER_COEF_PATHS = (("router_aux_loss_coef",), ("aux_loss_coef",),
                     ("config", "router_aux_loss_coef"),
                     ("config", "text_config", "router_aux_loss_coef"))


def attr_path(obj, path):
    """``obj.a.b.c`` for ``path == ("a", "b", "c")``."""
    return functools.reduce(getattr, path, obj)


class FusedLossSpec:
    """What the patch found out about the model at patch time (plain data, picklable).

    causal           shift labels by one (HF ForCausalLMLoss) instead of a masked-LM loss
    loss_kwargs      the model's loss honours num_items_in_batch / ignore_index (/ shift_labels
                     when causal), i.e. it is HF's ``self.loss_function``; otherwise it is a
                     plain mean ``CrossEntropyLoss()`` that ignores them
    softcap_attr     config attribute holding the final logit softcap (Gemma-2), or None
    scale_attr/op    config attribute holding a logit scale and whether the logits are
                     multiplied ('mul', Cohere) or divided ('div', Granite) by it, or None
    aux              (label kwarg, logits field) of a pretraining head's extra loss, or None
    router_coef      attribute path (ROUTER_COEF_PATHS) of the coefficient of an MoE model's
                     router ``aux_loss``, or None when the model has no such loss
    keep_logits      'eval' | 'always' | 'never'
    no_cache_with_labels  the model sets use_cache=False itself when given labels (BERT/RoBERTa
                     decoders); the fused path, which takes the labels away, passes it instead
    """

    def __init__(self, *, causal: bool, loss_kwargs: bool, softcap_attr: Optional[str],
                 scale_attr: Optional[str], scale_op: Optional[str], aux, keep_logits: str,
                 router_coef=None):
        self.causal = causal
        self.loss_kwargs = loss_kwargs
        self.softcap_attr = softcap_attr
        self.scale_attr = scale_attr
        self.scale_op = scale_op
        self.aux = aux
        self.router_coef = router_coef
        self.keep_logits = keep_logits
        self.no_cache_with_labels = False
        self.force_fused = False  # only set (and reset) by the patch-time self-check

    def __repr__(self):
        return (f"FusedLossSpec(causal={self.causal}, loss_kwargs={self.loss_kwargs}, "
                f"softcap_attr={self.softcap_attr!r}, scale={self.scale_attr!r}/{self.scale_op!r}, "
                f"aux={self.aux!r}, router_coef={self.router_coef!r}, "
                f"keep_logits={self.keep_logits!r}, "
                f"no_cache_with_labels={self.no_cache_with_labels})")

    def __getstate__(self):
        state = dict(self.__dict__)
        state["force_fused"] = False
        return state


class _Call:
    """One forward call's inputs to the fused loss, and its result. Lives on the head only
    between the model's pre-hook and post-hook."""

    __slots__ = ("labels", "shift_labels", "num_items", "ignore_index", "causal", "softcap",
                 "scale", "keep_logits", "aux_label", "want_tuple", "loss", "stats",
                 "placeholder_shape", "target", "flat_target", "prepared")

    def __init__(self, **kw):
        for name in self.__slots__:
            setattr(self, name, kw.get(name))


def output_head(model: nn.Module):
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def _config_value(model, attr):
    if attr is None:
        return None
    return getattr(getattr(model, "config", None), attr, None)


def _logit_scale(model, spec) -> Optional[float]:
    value = _config_value(model, spec.scale_attr)
    if value is None:
        return None
    return float(value) if spec.scale_op == "mul" else 1.0 / float(value)


class FusedLMHead(nn.Linear):
    """``nn.Linear`` whose forward computes the fused loss when the model's pre-hook asked for it.

    A patched model's output embedding gets this class (``head.__class__ = FusedLMHead``; the
    parameters, their names and any weight tying are untouched; unpatch sets ``nn.Linear`` back).
    Without a pending call it is exactly ``nn.Linear``.
    """

    def forward(self, input: Tensor) -> Tensor:
        call = self.__dict__.get(CALL_ATTR)
        if call is None:
            return F.linear(input, self.weight, self.bias)
        if call.loss is not None:
            raise RuntimeError(
                "fused_ce.patch_hf_model: the output embedding was called twice in one forward "
                "pass of the patched model; the fused loss needs exactly one call (unpatch the "
                "model with fused_ce.unpatch_hf_model to use it this way)")
        # The weight and bias are read here, inside this module's forward: FSDP/ZeRO-3 have
        # them unsharded now, and device moves, casts and weight swaps are all seen.
        call.stats = _fused_loss(call, input, self.weight, self.bias)
        call.loss = call.stats.loss
        if call.keep_logits:
            return F.linear(input, self.weight, self.bias)
        placeholder = input.new_empty(tuple(input.shape[:-1]) + (0,))
        call.placeholder_shape = tuple(placeholder.shape)
        return placeholder


def _fused_loss(call: _Call, x: Tensor, weight: Tensor,
                bias: Optional[Tensor]) -> "fused_ce.LinearCrossEntropyStats":
    """The LM loss and its statistics; per-token fields in the target's (label) layout, ``loss``
    already divided by ``num_items_in_batch`` when given (exactly the LM part of the output's
    loss)."""
    target = call.target
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if target.numel() != rows:
        name = "shift_labels" if call.causal and call.shift_labels is not None else "labels"
        raise ValueError(
            f"{name}: expected one label per position of the hidden states entering the output "
            f"embedding, shape {tuple(x.shape[:-1])}, got {tuple(target.shape)}")
    layout = tuple(target.shape)
    target = call.flat_target.to(x.device)
    prepared = call.prepared  # unless the target moved or changed since the pre-hook
    if prepared is not None and not prepared.matches(target, weight.shape[0], call.ignore_index):
        prepared = None
    x = x.reshape(-1, x.shape[-1])
    if call.scale is not None:  # s * (x W^T + b) == (s x) W^T + s b, exactly differentiable
        x = x * call.scale
        bias = None if bias is None else bias * call.scale
    reduction = "mean" if call.num_items is None else "sum"
    # return_stats costs no extra pass: the fused pass has the lse and argmax of every row anyway
    stats = fused_ce.linear_cross_entropy(
        x, weight, target, linear_bias=bias, reduction=reduction,
        ignore_index=call.ignore_index, softcap=call.softcap, return_stats=True,
        prepared_targets=prepared)
    loss = stats.loss
    if call.num_items is not None:  # HF fixed_cross_entropy: sum / num_items_in_batch
        n = call.num_items
        loss = loss / (n.to(loss.device) if torch.is_tensor(n) else n)
    return stats._replace(loss=loss, lse=stats.lse.reshape(layout),
                          predicted=stats.predicted.reshape(layout),
                          correct=stats.correct.reshape(layout))


def _loss_target(call: _Call) -> Tensor:
    """The label of each position entering the output embedding."""
    if call.causal and call.shift_labels is not None:
        return call.shift_labels
    if call.causal:  # HF ForCausalLMLoss: tokens < n predict n, the last one predicts nothing
        return F.pad(call.labels, (0, 1), value=call.ignore_index)[..., 1:]
    return call.labels


def _prepare_target(call: _Call, head: nn.Linear) -> None:
    """The loss target, and its scan started now, before the model's forward pass (so the
    loss's one host read does not wait for the GPU to run that pass). Not for targets on
    another device than the head's (the loss moves those) or that are not tensors."""
    call.target = _loss_target(call)
    call.flat_target = call.target.reshape(-1) if isinstance(call.target, Tensor) else None
    call.prepared = None
    weight = head._parameters.get("weight")
    if (call.flat_target is not None and weight is not None and call.flat_target.is_cuda
            and weight.device == call.flat_target.device
            and not call.flat_target.is_floating_point()):
        call.prepared = fused_ce.prepare_targets(call.flat_target, head.out_features,
                                                 ignore_index=call.ignore_index)


def _placeholder_like(value, shape) -> bool:
    return shape is not None and isinstance(value, Tensor) and tuple(value.shape) == shape


class FusedLossPreHook:
    """Model-level forward pre-hook (``with_kwargs=True``): decides whether this call takes the
    fused path and, if so, moves the loss inputs from the kwargs to the head."""

    def __init__(self, spec: FusedLossSpec):
        self.spec = spec

    def __call__(self, module, args, kwargs):
        head = output_head(module)
        if not isinstance(head, FusedLMHead):
            if type(head) is nn.Linear:  # replaced after patching (resize_token_embeddings, ...)
                head.__class__ = FusedLMHead
            else:
                warnings.warn(
                    f"fused_ce: the output embedding of the patched {type(module).__name__} is "
                    f"now a {type(head).__module__}.{type(head).__qualname__} (e.g. a LoRA "
                    f"wrapper), not a plain torch.nn.Linear; computing the loss the "
                    f"unfused way (unpatch the model: fused_ce.unpatch_hf_model; a head that "
                    f"is not a plain nn.Linear cannot be patched)", RuntimeWarning, stacklevel=2)
                return None
        head.__dict__[CALL_ATTR] = None
        spec = self.spec
        labels = kwargs.get("labels")
        if labels is None:
            return None
        if spec.keep_logits == "eval" and not module.training and not spec.force_fused:
            return None
        aux_label = None
        if spec.aux is not None:
            aux_label = kwargs.get(spec.aux[0])
            if aux_label is None:  # the model computes no loss then: leave it alone
                return None
        kwargs = dict(kwargs)
        kwargs.pop("labels")
        if spec.aux is not None:
            kwargs.pop(spec.aux[0])
        num_items = shift_labels = None
        ignore_index = -100
        if spec.loss_kwargs:
            num_items = kwargs.pop("num_items_in_batch", None)
            ignore_index = kwargs.pop("ignore_index", -100)
            if spec.causal:
                shift_labels = kwargs.pop("shift_labels", None)
        return_dict = kwargs.get("return_dict")
        if return_dict is None:
            return_dict = getattr(getattr(module, "config", None), "return_dict", True)
        kwargs["return_dict"] = True
        if spec.no_cache_with_labels:
            kwargs["use_cache"] = False
        softcap = _config_value(module, spec.softcap_attr)
        call = _Call(
            labels=labels, shift_labels=shift_labels, num_items=num_items,
            ignore_index=ignore_index, causal=spec.causal,
            softcap=None if softcap is None else float(softcap), scale=_logit_scale(module, spec),
            keep_logits=spec.keep_logits == "always", aux_label=aux_label,
            want_tuple=not return_dict, loss=None, stats=None, placeholder_shape=None)
        _prepare_target(call, head)
        head.__dict__[CALL_ATTR] = call
        return args, kwargs


class FusedLossPostHook:
    """Model-level forward hook (``with_kwargs=True, always_call=True``): puts the fused loss into
    the output (adding an MoE model's router aux loss as the model would), sets the placeholder
    logits to None (so, as HF's ``to_tuple()`` drops None fields, the ``return_dict=False`` tuple
    has no logits entry and the later entries move up one), attaches the LM head's statistics to
    a ModelOutput as the plain attribute ``fused_ce_stats`` (not a key), and always clears the
    head's pending call. Outputs of calls that did not take the fused path are returned
    untouched."""

    def __init__(self, spec: FusedLossSpec):
        self.spec = spec

    def __call__(self, module, args, kwargs, output):
        head = output_head(module)
        call = None if head is None else head.__dict__.get(CALL_ATTR)
        if call is None:
            return None
        head.__dict__[CALL_ATTR] = None
        if output is None:  # the forward raised; always_call only cleans up
            return None
        if call.loss is None:
            raise RuntimeError(
                f"fused_ce.patch_hf_model: the output embedding of {type(module).__name__} was "
                f"not called during the forward pass, so no loss was computed")
        loss = call.loss
        if not (dataclasses.is_dataclass(output) and hasattr(output, "to_tuple")):
            raise TypeError(
                f"fused_ce.patch_hf_model: expected {type(module).__name__} to return a "
                f"transformers ModelOutput when called with return_dict=True, got "
                f"{type(output).__name__}")
        fields = {f.name: getattr(output, f.name) for f in dataclasses.fields(output)}
        if "loss" not in fields:
            raise TypeError(f"fused_ce.patch_hf_model: {type(output).__name__} has no 'loss' field")
        if fields["loss"] is not None:
            raise RuntimeError(
                f"fused_ce.patch_hf_model: {type(module).__name__} computed a loss without labels; "
                f"cannot tell how to combine it with the fused loss")
        if self.spec.aux is not None:
            aux_logits = fields[self.spec.aux[1]]
            label = call.aux_label.to(aux_logits.device)
            loss = loss + F.cross_entropy(aux_logits.reshape(-1, aux_logits.shape[-1]),
                                          label.reshape(-1))
        router_aux = fields.get("aux_loss")
        if router_aux is not None:
            # The model computed its router load-balancing loss but, without labels, did not add
            # it; add it as it would: its in-place ``loss += coef * aux_loss.to(loss.device)``
            # keeps the LM loss's dtype. fused_ce_stats.loss stays the LM loss alone.
            if getattr(self.spec, "router_coef", None) is None:  # (or pickled before it existed)
                raise RuntimeError(
                    f"fused_ce.patch_hf_model: {type(module).__name__} returned an aux_loss that "
                    f"the patch-time check did not see, so its coefficient is unknown; unpatch "
                    f"the model (fused_ce.unpatch_hf_model) to train it with that loss")
            coef = attr_path(module, self.spec.router_coef)
            loss = (loss + coef * router_aux.to(loss.device)).to(loss.dtype)
        for name, value in fields.items():
            if _placeholder_like(value, call.placeholder_shape):
                fields[name] = None
        fields["loss"] = loss
        new = type(output)(**fields)
        if call.want_tuple:
            return new.to_tuple()
        # A plain instance attribute (ModelOutput.__setattr__ only mirrors dataclass fields into
        # the dict); it lives on this call's output only, never on a module.
        setattr(new, STATS_ATTR, call.stats)
        return new
