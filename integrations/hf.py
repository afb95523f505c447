"""HuggingFace transformers adapter: ``patch_hf_model`` makes a model compute its language-modelling
loss with ``fused_ce.linear_cross_entropy`` from the hidden states entering its output embedding,
so the ``tokens x vocab`` logits are never built in training.

Design (one generic mechanism, no copied HF forwards, no per-instance methods, no module state):

* The output embedding (``model.get_output_embeddings()``, a plain ``nn.Linear``) gets the class
  :class:`~fused_ce.integrations._hf_heads.FusedLMHead` (an ``nn.Linear`` subclass; same
  parameters, names, tying). Without a pending call it is ``nn.Linear``.
* A model-level forward pre-hook takes ``labels`` (and ``num_items_in_batch``, ``shift_labels``,
  ``ignore_index``, a pretraining head's ``next_sentence_label`` / ``sentence_order_label``) out of
  the kwargs when the fused path applies, so the model computes no loss, and leaves them on the
  head; the head's forward computes the fused loss from its input, reading its weight and bias
  right then (with ``return_stats=True``, which costs no extra pass); a model-level forward hook
  puts the loss first into the output, sets the logits to ``None`` and attaches the statistics to
  the ``ModelOutput`` as the plain attribute ``fused_ce_stats`` (not a key; see
  ``patch_hf_model``). Hooks and head class are module-level picklable objects: the patch survives
  ``copy.deepcopy``, ``pickle``/``torch.save`` of the whole model and ``ddp_spawn``.
* Patch time checks what can be checked statically (plain ``nn.Linear`` head, no encoder-decoder,
  no ``final_logits_bias``) and then *verifies* the model on a 2 x 8 batch of random
  ``input_ids`` and ``labels`` (eval mode, no gradient, RNG state and train/eval flags restored):
  the head must be called exactly once, the logits must be the head's output unchanged or a
  transform reproduced exactly (Gemma-2's ``final_logit_softcapping``, Cohere's ``logit_scale``,
  Granite's ``logits_scaling``), and the fused loss must equal the model's own loss with and
  without ``num_items_in_batch`` (which also tells whether the model honours it: HF's
  ``loss_function`` does, BERT's plain ``CrossEntropyLoss`` does not). MoE models (forward takes
  ``output_router_logits``) are checked with ``output_router_logits=True`` and their router
  aux-loss coefficient set to ``_PROBE_ROUTER_COEF`` (restored after): the fused loss plus
  ``coef * aux_loss`` must equal the model's loss, so a missing or mis-read term fails the check
  whatever the model's own (often tiny) coefficient. A model that fails is
  refused with a ``ValueError`` naming the class and what differs, and is left unchanged.
  Models whose parameters are on the ``meta`` device cannot run that check and are refused.
"""

from __future__ import annotations

import inspect
import math
from contextlib import contextmanager

import torch
from torch import nn

from fused_ce.integrations._hf_heads import (
    AUX_HEADS,
    CALL_ATTR,
    KEEP_LOGITS,
    ROUTER_COEF_PATHS,
    FusedLMHead,
    FusedLossPostHook,
    FusedLossPreHook,
    FusedLossSpec,
    attr_path,
    output_head,
)

__all__ = ["patch_hf_model", "unpatch_hf_model", "is_patched"]

# Config attributes of logit transforms applied after the output embedding, in the order the
# models apply them: scale (Cohere multiplies, Granite divides), then softcap (Gemma-2/3).
_SCALE_ATTRS = (("logit_scale", "mul"), ("logits_scaling", "div"))
_SOFTCAP_ATTR = "final_logit_softcapping"

_PROBE_SHAPE = (2, 8)
# The router aux-loss coefficient the check sets (and restores): large enough that a missing or
# mis-read term fails the check whatever the model's own coefficient (1e-3 in most configs).
_PROBE_ROUTER_COEF = 0.625


def _unwrap(model):
    """The transformers model inside a PEFT wrapper or a ``torch.compile`` module."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if isinstance(model, nn.Module) and hasattr(model, "_orig_mod") and \
                type(model).__name__ == "OptimizedModule":
            model = model._orig_mod
        elif callable(getattr(type(model), "get_base_model", None)):  # peft.PeftModel
            model = model.get_base_model()
    return model


def _our_hooks(model):
    pre = [k for k, h in model._forward_pre_hooks.items() if isinstance(h, FusedLossPreHook)]
    post = [k for k, h in model._forward_hooks.items() if isinstance(h, FusedLossPostHook)]
    return pre, post


def is_patched(model) -> bool:
    """Whether ``patch_hf_model`` has been applied to ``model`` (or the model it wraps)."""
    model = _unwrap(model)
    return isinstance(model, nn.Module) and bool(_our_hooks(model)[0])


def unpatch_hf_model(model):
    """Undo ``patch_hf_model``: removes its hooks and gives the output embedding its
    ``nn.Linear`` class back. A model that is not patched is returned unchanged."""
    inner = _unwrap(model)
    if not isinstance(inner, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    pre, post = _our_hooks(inner)
    for key in pre:
        inner._forward_pre_hooks.pop(key, None)
        inner._forward_pre_hooks_with_kwargs.pop(key, None)
    for key in post:
        inner._forward_hooks.pop(key, None)
        inner._forward_hooks_with_kwargs.pop(key, None)
        inner._forward_hooks_always_called.pop(key, None)
    for module in inner.modules():
        if type(module) is FusedLMHead:
            module.__class__ = nn.Linear
            module.__dict__.pop(CALL_ATTR, None)
    return model


def _refuse(model, what: str):
    return ValueError(f"patch_hf_model: {type(model).__name__} is not supported: {what}")


def _static_checks(model, head):
    if head is None:
        raise _refuse(model, "get_output_embeddings() returned None (no language-modelling head)")
    if type(head) not in (nn.Linear, FusedLMHead):
        raise _refuse(model, f"its output embedding (get_output_embeddings()) is a "
                             f"{type(head).__module__}.{type(head).__qualname__}, expected a plain "
                             f"torch.nn.Linear whose output is the logits")
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise _refuse(model, "encoder-decoder models are not supported (their labels also build "
                             "the decoder inputs, and heads such as BART's add final_logits_bias)")
    for buf_name, _ in model.named_buffers():
        if buf_name.split(".")[-1] == "final_logits_bias":
            raise _refuse(model, f"its logits add a final_logits_bias buffer ({buf_name}) after "
                                 f"the output embedding")
    if getattr(config, "sparse_prediction", False) and \
            getattr(config, "sparse_pred_ignore_index", -100) != -100:
        raise _refuse(model, f"sparse prediction with sparse_pred_ignore_index="
                             f"{config.sparse_pred_ignore_index} (only -100 is supported)")


def _transform_candidate(model):
    """(scale_attr, scale_op, softcap_attr) named by the config, each possibly None."""
    config = getattr(model, "config", None)
    scale_attr = scale_op = None
    for attr, op in _SCALE_ATTRS:
        value = getattr(config, attr, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value != 1:
            scale_attr, scale_op = attr, op
            break
    softcap = getattr(config, _SOFTCAP_ATTR, None)
    return scale_attr, scale_op, (_SOFTCAP_ATTR if softcap is not None else None)


def _apply_transform(model, z, scale_attr, scale_op, softcap_attr):
    config = model.config
    z = z.double()
    if scale_attr is not None:
        s = float(getattr(config, scale_attr))
        z = z * s if scale_op == "mul" else z / s
    if softcap_attr is not None:
        c = float(getattr(config, softcap_attr))
        z = torch.tanh(z / c) * c
    return z


@contextmanager
def _probe_mode(model):
    """eval mode (restoring every module's own flag), no grad, RNG state untouched."""
    flags = [(m, m.training) for m in model.modules()]
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            model.eval()
            yield
    finally:
        for m, flag in flags:
            m.training = flag


def _close(a, b, lowp: bool) -> bool:
    a, b = float(a), float(b)
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    tol = 3e-2 if lowp else 1e-4
    return abs(a - b) <= tol * max(1.0, abs(b))


def _probe_inputs(model, head):
    vocab = head.out_features
    device = head.weight.device
    try:
        emb = model.get_input_embeddings()
    except (NotImplementedError, AttributeError):
        emb = None
    if isinstance(emb, nn.Embedding):
        vocab = min(vocab, emb.num_embeddings)
        device = emb.weight.device
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, vocab, _PROBE_SHAPE, generator=gen).to(device)
    labels = ids.clone()
    labels[:, ::3] = -100
    return ids, labels


def _takes_router_logits(model) -> bool:
    """Whether the model's forward takes ``output_router_logits`` (an MoE model)."""
    try:
        return "output_router_logits" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _router_coef_path(model):
    """The first of ROUTER_COEF_PATHS that holds a number on ``model``, or None."""
    for path in ROUTER_COEF_PATHS:
        try:
            value = attr_path(model, path)
        except AttributeError:
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return path
    return None


@contextmanager
def _probe_router_coef(model, path):
    """The router aux-loss coefficient at ``path`` set to _PROBE_ROUTER_COEF, then restored."""
    if path is None:
        yield
        return
    owner, name = attr_path(model, path[:-1]), path[-1]
    before = getattr(owner, name)
    setattr(owner, name, _PROBE_ROUTER_COEF)
    try:
        yield
    finally:
        setattr(owner, name, before)


def _verify(model, head, spec, lowp):
    """The patch-time self-check (module docstring). Installs the patch on success; raises
    ValueError (model unchanged) on failure."""
    ids, labels = _probe_inputs(model, head)
    # MoE models: every probe outputs the router aux loss, its coefficient set to the probe's
    extra = {"output_router_logits": True} if _takes_router_logits(model) else {}
    coef_path = _router_coef_path(model)
    calls = []
    tmp = head.register_forward_hook(lambda mod, args, out: calls.append((args[0], out)))
    try:
        with _probe_mode(model), _probe_router_coef(model, coef_path):
            try:
                out_plain = model(input_ids=ids, labels=labels, return_dict=True, **extra)
            except Exception as exc:  # noqa: BLE001 - reported to the user as the reason
                raise _refuse(model, f"the patch-time check runs model(input_ids=..., labels=...) "
                                     f"and it raised {type(exc).__name__}: {exc}") from exc
            if len(calls) != 1:
                raise _refuse(model, f"its output embedding ({type(head).__name__}) is called "
                                     f"{len(calls)} times per forward pass, expected exactly once "
                                     f"(the logits are built some other way, e.g. a raw matmul)")
            if not hasattr(out_plain, "keys"):
                raise _refuse(model, f"it returns {type(out_plain).__name__}, expected a "
                                     f"ModelOutput")
            _check_logits(model, out_plain, head, calls[0][1], spec, lowp)
            for label_kw, field in AUX_HEADS:
                if field in out_plain.keys():  # a pretraining head: its loss needs both labels
                    spec.aux = (label_kw, field)
                    extra[label_kw] = torch.zeros(ids.shape[0], dtype=torch.long,
                                                  device=ids.device)
                    out_plain = model(input_ids=ids, labels=labels, return_dict=True, **extra)
            loss_plain = out_plain.loss
            if loss_plain is None:
                raise _refuse(model, "it computes no loss when called with labels")
            if out_plain.get("aux_loss") is not None:  # an MoE model's router loss
                if coef_path is None:
                    names = ", ".join(".".join(path) for path in ROUTER_COEF_PATHS)
                    raise _refuse(model, f"its output carries a router aux_loss but none of "
                                         f"{names} holds the coefficient its loss adds it with")
                spec.router_coef = coef_path
            n_valid = int((labels != -100).sum())
            num_items = torch.tensor(2 * n_valid + 1, device=ids.device)
            try:
                loss_items = model(input_ids=ids, labels=labels, num_items_in_batch=num_items,
                                   return_dict=True, **extra).loss
            except Exception:  # noqa: BLE001 - the model takes no num_items_in_batch
                loss_items = None
            spec.loss_kwargs = loss_items is not None and not _close(loss_items, loss_plain, lowp)
            _install(model, spec)

            def fused(**kw):
                spec.force_fused = True
                try:
                    return model(input_ids=ids, labels=labels, return_dict=True, **extra, **kw)
                finally:
                    spec.force_fused = False

            try:
                out_ours = fused()
            except Exception as exc:  # noqa: BLE001 - reported to the user as the reason
                raise _refuse(model, f"with the fused loss (labels taken out, no logits) the "
                                     f"forward pass raised {type(exc).__name__}: {exc}") from exc
            if set(out_ours.keys()) - set(out_plain.keys()):
                # Models that turn the KV cache off when given labels (BERT/RoBERTa decoders)
                # would build one now that the labels are taken out: do what they do.
                spec.no_cache_with_labels = True
                try:
                    out_retry = fused()
                except Exception:  # noqa: BLE001 - the model takes no use_cache
                    out_retry = None
                if out_retry is None or set(out_retry.keys()) - set(out_plain.keys()):
                    spec.no_cache_with_labels = False
                else:
                    out_ours = out_retry
            ours = out_ours.loss
            ours_items = None if loss_items is None else fused(num_items_in_batch=num_items).loss
            bad = None
            if ours is None or not _close(ours, loss_plain, lowp):
                got = None if ours is None else float(ours)
                bad = f"loss {got} vs the model's {float(loss_plain)}"
            elif ours_items is not None and not _close(ours_items, loss_items, lowp):
                bad = (f"loss with num_items_in_batch {float(ours_items)} vs the model's "
                       f"{float(loss_items)}")
            if bad is not None:
                unpatch_hf_model(model)
                kind = "causal (shifted) LM" if spec.causal else "masked LM"
                what, plus = f"the fused {kind} loss", ""
                if spec.router_coef is not None:
                    coef = ".".join(spec.router_coef)
                    what += (f" + {coef} * aux_loss (the router loss; {coef} set to "
                             f"{_PROBE_ROUTER_COEF} for the check)")
                    plus = " plus that router term"
                raise _refuse(model, f"{what} does not reproduce the model's own loss ({bad}); "
                                     f"its loss is not a plain cross-entropy of the output "
                                     f"embedding's logits{plus}")
    except BaseException:
        if is_patched(model):
            unpatch_hf_model(model)
        raise
    finally:
        tmp.remove()


def _check_logits(model, out, head, head_out, spec, lowp):
    """The output's logits must be the head's output unchanged, or the config's transform."""
    for value in out.values():
        if value is head_out:  # the logits are the head's output itself: no transform
            spec.scale_attr = spec.scale_op = spec.softcap_attr = None
            return
    what = ("its logits are not the output of its output embedding (get_output_embeddings(), "
            f"Linear({head.in_features} -> {head.out_features}))")
    logits = out.get("logits", None)
    if logits is None:
        candidates = [v for v in out.values()
                      if torch.is_tensor(v) and tuple(v.shape) == tuple(head_out.shape)]
        logits = candidates[0] if candidates else None
    if logits is None or tuple(logits.shape) != tuple(head_out.shape):
        got = "no logits" if logits is None else f"logits of shape {tuple(logits.shape)}"
        raise _refuse(model, f"{what}: the model returns {got}, the output embedding gives "
                             f"{tuple(head_out.shape)} (the logits are built another way, e.g. "
                             f"a raw matmul with the input embeddings)")
    want = _apply_transform(model, head_out, spec.scale_attr, spec.scale_op, spec.softcap_attr)
    tol = 2e-2 if lowp else 1e-5
    if not torch.allclose(logits.double(), want, rtol=tol, atol=tol):
        known = [a for a in (spec.scale_attr, spec.softcap_attr) if a]
        detail = f" and the config's {', '.join(known)}" if known else ""
        raise _refuse(model, f"{what}{detail}: the model changes them after the output "
                             f"embedding (e.g. a logit scaling or a bias added after it)")


def _install(model, spec):
    head = output_head(model)
    head.__class__ = FusedLMHead
    head.__dict__[CALL_ATTR] = None
    model.register_forward_pre_hook(FusedLossPreHook(spec), with_kwargs=True)
    model.register_forward_hook(FusedLossPostHook(spec), with_kwargs=True, always_call=True)


def patch_hf_model(model, *, keep_logits: str = "eval"):
    """Make a transformers model compute its LM loss with ``fused_ce.linear_cross_entropy``.

    In place; returns ``model``. Idempotent (patching a patched model only updates
    ``keep_logits``). ``model`` may be a transformers ``PreTrainedModel`` or a PEFT wrapper of one.

    keep_logits:
        ``"eval"`` (default): with labels in training mode the output's logits are ``None`` (never
        computed); without labels, or in eval mode, the model runs exactly as unpatched.
        ``"always"``: the fused loss, and the logits computed as well (for metrics).
        ``"never"``: whenever labels are given, the fused loss and no logits (train and eval).
        Without labels the model always runs as unpatched (generation needs the logits).

    The loss equals the model's own: masked LMs (BERT family, ModernBERT) the mean cross-entropy
    over labels != -100; causal LMs (``model.can_generate()``) HF's ``ForCausalLMLoss`` (shift by
    one, ``shift_labels``, ``ignore_index``, ``num_items_in_batch``); BERT/ALBERT pretraining
    heads add their next-sentence / sentence-order loss. MoE causal LMs (Mixtral, Qwen2/3-MoE,
    OLMoE, DBRX, Jamba, GraniteMoe, PhiMoE, JetMoe, ...) add ``coef * out.aux_loss`` whenever the
    call returns the router load-balancing loss (``output_router_logits`` as argument or in the
    config), exactly as their forward does with labels, ``coef`` read at call time from where the
    model reads it (``model.router_aux_loss_coef``; JetMoe ``model.aux_loss_coef``; VL MoE heads
    ``model.config.text_config.router_aux_loss_coef``); a model that adds it any other way is
    refused. ``return_dict=False`` gives a tuple with the loss first (see below for the other
    positions). Labels must be passed as the ``labels=`` keyword (positional labels run the
    model unpatched). Models whose head does more than an ``nn.Linear`` (beyond a softcap or scale
    read from the config) are refused with a ``ValueError``.

    Token statistics (``out.fused_ce_stats``): whenever a call takes the fused path (labels given,
    and training mode or ``keep_logits`` ``"always"``/``"never"``) and returns a ``ModelOutput``,
    that output carries the head's :class:`fused_ce.LinearCrossEntropyStats` as the plain
    attribute ``fused_ce_stats``, computed in the same pass as the loss. It is not a key of the
    output; apart from it the output is the unpatched model's with the logits set to ``None``.
    A ``ModelOutput`` leaves ``None`` fields out of ``keys()``, ``to_tuple()`` and integer
    indexing, so ``"logits"`` is not a key and every later position moves up one: Llama's
    ``return_dict=False`` tuple in training is ``(loss, logits, cache)`` unpatched and
    ``(loss, cache)`` patched, and ``out[1]`` of a patched ``ModelOutput`` is the cache. Where
    positions matter, use ``return_dict=True`` and field names (``out.logits`` is ``None``), or
    ``keep_logits="always"``, whose outputs keep the unpatched model's fields and positions. Calls
    that run unpatched (no labels; eval mode with ``keep_logits="eval"``; a pretraining head
    without its second label) return outputs with *no* such attribute, and ``return_dict=False``
    tuples never carry it, so read it with ``getattr(out, "fused_ce_stats", None)``. Fields:

    * per token, with the shape of the labels the loss used (``labels``, or ``shift_labels`` when
      a causal LM is given them), no gradient: entry ``[..., t]`` is about the logits at position
      ``t`` (``logits[..., t, :]`` of the unpatched model, after any softcap/scale), scored
      against ``target[..., t]``, where ``target`` is ``labels`` for masked LMs and, for causal
      LMs, ``labels`` shifted left by one (``target[..., t] = labels[..., t + 1]``; the last
      position has no target and counts as ignored) or ``shift_labels`` as given.
      ``lse`` = logsumexp of those logits, ``predicted`` = their argmax (ties to the lowest id,
      like ``torch.argmax``), ``correct`` = ``predicted == target``. Positions whose target is the
      ignore index (-100, or the ``ignore_index=`` keyword of causal LMs) have ``lse`` 0,
      ``predicted`` = the ignore index and ``correct`` False (the fused pass skips them).
    * ``accuracy``: ``correct.sum() / (number of non-ignored targets)`` of this call (nan if
      none), a 0-dim tensor; ``num_items_in_batch`` does not change it. For gradient accumulation
      sum ``correct`` and the non-ignored counts over micro-batches instead.
    * ``loss``: the LM loss itself (the same tensor as ``out.loss``, with its gradient, including
      the division by ``num_items_in_batch``), except where ``out.loss`` adds another term that
      ``fused_ce_stats.loss`` does not: BERT/ALBERT pretraining heads' next-sentence /
      sentence-order loss, MoE models' ``coef * aux_loss``. ``z_loss`` is None.

    The attribute lives on that output object only (no module keeps a reference; the model stays
    picklable). Wrappers that rebuild the output from its fields drop it (e.g. DDP with
    ``find_unused_parameters=True``, which re-creates the output through torch's pytree);
    ``torch.compile`` keeps it.
    """
    if isinstance(keep_logits, bool) or keep_logits not in KEEP_LOGITS:
        raise ValueError(f"keep_logits: expected one of {', '.join(map(repr, KEEP_LOGITS))}, "
                         f"got {keep_logits!r}")
    inner = _unwrap(model)
    if not isinstance(inner, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module (a transformers model), got "
                        f"{type(model).__name__}")
    if not callable(getattr(inner, "get_output_embeddings", None)):
        raise TypeError(f"model: expected a transformers PreTrainedModel with "
                        f"get_output_embeddings(), got {type(inner).__name__}")
    if is_patched(inner):
        pre, _ = _our_hooks(inner)
        inner._forward_pre_hooks[pre[0]].spec.keep_logits = keep_logits
        head = output_head(inner)
        if type(head) is nn.Linear:
            head.__class__ = FusedLMHead
        return model
    head = output_head(inner)
    _static_checks(inner, head)
    can_generate = getattr(inner, "can_generate", None)
    causal = bool(can_generate()) if callable(can_generate) else False
    scale_attr, scale_op, softcap_attr = _transform_candidate(inner)
    spec = FusedLossSpec(causal=causal, loss_kwargs=causal, softcap_attr=softcap_attr,
                         scale_attr=scale_attr, scale_op=scale_op, aux=None,
                         keep_logits=keep_logits)
    params = list(inner.parameters())
    if any(p.device.type == "meta" for p in params):
        raise ValueError(f"model: expected materialized parameters, got {type(inner).__name__} "
                         f"with parameters on the meta device; patch_hf_model verifies the model "
                         f"with a tiny forward pass, so patch it after loading its weights")
    lowp = any(p.dtype not in (torch.float32, torch.float64) for p in params
               if p.is_floating_point()) or any(
        torch.is_autocast_enabled(t) for t in ("cpu", "cuda"))
    _verify(inner, head, spec, lowp)
    return model
