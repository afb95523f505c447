"""fused_ce.patch_hf_model against the unpatched model as the oracle.

Every model is a tiny random config built here (no download). Each test builds a twin with
``copy.deepcopy`` before patching and checks that the patched model's loss and every parameter
gradient match the twin's (fp32: 1e-5 relative), and that the logits are never built in training.
"""

from __future__ import annotations

import copy
import functools
import io
import os
import pickle
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")
import transformers as T  # noqa: E402

import fused_ce  # noqa: E402
from fused_ce.integrations import hf as fhf  # noqa: E402
from fused_ce.integrations._hf_heads import FusedLMHead  # noqa: E402

V = 97  # odd vocabulary, not a multiple of anything
H = 32
B, S = 3, 11

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core CI machine spinning
    OpenMP threads cost 3x the CPU time. Restored after this module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------- tiny models
def _bert_kw(**kw):
    return dict(vocab_size=V, hidden_size=H, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=37, max_position_embeddings=64, **kw)


def _llama_kw(**kw):
    return dict(vocab_size=V, hidden_size=H, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=37, max_position_embeddings=64, **kw)


_BUILDERS = {
    "BertForMaskedLM": lambda tie: T.BertForMaskedLM(
        T.BertConfig(**_bert_kw(tie_word_embeddings=tie))),
    "BertForPreTraining": lambda tie: T.BertForPreTraining(
        T.BertConfig(**_bert_kw(tie_word_embeddings=tie))),
    "BertLMHeadModel": lambda tie: T.BertLMHeadModel(
        T.BertConfig(**_bert_kw(is_decoder=True, tie_word_embeddings=tie))),
    "RobertaForMaskedLM": lambda tie: T.RobertaForMaskedLM(T.RobertaConfig(
        **_bert_kw(tie_word_embeddings=tie, pad_token_id=1))),
    "RobertaForCausalLM": lambda tie: T.RobertaForCausalLM(T.RobertaConfig(
        **_bert_kw(is_decoder=True, tie_word_embeddings=tie, pad_token_id=1))),
    "DistilBertForMaskedLM": lambda tie: T.DistilBertForMaskedLM(T.DistilBertConfig(
        vocab_size=V, dim=H, n_layers=2, n_heads=2, hidden_dim=37, max_position_embeddings=64,
        tie_word_embeddings=tie)),
    "AlbertForMaskedLM": lambda tie: T.AlbertForMaskedLM(T.AlbertConfig(
        vocab_size=V, embedding_size=16, hidden_size=H, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=37, max_position_embeddings=64, tie_word_embeddings=tie)),
    "AlbertForPreTraining": lambda tie: T.AlbertForPreTraining(T.AlbertConfig(
        vocab_size=V, embedding_size=16, hidden_size=H, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=37, max_position_embeddings=64, tie_word_embeddings=tie)),
    "ElectraForMaskedLM": lambda tie: T.ElectraForMaskedLM(T.ElectraConfig(
        vocab_size=V, embedding_size=16, hidden_size=H, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=37, max_position_embeddings=64, tie_word_embeddings=tie)),
    "ModernBertForMaskedLM": lambda tie: T.ModernBertForMaskedLM(T.ModernBertConfig(
        **_modernbert_kw(tie))),
    "ModernBertForMaskedLM-sparse": lambda tie: T.ModernBertForMaskedLM(T.ModernBertConfig(
        **_modernbert_kw(tie), sparse_prediction=True)),
    "LlamaForCausalLM": lambda tie: T.LlamaForCausalLM(
        T.LlamaConfig(**_llama_kw(tie_word_embeddings=tie))),
    "MistralForCausalLM": lambda tie: T.MistralForCausalLM(T.MistralConfig(
        **_llama_kw(tie_word_embeddings=tie))),
    "Qwen2ForCausalLM": lambda tie: T.Qwen2ForCausalLM(
        T.Qwen2Config(**_llama_kw(tie_word_embeddings=tie))),
    "Qwen3ForCausalLM": lambda tie: T.Qwen3ForCausalLM(T.Qwen3Config(
        **_llama_kw(tie_word_embeddings=tie, head_dim=8))),
    "GPT2LMHeadModel": lambda tie: T.GPT2LMHeadModel(T.GPT2Config(
        vocab_size=V, n_embd=H, n_layer=2, n_head=2, n_positions=64, tie_word_embeddings=tie)),
    "Gemma2ForCausalLM": lambda tie: T.Gemma2ForCausalLM(T.Gemma2Config(
        **_llama_kw(tie_word_embeddings=tie, head_dim=8, final_logit_softcapping=2.0))),
    # Heads that scale their logits, handled exactly (config-named scale verified at patch time).
    "CohereForCausalLM": lambda tie: T.CohereForCausalLM(T.CohereConfig(
        **_llama_kw(tie_word_embeddings=tie, logit_scale=0.37))),
    "GraniteForCausalLM": lambda tie: T.GraniteForCausalLM(T.GraniteConfig(
        **_llama_kw(tie_word_embeddings=tie, logits_scaling=3.0))),
    # MoE: the loss adds router_aux_loss_coef * aux_loss whenever the router logits are output
    # (Qwen2-MoE by its config here: always; Mixtral only when called with the argument)
    "MixtralForCausalLM": lambda tie, coef=0.02, router=False: T.MixtralForCausalLM(
        T.MixtralConfig(**_moe_kw(tie, coef, router), num_local_experts=4, num_experts_per_tok=2)),
    "Qwen2MoeForCausalLM": lambda tie, coef=0.02, router=True: T.Qwen2MoeForCausalLM(
        T.Qwen2MoeConfig(**_moe_kw(tie, coef, router), num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=16, shared_expert_intermediate_size=24)),
}


def _moe_kw(tie, coef, router):
    return dict(_llama_kw(tie_word_embeddings=tie), intermediate_size=32,
                router_aux_loss_coef=coef, output_router_logits=router)


def _modernbert_kw(tie):
    return dict(vocab_size=V, hidden_size=H, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=37, max_position_embeddings=64, pad_token_id=0,
                bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
                local_attention=8, tie_word_embeddings=tie)


MODELS = list(_BUILDERS)
# the model families the issue lists, for the round-trip/compile/... tests on a subset
MASKED_EXAMPLE = "BertForMaskedLM"
CAUSAL_EXAMPLE = "LlamaForCausalLM"


def build(name, tie=True, seed=0, **kw):
    torch.manual_seed(seed)
    model = _BUILDERS[name](tie, **kw)
    model.train()
    # random biases (zero at init) so that a mishandled bias shows
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.5, 0.5)
    return model


def is_causal(model):
    return fhf._unwrap(model).can_generate()


def batch(model, *, ignored=True, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, S), generator=g)
    labels = ids.clone() if is_causal(model) else torch.randint(0, V, (B, S), generator=g)
    if ignored:
        labels[torch.rand(B, S, generator=g) < 0.4] = -100
        labels[0, 1] = 5  # at least one valid label
    kw = dict(input_ids=ids.to(device), labels=labels.to(device))
    name = type(fhf._unwrap(model)).__name__
    if name == "BertForPreTraining":
        kw["next_sentence_label"] = torch.tensor([0, 1, 1], device=device)
    if name == "AlbertForPreTraining":
        kw["sentence_order_label"] = torch.tensor([1, 0, 1], device=device)
    return kw


@functools.lru_cache(maxsize=None)
def _pristine_twin(name, tie, keep_logits):
    ref = build(name, tie)
    model = copy.deepcopy(ref)
    assert fused_ce.patch_hf_model(model, keep_logits=keep_logits) is model
    return ref, model


def twin(name, tie=True, keep_logits="eval"):
    """(unpatched model, patched deepcopy of it). Patched once per configuration; each test gets
    fresh deep copies of the pair (a deepcopy of a patched model is itself patched: tested)."""
    ref, model = _pristine_twin(name, tie, keep_logits)
    ref, model = copy.deepcopy(ref), copy.deepcopy(model)
    assert fused_ce.is_patched(model) and not fused_ce.is_patched(ref)
    return ref, model


def run(model, kw, seed=7):
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)  # same dropout masks in both twins
    out = model(**kw)
    loss = out["loss"] if isinstance(out, dict) else out[0]
    loss.backward()
    return out, loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def assert_close_loss(ours, ref, rtol=1e-5):
    assert ours.shape == ref.shape
    assert torch.allclose(ours.double(), ref.double(), rtol=rtol, atol=rtol * 1e-2), (ours, ref)


def assert_grads_equal(g_ours, g_ref, rtol=1e-5):
    """Every gradient within rtol relative to its own scale, or to 1e-3 of the model's largest
    gradient where that is larger: gradients that are exactly zero in exact arithmetic
    (attention key biases without rotary embeddings, ~1e-12 here) or small by cancellation
    (key biases under RoPE, a sum of rotated copies over positions: Qwen2's second layer
    2.5e-5, 1.6e-4 of the largest, with fp32 noise of 1.3e-5 of their own size under
    transformers 5.25) carry only the rounding noise of the terms they sum."""
    assert g_ours.keys() == g_ref.keys()
    scale = max(g.abs().max().item() for g in g_ref.values() if g is not None)
    for name, ref in g_ref.items():
        ours = g_ours[name]
        if ref is None:
            assert ours is None, name
            continue
        assert ours is not None, f"{name}: no gradient in the patched model"
        tol = rtol * max(ref.abs().max().item(), 1e-3 * scale)
        err = (ours.double() - ref.double()).abs().max().item()
        assert err <= tol, f"{name}: max error {err:.3g} > {tol:.3g}"


def assert_same_step(ref, model, kw):
    """One training step of the unpatched twin and the patched one: the same loss and grads."""
    _, loss_ref, g_ref = run(ref, kw)
    _, loss, g = run(model, kw)
    assert_close_loss(loss, loss_ref)
    assert_grads_equal(g, g_ref)


class NoLogits(TorchDispatchMode):
    """Records every top-level op output with the vocabulary as its last dimension and more than
    one row: a logits-shaped tensor."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == V and \
                    t.numel() // V > 2:
                self.seen.append((str(func), tuple(t.shape)))
        return out


# ----------------------------------------------------------------------------- equality
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("name", MODELS)
def test_loss_and_every_gradient_match(name, tie):
    ref, model = twin(name, tie)
    if tie and hasattr(ref.config, "tie_word_embeddings"):
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    kw = batch(ref)
    if name == MODELS[0] and tie:
        with NoLogits() as mode_ref:  # the detector sees the unpatched model's logits
            run(ref, kw)
        assert mode_ref.seen
    out_ref, loss_ref, g_ref = run(ref, kw)
    with NoLogits() as mode:
        out, loss, g = run(model, kw)
    assert not mode.seen, f"logits-shaped tensors built in training: {mode.seen[:3]}"
    assert_close_loss(loss, loss_ref)
    assert_grads_equal(g, g_ref)
    assert out.loss.dtype == torch.float32
    logits_key = "prediction_logits" if "PreTraining" in name else "logits"
    assert out_ref[logits_key] is not None and getattr(out, logits_key) is None
    assert list(out.keys())[0] == "loss"
    assert set(out.keys()) == set(out_ref.keys()) - {logits_key}  # e.g. no KV cache built
    # everything else the model returns is unchanged (e.g. BERT's next-sentence logits)
    for key, value in out.items():
        if key != "loss" and torch.is_tensor(value):
            assert torch.allclose(value, out_ref[key], rtol=1e-5, atol=1e-6), key


@pytest.mark.parametrize("name", ["BertForMaskedLM", "ModernBertForMaskedLM", "LlamaForCausalLM",
                                  "GPT2LMHeadModel", "Gemma2ForCausalLM", "BertLMHeadModel"])
def test_num_items_in_batch(name):
    """Causal LMs (and ModernBERT, which uses HF's loss_function) divide the sum by
    num_items_in_batch; BERT's plain CrossEntropyLoss ignores it. Either way: as the model does."""
    ref, model = twin(name)
    kw = batch(ref)
    for num_items in (torch.tensor(23), 17):
        kw["num_items_in_batch"] = num_items
        assert_same_step(ref, model, kw)


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "Qwen3ForCausalLM", "RobertaForCausalLM"])
def test_shift_labels(name):
    ref, model = twin(name)
    kw = batch(ref)
    g = torch.Generator().manual_seed(3)
    shift = torch.randint(0, V, (B, S), generator=g)
    shift[:, -1] = -100
    shift[1, :4] = -100
    kw["shift_labels"] = shift
    kw["num_items_in_batch"] = torch.tensor(19)
    assert_same_step(ref, model, kw)


def test_ignore_index_kwarg():
    """HF's causal loss takes ignore_index from the kwargs (the pad of the shift uses it too)."""
    ref, model = twin("Qwen2ForCausalLM")
    kw = batch(ref, ignored=False)
    kw["labels"][:, ::3] = -1
    kw["ignore_index"] = -1
    assert_same_step(ref, model, kw)


@pytest.mark.parametrize("name", ["BertForMaskedLM", "BertForPreTraining", "LlamaForCausalLM"])
def test_return_dict_false(name):
    ref, model = twin(name)
    kw = batch(ref)
    kw["return_dict"] = False
    out_ref, loss_ref, g_ref = run(ref, kw)
    out, loss, g = run(model, kw)
    assert isinstance(out, tuple)
    assert_close_loss(out[0], out_ref[0])
    assert_grads_equal(g, g_ref)
    # the ModelOutput convention: None fields are dropped, so the logits (entry 1) are gone
    assert len(out) == len(out_ref) - 1
    for a, b in zip(out[1:], out_ref[2:]):
        if torch.is_tensor(a):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_return_dict_false_in_config():
    ref = build("BertForMaskedLM")
    ref.config.return_dict = False
    model = copy.deepcopy(ref)
    fused_ce.patch_hf_model(model)
    kw = batch(ref)
    out_ref, _, g_ref = run(ref, kw)
    out, _, g = run(model, kw)
    assert isinstance(out, tuple) and len(out) == len(out_ref) - 1
    assert_close_loss(out[0], out_ref[0])
    assert_grads_equal(g, g_ref)


def test_config_transform_the_model_does_not_apply_is_ignored():
    """A config attribute alone decides nothing: Llama does not softcap, whatever its config says."""
    torch.manual_seed(0)
    ref = T.LlamaForCausalLM(T.LlamaConfig(**_llama_kw(final_logit_softcapping=1.5)))
    model = fused_ce.patch_hf_model(copy.deepcopy(ref))
    kw = batch(ref)
    assert_same_step(ref, model, kw)


def test_all_labels_ignored_is_nan_like_torch():
    for name in ("BertForMaskedLM", "LlamaForCausalLM"):
        ref, model = twin(name)
        kw = batch(ref)
        kw["labels"][:] = -100
        torch.manual_seed(0)
        loss_ref = ref(**kw).loss
        torch.manual_seed(0)
        loss = model(**kw).loss
        assert torch.isnan(loss_ref) and torch.isnan(loss)


def test_pretraining_without_next_sentence_label_is_unchanged():
    """BertForPreTraining computes no loss unless both label kinds are given: neither do we."""
    ref, model = twin("BertForPreTraining")
    kw = batch(ref)
    del kw["next_sentence_label"]
    torch.manual_seed(0)
    out_ref = ref(**kw)
    torch.manual_seed(0)
    out = model(**kw)
    assert out_ref.loss is None and out.loss is None
    assert torch.allclose(out.prediction_logits, out_ref.prediction_logits)


# ----------------------------------------------------------------------------- MoE router loss
MOE = ["MixtralForCausalLM", "Qwen2MoeForCausalLM"]


@pytest.mark.parametrize("coef", [0.02, 1e-4])
@pytest.mark.parametrize("router", ["argument", "config"])
@pytest.mark.parametrize("name", MOE)
def test_moe_router_aux_loss(name, router, coef):
    """MoE causal LMs: with the router logits output (call argument or config) HF's forward adds
    router_aux_loss_coef * aux_loss to the loss when given labels; so does the patched model: the
    same loss and every gradient (the routers' included), -100 labels present. The term itself is
    checked against fused_ce_stats.loss (the LM part alone), so a dropped term fails even at
    coefficient 1e-4; the coefficient is read at call time, and none is added when the call
    turns the router logits off."""
    ref = build(name, coef=coef, router=router == "config")
    model = fused_ce.patch_hf_model(copy.deepcopy(ref))
    # the patch-time check sets the coefficient for its probe and puts it back
    assert model.router_aux_loss_coef == model.config.router_aux_loss_coef == coef
    kw = batch(ref)
    if router == "argument":
        kw["output_router_logits"] = True
    out_ref, loss_ref, g_ref = run(ref, kw)
    with NoLogits() as mode:
        out, loss, g = run(model, kw)
    assert not mode.seen and out.logits is None and out_ref.aux_loss is not None
    assert torch.allclose(out.aux_loss, out_ref.aux_loss, rtol=1e-6, atol=0)
    assert_close_loss(loss, loss_ref)
    assert_grads_equal(g, g_ref)
    term = loss - out.fused_ce_stats.loss.detach()
    assert torch.allclose(term, coef * out.aux_loss.detach(), rtol=0, atol=1e-6), term
    kw["output_router_logits"] = False  # no router logits: no aux loss, none added
    out_ref, loss_ref, _ = run(ref, kw)
    out, loss, _ = run(model, kw)
    assert out.aux_loss is None and out_ref.aux_loss is None
    assert_close_loss(loss, loss_ref)
    for m in (ref, model):  # read at call time, also with num_items_in_batch
        m.router_aux_loss_coef = 0.3
    kw.update(output_router_logits=True, num_items_in_batch=torch.tensor(23))
    assert_same_step(ref, model, kw)


_MOE_COEF_ELSEWHERE = {
    # self.aux_loss_coef
    "JetMoeForCausalLM": lambda: T.JetMoeForCausalLM(T.JetMoeConfig(
        vocab_size=V, hidden_size=H, num_hidden_layers=2, num_key_value_heads=2, kv_channels=8,
        intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, aux_loss_coef=0.02)),
    # self.router_aux_loss_coef = config.ffn_config.moe_loss_weight
    "DbrxForCausalLM": lambda: T.DbrxForCausalLM(T.DbrxConfig(
        d_model=H, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=V,
        attn_config=dict(kv_n_heads=2, rope_theta=1e4, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2,
                        moe_loss_weight=0.02))),
    # with the logits divided by logits_scaling
    "GraniteMoeForCausalLM": lambda: T.GraniteMoeForCausalLM(T.GraniteMoeConfig(
        **_moe_kw(True, 0.02, True), num_local_experts=4, num_experts_per_tok=2,
        logits_scaling=3.0)),
}


@pytest.mark.parametrize("name", list(_MOE_COEF_ELSEWHERE))
def test_moe_families(name):
    """Other MoE families: JetMoe keeps its coefficient as aux_loss_coef, DBRX as
    ffn_config.moe_loss_weight (copied to router_aux_loss_coef), GraniteMoe scales its logits."""
    torch.manual_seed(0)
    ref = _MOE_COEF_ELSEWHERE[name]().train()
    model = fused_ce.patch_hf_model(copy.deepcopy(ref))
    kw = dict(batch(ref), output_router_logits=True)
    out, _, _ = run(model, kw)
    assert out.logits is None and out.aux_loss is not None
    assert_same_step(ref, model, kw)


# ----------------------------------------------------------------------------- keep_logits
@pytest.mark.parametrize("name", ["BertForMaskedLM", "Gemma2ForCausalLM"])
def test_eval_and_no_label_logits_equal(name):
    ref, model = twin(name)
    kw = batch(ref)
    ref.eval()
    model.eval()
    with torch.no_grad():
        out_ref, out = ref(**kw), model(**kw)
        assert_close_loss(out.loss, out_ref.loss)
        assert torch.equal(out.logits, out_ref.logits)
        ids = kw["input_ids"]
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    ref.train()
    model.train()
    torch.manual_seed(0)
    a = ref(input_ids=ids).logits
    torch.manual_seed(0)
    b = model(input_ids=ids).logits
    assert torch.equal(a, b)  # no labels in training: logits as before


@pytest.mark.parametrize("name", ["BertForMaskedLM", "LlamaForCausalLM"])
def test_keep_logits_always(name):
    ref, model = twin(name, keep_logits="always")
    kw = batch(ref)
    out_ref, loss_ref, g_ref = run(ref, kw)
    out, loss, g = run(model, kw)
    assert_close_loss(loss, loss_ref)
    assert_grads_equal(g, g_ref)
    assert torch.allclose(out.logits, out_ref.logits, rtol=1e-6, atol=1e-6)
    kw["return_dict"] = False
    out = run(model, kw)[0]
    assert len(out) == len(run(ref, kw)[0]) and out[1].shape[-1] == V


def test_keep_logits_never_and_validation():
    ref, model = twin("LlamaForCausalLM", keep_logits="never")
    kw = batch(ref)
    ref.eval()
    model.eval()
    with torch.no_grad():
        out_ref, out = ref(**kw), model(**kw)
    assert out.logits is None and out_ref.logits is not None
    assert_close_loss(out.loss, out_ref.loss)
    with torch.no_grad():  # without labels the model is unchanged, even with "never"
        assert torch.equal(model(input_ids=kw["input_ids"]).logits,
                           ref(input_ids=kw["input_ids"]).logits)
    fresh = build("LlamaForCausalLM")
    for bad in ("train", None, True, 1):
        with pytest.raises(ValueError, match=r"keep_logits: expected one of 'eval', 'always', "
                                             r"'never', got " + repr(bad).replace("(", r"\(")):
            fused_ce.patch_hf_model(fresh, keep_logits=bad)
    assert not fused_ce.is_patched(fresh)


@pytest.mark.parametrize("keep_logits", ["eval", "never"])
def test_generate_unchanged(keep_logits):
    ref, model = twin("GPT2LMHeadModel", keep_logits=keep_logits)
    ids = batch(ref)["input_ids"][:, :4]
    for m in (ref, model):
        m.eval()
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))


def test_patch_is_idempotent_and_updates_keep_logits():
    ref, model = twin("BertForMaskedLM")
    keys = list(model.state_dict().keys())
    fused_ce.patch_hf_model(model)
    fused_ce.patch_hf_model(model, keep_logits="always")
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1
    assert list(model.state_dict().keys()) == keys == list(ref.state_dict().keys())
    out, loss, _ = run(model, batch(ref))
    assert out.logits is not None
    assert_close_loss(loss, run(ref, batch(ref))[1])


# ----------------------------------------------------------------------------- fused_ce_stats
def _stats_from_logits(logits, target, ignore_index=-100):
    """What out.fused_ce_stats must hold, from explicit logits and the loss's (shifted) target."""
    logits = logits.detach()
    valid = target != ignore_index
    argmax = logits.argmax(-1)
    predicted = torch.where(valid, argmax, ignore_index)
    correct = (argmax == target) & valid
    lse = torch.where(valid, logits.double().logsumexp(-1), 0.0)
    return predicted, correct, correct.sum() / valid.sum(), lse


def assert_stats_match(stats, logits, target):
    predicted, correct, accuracy, lse = _stats_from_logits(logits, target)
    assert stats.predicted.shape == stats.correct.shape == stats.lse.shape == target.shape
    assert stats.predicted.dtype == torch.int64 and stats.correct.dtype == torch.bool
    assert torch.equal(stats.predicted, predicted)
    assert torch.equal(stats.correct, correct)
    assert stats.accuracy.dim() == 0 and abs(stats.accuracy.item() - accuracy.item()) < 1e-6
    assert torch.allclose(stats.lse.double(), lse, rtol=1e-5, atol=1e-5)
    assert not stats.lse.requires_grad and stats.z_loss is None


def test_stats_masked_lm_with_ties():
    """BERT MLM: per-token stats in the labels' layout, against argmax/logsumexp of the twin's
    logits; two vocabulary entries with identical logits (zero weight rows, equal bias: an exact
    tie) are predicted as the lower id, like torch.argmax, so a label on the higher one is wrong."""
    ref, model = twin(MASKED_EXAMPLE)
    lo, hi = 7, 40
    logits = run(ref, batch(ref))[0].logits.detach()
    for m in (ref, model):  # tie lo and hi, as the largest logit of about half the positions
        head = m.get_output_embeddings()
        with torch.no_grad():
            head.weight[[lo, hi]] = 0.0
            head.bias[[lo, hi]] = logits.max(-1).values.median()
    kw = batch(ref)
    logits = run(ref, kw)[0].logits.detach()
    pred = logits.argmax(-1)
    assert torch.equal(logits[..., lo], logits[..., hi])
    labels = kw["labels"]
    g = torch.Generator().manual_seed(4)
    take = (labels != -100) & (torch.rand(labels.shape, generator=g) < 0.5)
    labels[take] = pred[take]  # some correct predictions
    wrong_tie = (labels != -100) & ~take & (pred == lo)
    labels[wrong_tie] = hi  # the tie's other id: must count as wrong
    assert wrong_tie.any() and take.any() and (pred[labels != -100] != lo).any()
    out_ref, loss_ref, _ = run(ref, kw)
    out, loss, _ = run(model, kw)
    assert out.logits is None and "fused_ce_stats" not in out.keys()
    stats = out.fused_ce_stats
    assert_stats_match(stats, out_ref.logits, labels)
    assert 0 < stats.accuracy.item() < 1 and not stats.correct[wrong_tie].any()
    assert stats.loss is out.loss and stats.loss.requires_grad
    assert_close_loss(loss, loss_ref)


def test_stats_causal_lm_shift_ties_and_num_items():
    """Llama: stats[b, t] are about logits[b, t] scored against labels[b, t + 1] (the last
    position has no target: ignored), or against shift_labels[b, t] when given; a tie between two
    identical head rows goes to the lower id; loss = out.loss, also with num_items_in_batch."""
    ref, model = twin(CAUSAL_EXAMPLE)
    lo, hi = 11, 60
    for m in (ref, model):
        w = m.get_output_embeddings().weight
        with torch.no_grad():
            w[lo] *= 4
            w[hi] = w[lo]
    kw = batch(ref)
    logits = run(ref, kw)[0].logits.detach()
    pred = logits.argmax(-1)
    assert torch.equal(logits[..., lo], logits[..., hi]) and (pred == lo).any()
    labels = kw["labels"]
    labels[:, 1:][labels[:, 1:] != -100] = pred[:, :-1][labels[:, 1:] != -100]  # all correct...
    labels[:, 1:][(labels[:, 1:] == lo)] = hi  # ...but the tie's other id
    labels[:, 1::4] = -100
    labels[0, 3] = 5
    kw["num_items_in_batch"] = torch.tensor(23)
    out_ref, loss_ref, _ = run(ref, kw)
    out, loss, _ = run(model, kw)
    target = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    stats = out.fused_ce_stats
    assert_stats_match(stats, out_ref.logits, target)
    assert (stats.predicted[:, -1] == -100).all() and (stats.lse[:, -1] == 0).all()
    assert 0 < stats.accuracy.item() < 1 and (stats.predicted == lo).any()
    assert stats.loss is out.loss
    assert_close_loss(loss, loss_ref)
    shift = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(3))
    shift[:, ::3] = -100
    shift[1, 2] = pred[1, 2]
    kw["shift_labels"] = shift
    out_ref, loss_ref, _ = run(ref, kw)
    out, loss, _ = run(model, kw)
    assert_stats_match(out.fused_ce_stats, out_ref.logits, shift)
    assert_close_loss(loss, loss_ref)


def test_stats_only_on_fused_model_outputs_and_no_state_left():
    """Pretraining: the MLM head's stats (loss without the next-sentence part); tuple outputs
    and calls that run unpatched (eval, no labels) have no attribute; nothing stays on a module."""
    ref, model = twin("BertForPreTraining")
    kw = batch(ref)
    out_ref, loss_ref, _ = run(ref, kw)
    out, loss, _ = run(model, kw)
    assert_close_loss(loss, loss_ref)
    assert_stats_match(out.fused_ce_stats, out_ref.prediction_logits, kw["labels"])
    mlm = nn.functional.cross_entropy(out_ref.prediction_logits.reshape(-1, V),
                                      kw["labels"].reshape(-1))
    assert_close_loss(out.fused_ce_stats.loss.detach(), mlm.detach())
    assert len(out.to_tuple()) == len(out_ref.to_tuple()) - 1
    head = model.get_output_embeddings()
    assert head.__dict__["_fused_ce_call"] is None
    assert not any(isinstance(v, fused_ce.LinearCrossEntropyStats)
                   for m in model.modules() for v in vars(m).values())
    kw_tuple = dict(kw, return_dict=False)
    out = model(**kw_tuple)
    assert isinstance(out, tuple) and not hasattr(out, "fused_ce_stats")
    copy_ = pickle.loads(pickle.dumps(model))  # after calls: still picklable, still patched
    assert run(copy_, kw)[0].fused_ce_stats is not None
    model.eval()
    with torch.no_grad():
        assert not hasattr(model(**kw), "fused_ce_stats")  # keep_logits="eval": unpatched run
        assert not hasattr(model(input_ids=kw["input_ids"]), "fused_ce_stats")


# ----------------------------------------------------------------------------- persistence
def _roundtrips(model):
    yield "deepcopy", copy.deepcopy(model)
    yield "pickle", pickle.loads(pickle.dumps(model))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    yield "torch.save", torch.load(buf, weights_only=False)


@pytest.mark.parametrize("name", [MASKED_EXAMPLE, CAUSAL_EXAMPLE, "BertForPreTraining"])
def test_deepcopy_pickle_torch_save_keep_the_patch(name):
    ref, model = twin(name)
    kw = batch(ref)
    _, loss_ref, g_ref = run(ref, kw)
    for how, copy_ in _roundtrips(model):
        assert fused_ce.is_patched(copy_), how
        assert type(copy_.get_output_embeddings()) is FusedLMHead, how
        if "Bert" in name:  # weight tying survives
            assert copy_.get_output_embeddings().weight is copy_.get_input_embeddings().weight
        with NoLogits() as mode:
            out, loss, g = run(copy_, kw)
        assert not mode.seen, how
        assert_close_loss(loss, loss_ref)
        assert_grads_equal(g, g_ref)
        assert out.logits is None if "PreTraining" not in name else out.prediction_logits is None


def test_save_pretrained_round_trip(tmp_path):
    """save_pretrained sees the unchanged state_dict and architecture name; the reloaded model is
    a plain (unpatched) model with the same weights."""
    ref, model = twin("BertForMaskedLM")
    model.save_pretrained(tmp_path)
    loaded = T.BertForMaskedLM.from_pretrained(tmp_path)
    assert loaded.config.architectures == ["BertForMaskedLM"] and not fused_ce.is_patched(loaded)
    ref_state = ref.state_dict()
    assert loaded.state_dict().keys() == ref_state.keys()
    assert all(torch.equal(v, ref_state[k]) for k, v in loaded.state_dict().items())


def test_unpatch_restores_exactly():
    ref, model = twin("BertForMaskedLM")
    head = model.get_output_embeddings()
    assert fused_ce.unpatch_hf_model(model) is model
    assert not fused_ce.is_patched(model)
    assert type(head) is nn.Linear and "_fused_ce_call" not in head.__dict__
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert list(model.state_dict().keys()) == list(ref.state_dict().keys())
    kw = batch(ref)
    out_ref, loss_ref, g_ref = run(ref, kw)
    out, loss, g = run(model, kw)
    assert torch.equal(loss, loss_ref)
    assert torch.equal(out.logits, out_ref.logits)
    assert_grads_equal(g, g_ref, rtol=0)
    fused_ce.unpatch_hf_model(model)  # unpatching an unpatched model is a no-op
    assert type(head) is nn.Linear


def test_reads_weights_at_call_time():
    """Weight swaps, dtype casts and a replaced head (resize_token_embeddings) after patching."""
    ref, model = twin("LlamaForCausalLM", tie=False)
    new = torch.randn(V, H) * 0.1
    for m in (ref, model):
        m.get_output_embeddings().weight = nn.Parameter(new.clone())
        m.double()
    kw = batch(ref)
    _, loss_ref, g_ref = run(ref, kw)
    _, loss, g = run(model, kw)
    assert loss.dtype == torch.float64  # (HF's loss upcasts the logits "to float": fp32)
    assert_close_loss(loss, loss_ref, rtol=1e-6)
    assert_grads_equal(g, g_ref)
    for m in (ref, model):
        m.float()
        m.resize_token_embeddings(V + 6)
    assert type(model.get_output_embeddings()) is nn.Linear  # a new module...
    kw = batch(ref)
    with NoLogits() as mode:
        out, loss, g = run(model, kw)  # ...adopted on the next call
    _, loss_ref, g_ref = run(ref, kw)
    assert type(model.get_output_embeddings()) is FusedLMHead and out.logits is None
    assert_close_loss(loss, loss_ref)
    assert_grads_equal(g, g_ref)


def test_import_fused_ce_imports_no_framework():
    code = ("import sys, fused_ce, fused_ce.integrations; "
            "bad = [m for m in ('transformers', 'lightning', 'pytorch_lightning', 'peft') "
            "if m in sys.modules]; assert not bad, bad; "
            "import fused_ce.integrations.hf; assert 'transformers' not in sys.modules; "
            "assert fused_ce.patch_hf_model is fused_ce.integrations.hf.patch_hf_model")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ----------------------------------------------------------------------------- refusals
def _deberta_v2():
    return T.DebertaV2ForMaskedLM(T.DebertaV2Config(
        vocab_size=V, hidden_size=H, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=37, max_position_embeddings=64, legacy=False))


class _ScaledLlama(T.LlamaForCausalLM):
    """A head that does more than its config says: the logits are doubled after lm_head."""

    def forward(self, *args, **kwargs):
        labels = kwargs.pop("labels", None)
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2
        if labels is not None:
            out.loss = self.loss_function(out.logits, labels, vocab_size=V)
        return out


REFUSED = {
    "BartForConditionalGeneration": (
        lambda: T.BartForConditionalGeneration(T.BartConfig(
            vocab_size=V, d_model=H, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=37, decoder_ffn_dim=37,
            max_position_embeddings=64)),
        r"BartForConditionalGeneration is not supported: encoder-decoder"),
    "MobileBertForMaskedLM": (
        lambda: T.MobileBertForMaskedLM(T.MobileBertConfig(
            vocab_size=V, hidden_size=H, embedding_size=16, num_hidden_layers=2,
            num_attention_heads=2, intermediate_size=37, intra_bottleneck_size=16,
            max_position_embeddings=64)),
        r"MobileBertForMaskedLM is not supported: its output embedding \(Linear\) is called 0 "
        r"times per forward pass, expected exactly once"),
    "DebertaV2ForMaskedLM": (
        _deberta_v2,
        r"DebertaV2ForMaskedLM is not supported: its logits are not the output of its output "
        r"embedding \(get_output_embeddings\(\), Linear\(32 -> 32\)\): the model returns logits "
        r"of shape \(2, 8, 97\)"),
    "scaled-logits": (
        lambda: _ScaledLlama(T.LlamaConfig(**_llama_kw())),
        r"_ScaledLlama is not supported: its logits are not the output of its output embedding "
        r"\(get_output_embeddings\(\), Linear\(32 -> 97\)\): the model changes them"),
    # a small coefficient: the check still sees the missing term (it probes with its own)
    "router-aux-loss-not-added": (
        lambda: _AuxNotAddedMixtral(T.MixtralConfig(
            **_moe_kw(True, 1e-4, True), num_local_experts=4, num_experts_per_tok=2)),
        r"_AuxNotAddedMixtral is not supported: the fused causal \(shifted\) LM loss \+ "
        r"router_aux_loss_coef \* aux_loss \(the router loss; router_aux_loss_coef set to 0.625 "
        r"for the check\) does not reproduce the model's own loss"),
    "router-aux-coefficient-unknown": (
        lambda: _OwnCoefMoeLM(),
        r"_OwnCoefMoeLM is not supported: its output carries a router aux_loss but none of "
        r"router_aux_loss_coef, aux_loss_coef, config.router_aux_loss_coef, "
        r"config.text_config.router_aux_loss_coef holds the coefficient"),
    "tied-embedding-head": (
        lambda: _EmbeddingHeadLM(),
        r"_EmbeddingHeadLM is not supported: its output embedding \(get_output_embeddings\(\)\) "
        r"is a torch.nn.modules.sparse.Embedding, expected a plain torch.nn.Linear"),
}


class _AuxNotAddedMixtral(T.MixtralForCausalLM):
    """Returns its router aux_loss but, unlike HF's MoE models, never adds it to the loss."""

    def forward(self, *args, labels=None, **kwargs):
        out = super().forward(*args, **kwargs)
        if labels is not None:
            out.loss = self.loss_function(out.logits, labels, vocab_size=V)
        return out


class _OwnCoefMoeLM(nn.Module):
    """A minimal MoE-style causal LM whose loss adds its aux_loss times a constant of its own."""

    def __init__(self):
        super().__init__()
        self.emb, self.router, self.lm_head = nn.Embedding(V, H), nn.Linear(H, 4), nn.Linear(H, V)

    def get_output_embeddings(self):
        return self.lm_head

    def get_input_embeddings(self):
        return self.emb

    def can_generate(self):
        return True

    def forward(self, input_ids, labels=None, output_router_logits=None, **kwargs):
        hidden = self.emb(input_ids)
        logits = self.lm_head(hidden)
        aux = self.router(hidden).softmax(-1).square().sum(-1).mean() if output_router_logits \
            else None
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V),
                                               labels[:, 1:].reshape(-1))
            if aux is not None:
                loss = loss + 0.01 * aux
        return T.modeling_outputs.MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux, logits=logits)


class _EmbeddingHeadLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)

    def get_output_embeddings(self):
        return self.emb

    def forward(self, input_ids, labels=None):
        return nn.functional.linear(self.emb(input_ids), self.emb.weight)


@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_heads_are_refused_and_left_unchanged(name):
    factory, message = REFUSED[name]
    torch.manual_seed(0)
    model = factory()
    model.train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    head_cls = type(model.get_output_embeddings())
    flags = [m.training for m in model.modules()]
    rng = torch.get_rng_state()
    attrs = {k: v for k, v in vars(model).items() if isinstance(v, (int, float, str))}
    config = model.config.to_dict() if hasattr(model, "config") else None
    with pytest.raises(ValueError, match=message):
        fused_ce.patch_hf_model(model)
    assert not fused_ce.is_patched(model)
    assert attrs == {k: v for k, v in vars(model).items() if isinstance(v, (int, float, str))}
    assert config == (model.config.to_dict() if hasattr(model, "config") else None)
    assert type(model.get_output_embeddings()) is head_cls
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert [m.training for m in model.modules()] == flags
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_meta_device_and_non_models_are_refused():
    with torch.device("meta"):
        model = T.LlamaForCausalLM(T.LlamaConfig(**_llama_kw()))
    with pytest.raises(ValueError, match=r"model: expected materialized parameters, got "
                                         r"LlamaForCausalLM with parameters on the meta device"):
        fused_ce.patch_hf_model(model)
    assert not fused_ce.is_patched(model)
    with pytest.raises(TypeError, match=r"model: expected a torch.nn.Module .* got str"):
        fused_ce.patch_hf_model("gpt2")
    with pytest.raises(TypeError, match=r"model: expected a transformers PreTrainedModel with "
                                        r"get_output_embeddings\(\), got Linear"):
        fused_ce.patch_hf_model(nn.Linear(2, 3))


# ----------------------------------------------------------------------------- training setups
@pytest.mark.parametrize("name", ["BertForMaskedLM", "Gemma2ForCausalLM"])
def test_autocast_bf16_cpu(name):
    """Under autocast both twins compute in bf16; each is compared with the fp32 model
    (CCE's criterion: |fp32 - ours| <= |fp32 - torch bf16| + tol)."""
    ref, model = twin(name)
    kw = batch(ref)
    _, loss32, g32 = run(ref, kw)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_ref, loss_ref, g_ref = run(ref, kw)
        with NoLogits() as mode:
            out, loss, g = run(model, kw)
    assert not mode.seen and out.logits is None
    assert abs(loss.item() - loss32.item()) <= abs(loss_ref.item() - loss32.item()) + 2e-2
    for n, g_exact in g32.items():
        if g_exact is None:
            continue
        scale = g_exact.abs().max().item() + 1e-6
        err_ours = (g[n] - g_exact).abs().max().item() / scale
        err_torch = (g_ref[n] - g_exact).abs().max().item() / scale
        assert err_ours <= err_torch + 5e-2, (n, err_ours, err_torch)


def test_bf16_weights():
    ref, model = twin("LlamaForCausalLM")
    ref32 = copy.deepcopy(ref)
    ref.to(torch.bfloat16)
    model.to(torch.bfloat16)
    kw = batch(ref)
    _, loss32, _ = run(ref32, kw)
    _, loss_ref, g_ref = run(ref, kw)
    out, loss, g = run(model, kw)
    assert out.logits is None
    assert abs(loss.item() - loss32.item()) <= abs(loss_ref.item() - loss32.item()) + 2e-2
    for n, gr in g_ref.items():
        assert g[n].dtype == torch.bfloat16
        assert torch.allclose(g[n].float(), gr.float(), rtol=5e-2,
                              atol=5e-2 * gr.abs().max().item()), n


@pytest.mark.parametrize("name", ["BertForMaskedLM", "LlamaForCausalLM"])
def test_gradient_checkpointing(name):
    ref, model = twin(name)
    for m in (ref, model):
        (getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable)()
        assert m.is_activation_checkpointing if hasattr(m, "is_activation_checkpointing") \
            else m.is_gradient_checkpointing
    kw = batch(ref)
    _, loss_ref, g_ref = run(ref, kw)
    with NoLogits() as mode:
        out, loss, g = run(model, kw)
    assert not mode.seen and out.logits is None
    assert_close_loss(loss, loss_ref)
    assert_grads_equal(g, g_ref)


def test_torch_compile():
    ref, model = twin("LlamaForCausalLM")
    # fullgraph: the hooks and the head trace into one graph with the fused op in it
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    kw = batch(ref)
    for seed in (1, 2):  # second call reuses the compiled graph
        kw = batch(ref, seed=seed)
        _, loss_ref, g_ref = run(ref, kw)
        out, loss, g = run(compiled, kw)
        assert out.logits is None and out.fused_ce_stats.predicted.shape == (B, S)
        assert_close_loss(loss, loss_ref)
        assert_grads_equal({k.removeprefix("_orig_mod."): v for k, v in g.items()}, g_ref)
    assert fused_ce.is_patched(compiled)


@pytest.mark.parametrize("order", ["patch-then-wrap", "wrap-then-patch"])
def test_peft_lora(order):
    peft = pytest.importorskip("peft")
    ref = build("LlamaForCausalLM")
    model = copy.deepcopy(ref)
    cfg = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    ref = peft.get_peft_model(ref, peft.LoraConfig(**cfg))
    if order == "patch-then-wrap":
        fused_ce.patch_hf_model(model)
        model = peft.get_peft_model(model, peft.LoraConfig(**cfg))
    else:
        model = peft.get_peft_model(model, peft.LoraConfig(**cfg))
        assert fused_ce.patch_hf_model(model) is model
    assert fused_ce.is_patched(model)
    # LoRA B starts at zero: make the adapters non-trivial, identically in both twins
    torch.manual_seed(5)
    for (n1, p1), (n2, p2) in zip(ref.named_parameters(), model.named_parameters()):
        assert n1 == n2
        if "lora_" in n1:
            with torch.no_grad():
                p1.normal_(0, 0.1)
                p2.copy_(p1)
    kw = batch(ref)
    _, loss_ref, g_ref = run(ref, kw)
    with NoLogits() as mode:
        out, loss, g = run(model, kw)
    assert not mode.seen and out.logits is None
    assert_close_loss(loss, loss_ref)
    assert any("lora_" in n and v is not None for n, v in g.items())
    assert_grads_equal(g, g_ref)
    fused_ce.unpatch_hf_model(model)
    assert not fused_ce.is_patched(model)


# ----------------------------------------------------------------------------- distributed
_SPAWN_HELPER = r"""
import copy, json, os, sys
os.environ["HF_HUB_OFFLINE"] = "1"
import torch, torch.distributed as dist, torch.multiprocessing as mp


def worker(rank, world, port, out_dir, model, ref):
    # `model` was patched in the parent and pickled into this fresh process (as ddp_spawn does)
    import fused_ce
    from torch.distributed.fsdp import fully_shard
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    patched = fused_ce.is_patched(model)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model.lm_head, mesh=mesh)  # its weight is unsharded only inside its forward
    fully_shard(model, mesh=mesh)
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=g)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    ref_out = ref(input_ids=ids, labels=ids)
    ref_out.loss.backward()
    worst = 0.0
    for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        dist.all_reduce(p.grad)
        p.grad /= world
        full = q.grad.full_tensor()
        worst = max(worst, ((full - p.grad).abs().max() / p.grad.abs().max()).item())
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(dict(rank=rank, patched=patched, loss=out.loss.item(), ref=ref_out.loss.item(),
                       worst=worst, logits=out.logits is not None), f)
    dist.barrier()
    os._exit(0)  # skips seconds of interpreter/gloo teardown


if __name__ == "__main__":
    import transformers as T
    import fused_ce
    cfg = T.LlamaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=37, tie_word_embeddings=False)
    torch.manual_seed(0)
    ref = T.LlamaForCausalLM(cfg)
    model = fused_ce.patch_hf_model(copy.deepcopy(ref))
    mp.spawn(worker, args=(2, int(sys.argv[1]), sys.argv[2], model, ref), nprocs=2)
"""


def test_spawned_fsdp2_processes(tmp_path):
    """The patched model pickled into 2 spawned processes (ddp_spawn's path), sharded with FSDP2
    (lm_head its own unit, so its weight exists unsharded only inside its forward): loss and
    every gradient equal to the unsharded unpatched model's."""
    import json
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = tmp_path / "spawn_fsdp.py"
    script.write_text(_SPAWN_HELPER)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script), str(port), str(tmp_path)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in results:
        assert r["patched"] and not r["logits"], r
        assert abs(r["loss"] - r["ref"]) <= 1e-5 * abs(r["ref"]), r
        assert r["worst"] <= 1e-5, r
