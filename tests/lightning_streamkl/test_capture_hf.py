"""Real-client checks: the KL from our Hugging Face capture + attention_kl equals the KL between the models' own
eager attention probabilities, while the capture runs under sdpa; the model's implementation name never changes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from lightning_streamkl import AttentionDistillationLoss, HFAttentionCapture
from streamkl import attention_kl

from ._models import tiny_bert, tiny_llama, token_batch

F64 = torch.float64


def eager_attentions(model, batch):
    """The model's own attention probabilities per layer, from the eager implementation.

    HF's eager attention runs its softmax with ``dtype=torch.float32`` even for float64 models; for the comparison
    to hold to float64 tolerance the softmax keeps float64 inputs in float64 here (nothing else changes).
    """
    softmax = torch.nn.functional.softmax

    def softmax64(x, dim=None, _stacklevel=3, dtype=None):
        return softmax(x, dim=dim, dtype=torch.float64 if x.dtype == F64 else dtype)

    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    torch.nn.functional.softmax = softmax64
    try:
        with torch.no_grad():
            return model(**batch, output_attentions=True).attentions
    finally:
        torch.nn.functional.softmax = softmax
        model.set_attn_implementation(previous)


def kl_rows(p_t: torch.Tensor, p_s: torch.Tensor) -> torch.Tensor:
    """KL(P_t || P_s) per row from probability maps [B, H, N, N] (0·log 0 = 0)."""
    ratio = torch.where(p_t > 0, torch.log(p_t) - torch.log(p_s.clamp_min(1e-300)), torch.zeros_like(p_t))
    return (p_t * ratio).sum(-1)


def capture_records(model, batch):
    capture = HFAttentionCapture(model)
    seen = []
    with capture.recording():
        seen.append(model.config._attn_implementation)
        with torch.no_grad():
            out = model(**batch)
    return capture, capture.pop(), seen[0], out


@pytest.mark.parametrize("pad", ["right", "left"])
def test_llama_gqa_rope_causal_matches_eager_probabilities(pad):
    teacher = tiny_llama(hidden=64, heads=4, kv_heads=2, layers=3, seed=0, dtype=F64, init=0.2)
    student = tiny_llama(hidden=32, heads=4, kv_heads=1, layers=2, seed=1, dtype=F64, init=0.2)
    batch = token_batch(3, 11, pad=pad)
    qmask = batch["attention_mask"].bool()

    t_cap, t_rec, t_impl, t_out = capture_records(teacher, batch)
    s_cap, s_rec, s_impl, _ = capture_records(student, batch)
    assert (t_impl, s_impl) == ("sdpa", "sdpa")  # the config keeps its name while recording
    assert teacher.config._attn_implementation == student.config._attn_implementation == "sdpa"
    assert t_cap.layer_names() == [f"model.layers.{i}.self_attn" for i in range(3)]
    with torch.no_grad():  # delegation: the captured forward computed exactly the model's output (masks included)
        assert torch.equal(teacher(**batch).logits, t_out.logits)

    att_t, att_s = eager_attentions(teacher, batch), eager_attentions(student, batch)
    for t_layer, s_layer in [(0, 0), (2, 1)]:
        t = t_rec[f"model.layers.{t_layer}.self_attn"]
        s = s_rec[f"model.layers.{s_layer}.self_attn"]
        assert t.causal and s.causal and t.exact and s.exact and (t.layer_idx, s.layer_idx) == (t_layer, s_layer)
        assert tuple(t.k.shape) == (3, 2, 11, 16) and tuple(s.k.shape) == (3, 1, 11, 8)  # keys before GQA repeat
        ours = attention_kl(t.q, t.k, s.q, s.k, causal=True, scale_t=t.scale, scale_s=s.scale,
                            key_padding_mask=qmask, query_mask=qmask, reduction="none")
        ref = kl_rows(att_t[t_layer], att_s[s_layer]) * qmask[:, None, :]
        assert ours.dtype == F64
        torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-12)
        assert ref.abs().max() > 1e-3  # a non-trivial comparison

    # the loss assembly (pairs by index, masks from the batch) gives the mean of the same rows
    loss = AttentionDistillationLoss({"pairs": [{"teacher": -1, "student": -1, "name": "last"}]})
    loss.resolve(t_cap, s_cap)
    out = loss(t_rec, s_rec, key_padding_mask=qmask, query_mask=qmask)
    ref = kl_rows(att_t[2], att_s[1])[qmask[:, None, :].expand(-1, 4, -1)]
    torch.testing.assert_close(out.per_pair["last"], ref.mean(), rtol=1e-9, atol=1e-12)
    assert out.rows.item() == ref.numel()


def test_bert_bidirectional_padding_matches_eager_probabilities():
    teacher = tiny_bert(hidden=32, heads=4, layers=2, seed=0, dtype=F64, init=0.2)
    student = tiny_bert(hidden=16, heads=4, layers=2, seed=1, dtype=F64, init=0.2)
    batch = token_batch(3, 10, pad="right")
    batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
    mask = batch["attention_mask"].bool()

    t_cap, t_rec, t_impl, t_out = capture_records(teacher, batch)
    _, s_rec, _, _ = capture_records(student, batch)
    assert t_impl == "sdpa" and teacher.config._attn_implementation == "sdpa"
    assert t_cap.layer_names() == ["encoder.layer.0.attention.self", "encoder.layer.1.attention.self"]
    with torch.no_grad():
        assert torch.equal(teacher(**batch).last_hidden_state, t_out.last_hidden_state)

    att_t, att_s = eager_attentions(teacher, batch), eager_attentions(student, batch)
    for layer in range(2):
        t, s = t_rec[f"encoder.layer.{layer}.attention.self"], s_rec[f"encoder.layer.{layer}.attention.self"]
        assert t.causal is False and s.causal is False
        for direction, (a, b) in (("forward", (att_t, att_s)), ("reverse", (att_s, att_t))):
            ours = attention_kl(t.q, t.k, s.q, s.k, causal=False, scale_t=t.scale, scale_s=s.scale,
                                key_padding_mask=mask, query_mask=mask, reduction="none", direction=direction)
            ref = kl_rows(a[layer], b[layer]) * mask[:, None, :]
            torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-12)


def test_group_head_map_matches_grouped_eager_kl():
    """head_map="group": a 4-head teacher vs a 2-head student; student head h is compared with teacher heads 2h, 2h+1."""
    teacher = tiny_llama(hidden=32, heads=4, kv_heads=2, layers=1, seed=0, dtype=F64, init=0.2)
    student = tiny_llama(hidden=32, heads=2, kv_heads=1, layers=1, seed=1, dtype=F64, init=0.2)
    batch = token_batch(2, 9, pad="right")
    mask = batch["attention_mask"].bool()
    t_cap, t_rec, _, _ = capture_records(teacher, batch)
    s_cap, s_rec, _, _ = capture_records(student, batch)
    att_t, att_s = eager_attentions(teacher, batch)[0], eager_attentions(student, batch)[0]

    with pytest.raises(ValueError, match=r"teacher layer has 4 query heads and the student layer 2.*head_map='group'"):
        loss = AttentionDistillationLoss({"pairs": [[0, 0]]})
        loss.resolve(t_cap, s_cap)
        loss(t_rec, s_rec, key_padding_mask=mask, query_mask=mask)

    loss = AttentionDistillationLoss({"pairs": [[0, 0]], "head_map": "group"})
    loss.resolve(t_cap, s_cap)
    out = loss(t_rec, s_rec, key_padding_mask=mask, query_mask=mask)
    ref = kl_rows(att_t, att_s.repeat_interleave(2, dim=1))  # [B, 4, N]
    ref = ref[mask[:, None, :].expand(-1, 4, -1)].mean()
    torch.testing.assert_close(out.per_pair["t0_s0"], ref, rtol=1e-9, atol=1e-12)


def test_eager_implementation_is_delegated_and_restored():
    model = tiny_llama(layers=1, impl="eager", dtype=F64)
    batch = token_batch(2, 7, pad="left")
    with torch.no_grad():
        expected = model(**batch).logits
    _, records, impl, out = capture_records(model, batch)
    assert impl == "eager" and model.config._attn_implementation == "eager"
    # (HF's eager softmax gives NaN on the fully masked rows of left padding in float64; both runs do)
    torch.testing.assert_close(out.logits, expected, rtol=0, atol=0, equal_nan=True)
    assert sorted(records) == ["model.layers.0.self_attn"]


def test_capture_records_only_selected_layers_and_pauses():
    model = tiny_llama(layers=2)
    capture = HFAttentionCapture(model)
    capture.select({"model.layers.1.self_attn"})
    batch = token_batch(1, 5, pad="none")
    with capture.recording():
        with capture.paused():
            assert model.config._attn_implementation == "sdpa"
            model(**batch)
        assert capture.records == {}
        model(**batch)
    assert sorted(capture.records) == ["model.layers.1.self_attn"]
    capture.clear()
    model(**batch)  # outside recording nothing is kept
    assert capture.records == {}


def test_two_captures_on_a_shared_config_restore_it():
    from transformers import LlamaForCausalLM

    a = tiny_llama(layers=1)
    b = LlamaForCausalLM(a.config)  # same config object
    cap_a, cap_b = HFAttentionCapture(a), HFAttentionCapture(b)
    batch = token_batch(1, 5, pad="none")
    with cap_a.recording():
        with cap_b.recording():
            a(**batch)
            b(**batch)
        assert a.config._attn_implementation == "sdpa"
    assert a.config._attn_implementation == "sdpa"
    assert list(cap_a.records) == ["model.layers.0.self_attn"] and list(cap_b.records) == ["model.layers.0.self_attn"]
    assert cap_a.records["model.layers.0.self_attn"].q is not cap_b.records["model.layers.0.self_attn"].q


def test_unknown_layer_lists_close_matches():
    capture = HFAttentionCapture(tiny_llama(layers=2))
    with pytest.raises(ValueError, match=r"Unknown layer: LlamaForCausalLM has no attention layer 'model.layer.1.self_attn'.*Closest: \['model.layers.1.self_attn'"):
        capture.resolve("model.layer.1.self_attn")
    with pytest.raises(ValueError, match=r"index 5 is out of range: LlamaForCausalLM has 2 attention layers"):
        capture.resolve(5)
    assert capture.resolve(-1) == "model.layers.1.self_attn"


def test_the_model_is_walked_once_not_every_step(monkeypatch):
    """Opening a recording block looked every selected layer up by walking all of the model's modules: milliseconds
    of host time per step and model at BERT-base size. The index is built once; every step records the same."""
    model = tiny_bert(layers=3)
    capture = HFAttentionCapture(model)
    capture.select({capture.layer_names()[1]})
    walks = []
    original = type(model).named_modules

    def counting(self, *args, **kwargs):
        if self is model:
            walks.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "named_modules", counting)
    batch = token_batch(2, 7)
    shapes = []
    for _ in range(3):
        with capture.recording():
            model(**batch)
        shapes.append({name: tuple(r.q.shape) for name, r in capture.pop().items()})
    assert shapes == [{capture.layer_names()[1]: (2, 4, 7, 8)}] * 3
    assert len(walks) <= 1


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    return None


def _positional_only(module, query, /, key, value, **kwargs):
    return None


def _rest(module, query, key, *rest, **kwargs):
    return None


@pytest.mark.parametrize("fn, args, kwargs", [
    (_attention, ("m", "q", "k", "v", "mask"), {"dropout": 0.1, "sliding_window": 4}),  # transformers' usual call
    (_attention, ("m", "q", "k"), {"value": "v", "attention_mask": None, "is_causal": True}),
    (_attention, ("m", "q", "k", "v", "mask"), {"query": "again"}),  # does not bind: None
    (_positional_only, ("m", "q", "k", "v"), {"scaling": 0.5}),
    (_rest, ("m", "q", "k", "v", "mask"), {"scaling": 0.5}),
])
def test_an_attention_call_is_named_as_binding_its_signature_names_it(fn, args, kwargs):
    """``_named_arguments`` (zipping the usual call, binding the rest) names every argument as ``Signature.bind`` does,
    with the ``**kwargs`` catch-all flattened in, and gives None where the call does not bind."""
    import inspect

    from lightning_streamkl.capture.hf import _named_arguments

    signature = inspect.signature(fn)
    try:
        bound = signature.bind(*args, **kwargs).arguments
    except TypeError:
        expected = None
    else:
        expected = {}
        for name, value in bound.items():
            if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                expected.update(value)
            else:
                expected[name] = value
    assert _named_arguments(fn, args, kwargs) == expected


def test_a_captured_pass_binds_no_signature(monkeypatch):
    """Host time: every recorded attention call used to bind its function's signature (tens of microseconds each, on
    every layer of every pass); transformers' usual call is now named by zipping, so no bind runs in a pass."""
    import inspect

    model = tiny_bert(layers=2)
    capture = HFAttentionCapture(model)
    batch = token_batch(2, 7)
    with capture.recording():
        model(**batch)  # the first pass reads the signatures
    expected = {name: tuple(r.q.shape) for name, r in capture.pop().items()}

    def refuse(*args, **kwargs):
        raise AssertionError("Signature.bind ran during a captured pass")

    monkeypatch.setattr(inspect.Signature, "bind", refuse)
    monkeypatch.setattr(inspect.Signature, "bind_partial", refuse)
    with capture.recording():
        model(**batch)
    assert {name: tuple(r.q.shape) for name, r in capture.pop().items()} == expected == {
        name: (2, 4, 7, 8) for name in capture.layer_names()}
