"""Sliding-window, soft-capped and sink layers, read from each call and passed to attention_kl: tiny Mistral (every
layer a sliding window), Gemma-2 (soft-cap on every layer, sliding and global layers alternating), Gemma-3 (sliding
and global layers) and gpt-oss (sinks; sliding and global layers) built from configs, under every implementation
each supports on a CPU, against their own eager probabilities in float64. Pairs whose layers attend differently
(a window on one side, sinks on one side) are refused."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from ._hf import (
    cpu_flash,
    distil,
    eager_outputs,
    float64_softmax,
    kl_rows,
    mean_kl,
    packed_row,
    tiny,
    with_sink,
)
from ._models import token_batch

CASES = [("mistral", "sdpa"), ("mistral", "eager"), ("mistral", "flash_attention_2"),
         ("gemma2", "eager"), ("gemma2", "flash_attention_2"),
         ("gemma3", "sdpa"), ("gemma3", "eager"), ("gemma3", "flash_attention_2"),
         ("gpt_oss", "eager"), ("gpt_oss", "flash_attention_2")]
#: what each layer of the tiny models applies: (window of layer 0, window of layer 1, soft-cap, sinks)
LAYERS = {"mistral": ((3, 0), (3, 0), None, False), "gemma2": ((3, 0), None, 5.0, False),
          "gemma3": ((3, 0), None, None, False), "gpt_oss": ((3, 0), None, None, True)}


def _reference(kind, teacher, student, batch, layer, rows):
    p_t, p_s = (eager_outputs(m, **batch).attentions[layer] for m in (teacher, student))
    if kind == "gpt_oss":
        p_t, p_s = with_sink(p_t), with_sink(p_s)
    return mean_kl(p_t, p_s, rows)


@pytest.mark.parametrize(("kind", "impl"), CASES)
def test_layers_match_their_eager_probabilities(kind, impl):
    teacher = tiny(kind, seed=0, hidden=32, kv_heads=2, impl=impl)
    student = tiny(kind, seed=1, hidden=16, kv_heads=1, impl=impl)
    batch = token_batch(3, 9, pad="left")
    batch["attention_mask"][0, 7:] = 0  # right padding in another row
    with cpu_flash(), float64_softmax():
        out, t_rec, s_rec, _ = distil(teacher, student, batch, [[0, 0], [1, 1]])
    window_0, window_1, softcap, sinks = LAYERS[kind]
    for layer, window in ((0, window_0), (1, window_1)):
        t, s = t_rec[f"model.layers.{layer}.self_attn"], s_rec[f"model.layers.{layer}.self_attn"]
        assert (t.window, s.window, t.softcap, s.softcap) == (window, window, softcap, softcap), layer
        assert (t.sinks is not None, s.sinks is not None) == (sinks, sinks)
    real = batch["attention_mask"].bool()
    for layer, name in ((0, "t0_s0"), (1, "t1_s1")):
        ref = _reference(kind, teacher, student, batch, layer, real)
        torch.testing.assert_close(out.per_pair[name], ref, rtol=1e-9, atol=0)
        assert ref > 1e-2


def test_sink_gradients_reach_the_students_sinks():
    teacher, student = tiny("gpt_oss", seed=0, hidden=32), tiny("gpt_oss", seed=1, hidden=16, kv_heads=1)
    with float64_softmax():
        out, *_ = distil(teacher, student, token_batch(2, 9, pad="none"), [[1, 1]])
    out.total.backward()
    sinks = student.model.layers[1].self_attn.sinks
    assert sinks.grad is not None and sinks.grad.abs().max() > 0


@pytest.mark.parametrize("impl", ["sdpa", "eager", "flash_attention_2"])
def test_a_window_inside_packed_documents(impl):
    """Mistral on one packed row: each document is its own sequence and the window slides inside it."""
    teacher = tiny("mistral", seed=0, hidden=32, kv_heads=2, impl=impl)
    student = tiny("mistral", seed=1, hidden=16, kv_heads=1, impl=impl)
    batch, docs = packed_row([6, 3, 7])
    with cpu_flash(), float64_softmax():
        out, t_rec, _, _ = distil(teacher, student, batch, [[-1, -1]])
    rec = t_rec["model.layers.1.self_attn"]
    assert (rec.window, rec.packed.cu_seqlens_q.tolist()) == ((3, 0), [0, 6, 9, 16])
    rows = [kl_rows(eager_outputs(teacher, input_ids=d).attentions[-1], eager_outputs(student, input_ids=d)
                    .attentions[-1]).flatten() for d in docs]
    torch.testing.assert_close(out.per_pair["t-1_s-1"], torch.cat(rows).mean(), rtol=1e-9, atol=0)


def test_a_soft_capped_teacher_and_a_plain_student():
    """Per-side options: Gemma-2's global layer (soft-capped) distils into a Llama layer exactly; its sliding layer
    attends to other keys than a global Llama layer and is refused (the KL needs one set of keys per row)."""
    teacher = tiny("gemma2", seed=0, hidden=32, impl="eager")
    student = tiny("llama", seed=1, hidden=16, kv_heads=1, impl="sdpa")
    batch = token_batch(2, 9, pad="right")
    with float64_softmax():
        out, t_rec, s_rec, _ = distil(teacher, student, batch, [[1, 1]])
    assert (t_rec["model.layers.1.self_attn"].softcap, s_rec["model.layers.1.self_attn"].softcap) == (5.0, None)
    ref = _reference("gemma2", teacher, student, batch, 1, batch["attention_mask"].bool())
    torch.testing.assert_close(out.per_pair["t1_s1"], ref, rtol=1e-9, atol=0)
    with pytest.raises(ValueError, match=r"attend to different keys \(teacher: causal, window \(3, 0\), key padding; "
                                         r"student: causal, key padding\).*sliding windows differ"):
        distil(teacher, student, batch, [[0, 0]])


def test_sinks_on_one_side_are_refused():
    teacher = tiny("gpt_oss", seed=0, hidden=32, impl="eager")
    student = tiny("llama", seed=1, hidden=16, kv_heads=1)
    with pytest.raises(ValueError, match="the teacher layer has attention sinks and the student layer has none"):
        distil(teacher, student, token_batch(2, 9, pad="none"), [[1, 1]])
