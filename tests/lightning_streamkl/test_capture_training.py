"""Training a captured student: Hugging Face gradient checkpointing (reentrant and not) and ``torch.compile`` give
the same KL and the same gradients as the plain student; values are recorded only when asked."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from lightning_streamkl import MultiheadAttentionCapture, RecorderCapture, record
from lightning_streamkl.capture import HFAttentionCapture, build_capture
from lightning_streamkl.capture.hf import _PATCHES, _PENDING, _TRACED
from lightning_streamkl.engine import AttentionDistiller

from ._hf import tiny
from ._models import token_batch

PAIRS = [[0, 0], [-1, -1]]


def _step(teacher, student, batch, *, forward=None, steps=1, kl_only=False):
    """``steps`` distillation steps of the engine (no optimizer): the KL terms and the student's gradients of each."""
    distiller = AttentionDistiller(teacher, {"pairs": PAIRS})
    distiller.setup(student)
    forward = student if forward is None else forward
    results = []
    for _ in range(steps):
        student.zero_grad()
        distiller.begin_step(batch)
        with distiller.student_recording():
            out = forward(**batch, labels=batch["input_ids"], use_cache=False)
        terms = distiller.end_step(batch)
        (terms.total + (0 * out.loss if kl_only else out.loss)).backward()
        grads = {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}
        results.append((terms.total.detach(), grads))
    return results


def _assert_same(got, expected, rtol):
    for (kl, grads), (kl_ref, grads_ref) in zip(got, expected, strict=True):
        torch.testing.assert_close(kl, kl_ref, rtol=rtol, atol=0)
        assert grads.keys() == grads_ref.keys()
        for name, ref in grads_ref.items():
            torch.testing.assert_close(grads[name], ref, rtol=rtol, atol=rtol * float(ref.abs().max()), msg=name)


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("kl_only", [False, True])
def test_gradient_checkpointing_gives_the_same_kl_and_gradients(use_reentrant, kl_only):
    """Reentrant checkpointing runs the segment's first forward without autograd: the record holds leaf copies, and
    the recomputation in the backward adds their gradients (``kl_only``: nothing else trains the attention)."""
    teacher = tiny("llama", seed=0, hidden=64, layers=3)
    student = tiny("llama", seed=1, hidden=32, kv_heads=1, layers=3)
    batch = token_batch(3, 11, pad="right")
    expected = _step(teacher, copy.deepcopy(student).train(), batch, kl_only=kl_only)
    student.train()
    student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    got = _step(teacher, student, batch, kl_only=kl_only)
    _assert_same(got, expected, rtol=1e-12)
    assert any(g.abs().max() > 0 for g in got[0][1].values())
    assert not _PENDING and not _PATCHES  # the leaf copies were consumed, the registry restored


def _graph_breaks(step) -> tuple[dict[str, int], int]:
    """``(graph breaks by reason, graphs compiled)`` over two calls of ``step``, from a fresh dynamo."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    step()
    step()
    return dict(counters["graph_break"]), counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("checkpointing", ["none", "reentrant", "non-reentrant"])
def test_compiled_student_gives_the_same_kl_and_gradients(checkpointing):
    """``torch.compile`` (dynamo + AOTAutograd) of a recorded student, with and without Hugging Face gradient
    checkpointing: the capture adds no graph break and no graph to the student's own compile (the calls are noted in
    the graph and read after it), and the KL and gradients over two steps are the eager ones; an uncaptured forward
    after them."""
    teacher = tiny("llama", seed=0, hidden=64, dtype=torch.float32)
    student = tiny("llama", seed=1, hidden=32, kv_heads=1, dtype=torch.float32).train()
    batch = token_batch(3, 11, pad="right")
    expected = _step(teacher, copy.deepcopy(student), batch, steps=2)
    if checkpointing != "none":
        student.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
    compiled = torch.compile(student, backend="aot_eager")
    plain = _graph_breaks(lambda: compiled(**batch, labels=batch["input_ids"], use_cache=False).loss.backward())
    got = []
    recorded = _graph_breaks(lambda: got.extend(_step(teacher, student, batch, forward=compiled)))
    assert recorded == plain
    _assert_same(got, expected, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(compiled(**batch, use_cache=False).logits, student(**batch).logits, rtol=1e-5,
                                   atol=1e-6)
    assert not _PATCHES and not _TRACED


@pytest.mark.parametrize("how", ["module.compile()", "torch.compile(module)"])
def test_a_compiled_teacher_runs_whole_in_one_graph_with_the_same_kl_and_gradients(how, monkeypatch):
    """A teacher compiled either way (``teacher.compile()`` keeps its layer names; a ``torch.compile`` wrapper
    prefixes them with ``_orig_mod.``) gives the eager teacher's KL and the student's gradients, in one graph per
    pass with no graph break: the early exit, a Python exception raised after the deepest paired layer, cannot leave
    a graph, so a compiled teacher runs whole."""
    teacher = tiny("llama", seed=0, hidden=64, dtype=torch.float32)
    student = tiny("llama", seed=1, hidden=32, kv_heads=1, dtype=torch.float32).train()
    batch = token_batch(3, 11, pad="right")
    expected = _step(teacher, copy.deepcopy(student), batch, steps=2)
    compiled = copy.deepcopy(teacher)
    if how == "module.compile()":
        compiled.compile(backend="aot_eager")
    else:
        compiled = torch.compile(compiled, backend="aot_eager")
    from lightning_streamkl import engine

    stops = []
    monkeypatch.setattr(engine, "stop_after", lambda *args: stops.append(args) or contextlib.nullcontext())
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    got = _step(compiled, student, batch, steps=2)
    assert (dict(counters["graph_break"]), counters["stats"]["unique_graphs"]) == ({}, 1)
    _assert_same(got, expected, rtol=1e-5)
    assert stops == []  # no early exit was set up


def test_a_compiled_student_under_autocast_notes_bf16_queries_and_keys(monkeypatch):
    """Under autocast a Llama layer's query and key leave the rotary embedding in float32; the compiled capture notes
    them cast to the autocast dtype inside the graph (so the graph outputs bf16 tensors, not float32 ones beside the
    layer's own), and the KL is the eager capture's."""
    from lightning_streamkl.capture import hf

    noted = []
    settle = hf.settle_traced_calls

    def spy():
        noted.extend(x.dtype for _, call in hf._TRACED if len(call) == 4 for x in call[2][1:3])
        settle()

    monkeypatch.setattr(hf, "settle_traced_calls", spy)
    teacher = tiny("llama", seed=0, hidden=64, dtype=torch.float32)
    student = tiny("llama", seed=1, hidden=32, kv_heads=1, dtype=torch.float32).train()
    batch = token_batch(2, 9, pad="none")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (eager_kl, _), = _step(teacher, student, batch, kl_only=True)
        torch._dynamo.reset()
        (compiled_kl, _), = _step(teacher, student, batch, forward=torch.compile(student, backend="aot_eager"),
                                  kl_only=True)
    assert noted and set(noted) == {torch.bfloat16}
    torch.testing.assert_close(compiled_kl, eager_kl, rtol=1e-2, atol=0)


def test_values_are_recorded_only_when_asked():
    model = tiny("llama", seed=0, kv_heads=2)
    batch = token_batch(2, 7, pad="none")
    for capture_values in (False, True):
        capture = build_capture(model, capture_values=capture_values)
        assert isinstance(capture, HFAttentionCapture) and capture.capture_values is capture_values
        with torch.no_grad(), capture.recording():
            model(**batch)
        rec = capture.records["model.layers.1.self_attn"]
        assert (rec.v is None) is not capture_values
    assert tuple(rec.v.shape) == (2, 2, 7, 8)  # [B, H_kv, N, D_v], before GQA repetition

    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    capture = MultiheadAttentionCapture(mha, capture_values=True)
    x = torch.randn(2, 5, 16)
    with capture.recording():
        mha(x, x, x)
    v = capture.records[""].v
    _, w_v = mha.in_proj_weight.split([32, 16])
    expected = (x @ w_v.T + mha.in_proj_bias[32:]).view(2, 5, 4, 4).transpose(1, 2)
    torch.testing.assert_close(v, expected)

    recorder = RecorderCapture(nn.Identity(), names=["a"], capture_values=True)
    with recorder.recording():
        record("a", x[:, None], x[:, None], v=x[:, None] * 2)
    assert torch.equal(recorder.records["a"].v, x[:, None] * 2)
    with pytest.raises(TypeError, match="`capture_values` to be a bool, but got int"):
        RecorderCapture(nn.Identity(), capture_values=1)
