"""The Hugging Face capture under every attention implementation transformers ships that runs on a CPU: eager, sdpa,
flash_attention_2 (transformers' own flash path on CPU kernels), flex_attention (forward only on a CPU) and a
registered custom one. The implementation sees exactly the name, arguments and mask it sees without capture; the
model's output does not change; the KL equals the one from the models' own eager probabilities (float64)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AttentionInterface
from transformers.integrations.flash_attention import flash_attention_forward
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from lightning_streamkl import HFAttentionCapture
from lightning_streamkl.capture.hf import _PATCHES

from ._hf import F64, cpu_flash, distil, eager_outputs, float64_softmax, implementation, mean_kl, tiny
from ._models import token_batch

PAIRS = [{"teacher": 0, "student": 0, "name": "first"}, {"teacher": -1, "student": -1, "name": "last"}]


def _pair_models(teacher_impl: str, student_impl: str = "sdpa", teacher_dtype=F64):
    teacher = tiny("llama", seed=0, hidden=64, kv_heads=2, impl=teacher_impl, dtype=teacher_dtype)
    student = tiny("llama", seed=1, hidden=32, kv_heads=1, impl=student_impl)
    return teacher, student


def _eager_kls(teacher, student, batch):
    """The pairs' mean KLs from the models' own eager probabilities (float64), over the real query rows."""
    teacher = teacher.double()
    rows = batch["attention_mask"].bool()
    att_t, att_s = eager_outputs(teacher, **batch).attentions, eager_outputs(student, **batch).attentions
    return {"first": mean_kl(att_t[0], att_s[0], rows), "last": mean_kl(att_t[-1], att_s[-1], rows)}


@pytest.mark.parametrize("teacher_impl", ["eager", "sdpa", "flash_attention_2"])
@pytest.mark.parametrize("pad", ["left", "right"])
def test_each_implementation_gives_the_eager_kl(teacher_impl, pad):
    teacher, student = _pair_models(teacher_impl, "eager" if teacher_impl == "sdpa" else "sdpa")
    batch = token_batch(3, 11, pad=pad)
    with cpu_flash(), float64_softmax():  # (eager layers feed the next layer float64 probabilities, as the reference)
        out, t_rec, _, _ = distil(teacher, student, batch, PAIRS)
        with torch.no_grad():
            expected = teacher(**batch, use_cache=False).logits
            with HFAttentionCapture(teacher).recording():
                captured = teacher(**batch, use_cache=False).logits
                assert teacher.config._attn_implementation == teacher_impl
    # the capture never changes the computation (eager gives NaN on the fully masked rows of left padding in float64)
    torch.testing.assert_close(captured, expected, rtol=0, atol=0, equal_nan=True)
    rec = t_rec["model.layers.1.self_attn"]
    assert rec.causal and rec.masks_from_call and torch.equal(rec.key_padding_mask, batch["attention_mask"].bool())
    with implementation(teacher, "sdpa"):
        reference = _eager_kls(teacher, student, batch)
    for name, ref in reference.items():
        torch.testing.assert_close(out.per_pair[name], ref, rtol=1e-9, atol=1e-12)
        assert ref > 1e-2


@pytest.mark.slow
def test_flex_attention_teacher_gives_the_eager_kl():
    """FlexAttention runs its forward on a CPU (float32 only, no backward): the teacher's BlockMask is read back."""
    teacher, student = _pair_models("flex_attention", teacher_dtype=torch.float32)
    batch = token_batch(3, 11, pad="left")
    out, t_rec, _, _ = distil(teacher, student, batch, PAIRS)
    assert t_rec["model.layers.1.self_attn"].masking().summary() == "causal, key padding"
    with implementation(teacher, "sdpa"):
        reference = _eager_kls(teacher, student, batch)
    for name, ref in reference.items():  # float32 teacher queries and keys against its float64 eager copy
        torch.testing.assert_close(out.per_pair[name].double(), ref, rtol=1e-5, atol=1e-7)


def _observations(model, batch, capture=None):
    """What a stand-in registered under the FA2 name sees: the config's name, the keyword arguments, the mask."""
    seen = []

    def stand_in(module, query, key, value, attention_mask, **kwargs):
        seen.append((module.config._attn_implementation, dict(kwargs), attention_mask, query.detach().clone()))
        return flash_attention_forward(module, query, key, value, attention_mask, **kwargs)

    original = AttentionInterface._global_mapping["flash_attention_2"]
    AttentionInterface.register("flash_attention_2", stand_in)
    try:
        with cpu_flash(), torch.no_grad():
            if capture is None:
                logits = model(**batch, use_cache=False).logits
            else:
                with capture.recording():
                    logits = model(**batch, use_cache=False).logits
    finally:
        AttentionInterface.register("flash_attention_2", original)
    return seen, logits


@pytest.mark.parametrize("packed", [False, True])
def test_flash_attention_2_stand_in_sees_the_original_name_kwargs_and_mask(packed):
    model = tiny("llama", seed=0, impl="flash_attention_2")
    if packed:
        batch = {"input_ids": torch.randint(1, 50, (1, 9)), "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2]])}
    else:
        batch = token_batch(2, 9, pad="left")
    plain, logits = _observations(model, batch)
    capture = HFAttentionCapture(model)
    captured, captured_logits = _observations(model, batch, capture)
    assert len(plain) == len(captured) == 2
    for (name, kwargs, mask, query), (name_c, kwargs_c, mask_c, query_c) in zip(plain, captured):
        assert name == name_c == "flash_attention_2"
        assert kwargs.keys() == kwargs_c.keys()
        for key, value in kwargs.items():
            assert torch.equal(value, kwargs_c[key]) if isinstance(value, torch.Tensor) else value == kwargs_c[key], key
        assert (mask is None and mask_c is None) or torch.equal(mask, mask_c)  # the [B, N] padding mask, or none
        assert torch.equal(query, query_c)
    torch.testing.assert_close(captured_logits, logits, rtol=0, atol=0)
    rec = capture.records["model.layers.1.self_attn"]
    assert rec.masking().summary() == ("causal, 3 packed sequences" if packed else "causal, key padding")


def test_a_registered_custom_implementation_is_captured():
    name = "streamkl_test_custom_attention"
    calls = []

    def custom(module, query, key, value, attention_mask, **kwargs):
        calls.append(module.config._attn_implementation)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(name, custom)
    AttentionMaskInterface.register(name, sdpa_mask)
    try:
        teacher, student = _pair_models(name)
        batch = token_batch(3, 11, pad="right")
        out, t_rec, _, _ = distil(teacher, student, batch, PAIRS)
        assert calls and set(calls) == {name}
        assert t_rec["model.layers.1.self_attn"].masking().summary() == "causal, key padding"
        with implementation(teacher, "sdpa"):
            reference = _eager_kls(teacher, student, batch)
        for pair, ref in reference.items():
            torch.testing.assert_close(out.per_pair[pair], ref, rtol=1e-9, atol=1e-12)
    finally:
        AttentionInterface._global_mapping.pop(name, None)
        AttentionMaskInterface._global_mapping.pop(name, None)


def test_replacements_are_counted_and_undone():
    import transformers.models.llama.modeling_llama as llama

    model = tiny("llama", seed=0)
    mapping = dict(AttentionInterface._global_mapping)
    eager = llama.eager_attention_forward
    a, b = HFAttentionCapture(model), HFAttentionCapture(tiny("llama", seed=1))
    with a.recording():
        wrapped = AttentionInterface._global_mapping["sdpa"]
        assert wrapped is not mapping["sdpa"] and wrapped.__wrapped__ is mapping["sdpa"]
        assert llama.eager_attention_forward.__wrapped__ is eager
        with b.recording():
            assert AttentionInterface._global_mapping["sdpa"] is wrapped  # wrapped once, counted twice
        assert AttentionInterface._global_mapping["sdpa"] is wrapped  # still needed by `a`
        with a.paused():
            assert AttentionInterface._global_mapping == mapping
    assert AttentionInterface._global_mapping == mapping and llama.eager_attention_forward is eager and not _PATCHES
    assert model.config._attn_implementation == "sdpa"


def test_a_position_bias_is_refused():
    """T5 adds a relative position bias to every layer's scores: attention_kl cannot express it."""
    from transformers import T5Config, T5EncoderModel

    model = T5EncoderModel(T5Config(vocab_size=50, d_model=16, d_kv=4, num_heads=4, d_ff=32, num_layers=1))
    capture = HFAttentionCapture(model)
    assert capture.layer_names() == ["encoder.block.0.layer.0.SelfAttention"]
    with pytest.raises(ValueError, match=r"'encoder.block.0.layer.0.SelfAttention'.*position bias.*`position_bias`"), \
            capture.recording():
        model(input_ids=torch.randint(1, 50, (1, 5)))


@pytest.mark.parametrize("packed", [False, True])
def test_flash_layers_share_one_mask_reading_and_their_pairs_fuse(packed, monkeypatch):
    """Under flash-attention every layer of a pass gets the same padding mask (or offsets); the capture reads it once
    per pass (its host synchronisations), so the layers' records share their mask tensors and the loss runs both pairs
    as one call, with the values of one call per pair."""
    import lightning_streamkl.terms as terms

    calls = []
    real = terms.attention_kl
    monkeypatch.setattr(terms, "attention_kl", lambda *a, **k: calls.append(k["reduction"]) or real(*a, **k))
    teacher, student = _pair_models("flash_attention_2", "flash_attention_2")
    batch = token_batch(3, 11, pad="right")
    if packed:  # one row of two documents, as a packing collator hands them over
        batch = {"input_ids": batch["input_ids"][:1], "position_ids": torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4]])}
    with cpu_flash():
        fused, t_rec, _, _ = distil(teacher, student, batch, PAIRS)
        assert calls == ["none"]
        alone, *_ = distil(teacher, student, batch, PAIRS, fuse_pairs=False)
    assert calls == ["none", "sum", "sum"]
    first, last = (t_rec[f"model.layers.{i}.self_attn"].masking() for i in (0, 1))
    assert (first.packed is not None) == packed
    assert (first.key_padding_mask is last.key_padding_mask) if not packed else (first.packed is last.packed)
    for name in ("first", "last"):
        torch.testing.assert_close(fused.per_pair[name], alone.per_pair[name], rtol=1e-6, atol=1e-9)
