"""The dispatch table (streamkl.dispatch): its shape, what it selects on the CPU for every stage, the backend rules,
the override, and the copy on the architecture page. Which Gluon kernel the table gives each problem on an H100 is
tested in test_hopper.py (its scope on any device, its runs on sm_90)."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest
import torch

from streamkl import dispatch
from streamkl._problem import KLInputs, KLSpec
from streamkl.dispatch import BackendQuery, Problem, forced

ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "concepts" / "architecture.md"


def _problem(d=64, dtype=torch.bfloat16, **flags) -> Problem:
    q = torch.randn(1, 2, 16, d).to(dtype)
    return Problem(KLInputs(q, q, q, q, *[None] * 6), KLSpec(0.125, 0.125), **flags)


def test_every_stage_ends_with_a_row_that_always_applies():
    stages = {}
    for route in dispatch.TABLE:
        stages.setdefault(route.stage, []).append(route)
    assert list(stages) == ["backend", "indexer", "forward", "training forward", "key pass", "query gradient"]
    for stage, routes in stages.items():
        assert routes[-1].scope is None and routes[-1].pays is None and not routes[-1].gluon, stage
    assert len({r.kernel for r in dispatch.TABLE}) == len(dispatch.TABLE), "kernel names are unique"


def test_every_gluon_row_pays_from_the_size_threshold_only_where_measured():
    """Every Gluon row has a scope and a size condition; no portable row has either."""
    for route in dispatch.TABLE:
        assert route.gluon == (route.pays is not None), route.kernel
        if route.gluon:
            assert route.scope is not None and route.impl is not None and route.source.startswith("_hopper/")


@pytest.mark.parametrize("forcing", [None, "portable", "gluon"])
def test_cpu_tensors_take_the_portable_kernels_at_every_stage(forcing):
    problem = _problem(128, need_b=True)
    with forced(forcing) if forcing else contextlib.nullcontext():
        assert dispatch.select("forward", problem).kernel == "triton_forward"
        assert dispatch.select("training forward", problem).kernel == "triton_training_forward"
        assert dispatch.select("key pass", problem).kernel == "triton_key_pass"


def test_the_query_gradient_rows():
    assert dispatch.select("query gradient", _problem(fused=True, deterministic=False)).kernel == "from_training_forward"
    assert dispatch.select("query gradient", _problem(deterministic=False)).kernel == "triton_atomic_dq"
    assert dispatch.select("query gradient", _problem()).kernel == "triton_query_pass"


@pytest.mark.parametrize(("backend", "device", "fp64", "expected"), [
    ("auto", "cpu", False, "reference"), ("auto", "meta", False, "reference"), ("auto", "cuda", True, "reference"),
    ("auto", "cuda", False, "triton"), ("reference", "cuda", False, "reference"), ("triton", "cpu", False, "triton"),
    ("triton", "cuda", True, "triton"),  # select_backend then refuses float64 on the kernels
])
def test_the_backend_rows(backend, device, fp64, expected):
    assert dispatch.select("backend", BackendQuery(backend, torch.device(device), fp64)).kernel == expected


def test_select_backend_refuses_what_the_kernels_cannot_serve(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_interpreter_enabled", lambda: False)
    with pytest.raises(ValueError, match=r"backend='triton' needs CUDA tensors \(got tensors on cpu\)"):
        dispatch.select_backend("triton", torch.device("cpu"))
    monkeypatch.setattr(dispatch, "triton_interpreter_enabled", lambda: True)
    with pytest.raises(TypeError, match="does not take float64 inputs"):
        dispatch.select_backend("triton", torch.device("cpu"), (torch.float64,))
    pytest.importorskip("triton")
    with pytest.raises(ValueError, match=r"head dims up to 256, but got D_t, D_s = \(512, 64\)"):
        dispatch.select_backend("triton", torch.device("cpu"), (torch.float32,), (512, 64))
    assert dispatch.select_backend("triton", torch.device("cpu"), (torch.float32,), (64, 64)) == "triton"


def test_the_training_forward_is_chosen_by_the_gradients():
    assert dispatch.fuses_dq_b("triton", False, False, True)
    assert not dispatch.fuses_dq_b("reference", False, False, True)
    assert not dispatch.fuses_dq_b("triton", True, False, True)
    assert not dispatch.fuses_dq_b("triton", False, False, False)


def test_the_architecture_page_shows_the_table():
    """docs/concepts/architecture.md's dispatch table is the code's (regenerate the block between its markers from
    ``streamkl.dispatch.table_markdown()`` when the table changes)."""
    page = ARCHITECTURE.read_text()
    (block,) = re.findall(r"<!-- dispatch-table:begin -->\n(.*?)\n<!-- dispatch-table:end -->", page, flags=re.S)
    assert block == dispatch.table_markdown()


@pytest.fixture
def hopper(monkeypatch):
    """CPU tensors taken for an sm_90 device's (the selection only; nothing runs): the table's choices on an H100."""
    if dispatch._module("_hopper.forward") is None:
        pytest.skip("this Triton has no Gluon Hopper API")
    monkeypatch.setattr(dispatch, "_gluon_device", lambda x: True)


def _large(d_t=128, d_s=None, n=16384, dtype=torch.bfloat16, causal=False, **flags) -> Problem:
    """``B·H·N_q·N_k = n²`` score elements (2^28 at the default ``n``)."""
    q_t, q_s = torch.zeros(1, 1, n, d_t, dtype=dtype), torch.zeros(1, 1, n, d_s or d_t, dtype=dtype)
    return Problem(KLInputs(q_t, q_t, q_s, q_s, *[None] * 6), KLSpec(0.1, 0.1, window_right=0 if causal else -1),
                   **flags)


def test_the_forward_on_an_h100(hopper):
    """The Gluon forward from 2^28 score elements with a head dim of 128 (either side), bf16 or fp16."""
    pick = lambda p: dispatch.select("forward", p).kernel
    assert pick(_large(128)) == "gluon_forward"
    assert pick(_large(128, 64)) == "gluon_forward"
    assert pick(_large(128, dtype=torch.float16, causal=True)) == "gluon_forward"
    assert pick(_large(64)) == "triton_forward"
    assert pick(_large(128, n=8192)) == "triton_forward"
    assert pick(_large(128, dtype=torch.float32)) == "triton_forward"
    with forced("gluon"):  # no size or head-dim condition, the scope still
        assert pick(_large(64, n=256)) == "gluon_forward"
        assert pick(_large(96, n=256)) == "triton_forward"
    with forced("portable"):
        assert pick(_large(128)) == "triton_forward"


def test_the_training_forward_on_an_h100(hopper):
    """The Gluon training forward from 2^28 score elements, bf16 or fp16, head dims 64 or 128, causal or not."""
    pick = lambda p: dispatch.select("training forward", p).kernel
    for d, causal in ((64, False), (64, True), (128, False), (128, True)):
        assert pick(_large(d, causal=causal)) == "gluon_training_forward", (d, causal)
    assert pick(_large(128, dtype=torch.float16)) == "gluon_training_forward"
    assert pick(_large(128, dtype=torch.float32)) == "triton_training_forward"
    assert pick(_large(128, n=8192)) == "triton_training_forward"
    with forced("gluon"):
        assert pick(_large(64, n=256)) == "gluon_training_forward"


@pytest.mark.parametrize(("d_t", "d_s", "causal", "kernel"), [
    (64, 64, False, "gluon_key_pass_pipelined"), (64, 64, True, "gluon_key_pass_pipelined"),
    (128, 128, False, "gluon_key_pass_stepwise"), (128, 128, True, "gluon_key_pass_warp_specialised"),
    (128, 64, False, "gluon_key_pass_pipelined"), (128, 64, True, "gluon_key_pass_warp_specialised"),
    (64, 128, False, "gluon_key_pass_stepwise")])
def test_the_key_pass_on_an_h100(hopper, d_t, d_s, causal, kernel):
    """A frozen side a's key pass: warp-specialised with a causal mask and a head dim above 64, else one warpgroup,
    pipelined at D_b <= 64; never for a trainable side a, atomic query gradients or small problems."""
    pick = lambda p: dispatch.select("key pass", p).kernel
    assert pick(_large(d_t, d_s, causal=causal, need_b=True)) == kernel
    assert pick(_large(d_t, d_s, causal=causal, need_a=True, need_b=True)) == "triton_key_pass"
    assert pick(_large(d_t, d_s, causal=causal, need_b=True, deterministic=False)) == "triton_key_pass"
    assert pick(_large(d_t, d_s, causal=causal, need_b=True, deterministic=False, fused=True)) == kernel
    assert pick(_large(d_t, d_s, n=8192, causal=causal, need_b=True)) == "triton_key_pass"
    with forced("gluon"):
        assert pick(_large(d_t, d_s, n=256, causal=causal, need_b=True)) == kernel


def test_a_causal_sliding_window_and_sinks_take_the_gluon_training_kernels(hopper):
    """A causal sliding window (``window_left >= 0``, ``window_right == 0``) and sinks run the training forward and the
    key passes on Gluon; the metric forward, a two-sided window and a non-causal one with a left bound stay
    portable."""
    def windowed(d, left, right=0, **flags) -> Problem:
        p = _large(d, causal=True, **flags)
        return p._replace(spec=KLSpec(0.1, 0.1, window_left=left, window_right=right))

    assert dispatch.select("training forward", windowed(64, 4096)).kernel == "gluon_training_forward"
    assert dispatch.select("training forward", windowed(128, 0)).kernel == "gluon_training_forward"
    assert dispatch.select("key pass", windowed(64, 4096, need_b=True)).kernel == "gluon_key_pass_pipelined"
    assert dispatch.select("key pass", windowed(128, 4096, need_b=True)).kernel == "gluon_key_pass_warp_specialised"
    assert dispatch.select("forward", windowed(128, 4096)).kernel == "triton_forward"
    sinks = torch.zeros(1)
    with_sinks = lambda p: p._replace(inputs=p.inputs._replace(sink_a=sinks, sink_b=sinks))  # gpt-oss
    assert dispatch.select("training forward", with_sinks(windowed(64, 128))).kernel == "gluon_training_forward"
    assert dispatch.select("key pass", with_sinks(windowed(64, 128, need_b=True))).kernel == "gluon_key_pass_pipelined"
    assert dispatch.select("forward", with_sinks(_large(128))).kernel == "triton_forward"
    fp16 = with_sinks(windowed(64, 128))
    fp16 = fp16._replace(inputs=fp16.inputs._replace(**{n: x.half() for n, x in zip(("q_a", "k_a", "q_b", "k_b"),
                                                                                    fp16.inputs[:4])}))
    assert dispatch.select("training forward", fp16).kernel == "triton_training_forward"  # fp16 with sinks: unchecked
    for left, right in ((4096, 16), (4096, -1), (-1, 16)):
        assert dispatch.select("training forward", windowed(64, left, right)).kernel == "triton_training_forward"
        assert dispatch.select("key pass", windowed(64, left, right, need_b=True)).kernel == "triton_key_pass"


def test_the_override_nests_and_restores(hopper):
    pick = lambda: dispatch.select("forward", _large(128)).kernel
    with forced("portable"):
        with forced("gluon"):
            assert pick() == "gluon_forward"
        assert pick() == "triton_forward"
    assert pick() == "gluon_forward"
    with pytest.raises(RuntimeError), forced("portable"):
        raise RuntimeError
    assert pick() == "gluon_forward"


def _walked(stage: str, p: Problem) -> str:
    """The row the table gives ``p``, walked afresh (what :func:`dispatch.select` remembers must equal it)."""
    forcing = dispatch._forced[-1] if dispatch._forced else None
    return next(r for r in dispatch._STAGES[stage] if dispatch._applies(r, p, forcing)).kernel


def test_a_remembered_choice_tells_one_offsets_tensor_from_two(hopper):
    """Packed sequences take the Gluon training rows only with one offsets tensor for queries and keys: a pack of the
    same shapes with two offsets tensors, after one with one, is chosen afresh (the portable kernels), and the other
    way round."""
    n, d = 1 << 15, 64
    q = torch.zeros(1, 1, n, d, dtype=torch.bfloat16)
    cu = torch.tensor([0, n // 2, n], dtype=torch.int32)
    spec = KLSpec(0.1, 0.1, window_right=0, max_seqlen_q=n // 2, max_seqlen_k=n // 2)
    one = Problem(KLInputs(q, q, q, q, None, None, None, None, cu, cu), spec, need_b=True)
    two = Problem(KLInputs(q, q, q, q, None, None, None, None, cu, cu.clone()), spec, need_b=True)
    for stage in ("training forward", "key pass"):
        for order in ((one, two), (two, one)):
            dispatch._CHOSEN.clear()
            chosen = [dispatch.select(stage, p).kernel for p in order]
            assert chosen == [_walked(stage, p) for p in order], stage
            assert [k.startswith("gluon") for k in chosen] == [p is one for p in order], stage


def test_a_remembered_choice_is_made_again_when_anything_its_rows_read_differs(hopper, monkeypatch):
    """``select`` remembers each choice of a stage with Gluon rows; a problem of the same shapes that differs in what
    the rows read (a base 2 bytes off 16, a row stride TMA cannot address, a dtype, a window, the gradients asked for,
    the override, the size threshold) is chosen afresh, and every answer is the table's."""
    dispatch._CHOSEN.clear()
    n, d = 16384, 64
    base = _large(d, causal=True, need_b=True)
    flat = torch.zeros(n * d + 8, dtype=torch.bfloat16)
    off_16 = flat[1:1 + n * d].view(1, 1, n, d)  # same shape and strides, base not 16-byte aligned
    wide_rows = torch.zeros(1, 1, n, 68, dtype=torch.bfloat16)[..., :d]  # a 136-byte row stride
    variants = [
        base,
        base._replace(inputs=base.inputs._replace(q_b=off_16)),
        base._replace(inputs=base.inputs._replace(k_b=wide_rows)),
        _large(d, causal=True, need_b=True, dtype=torch.float32),
        base._replace(spec=KLSpec(0.1, 0.1, softcap_a=30.0, window_right=0)),
        base._replace(need_a=True),
    ]
    for stage in ("training forward", "key pass"):
        chosen = [dispatch.select(stage, p).kernel for p in variants + variants]
        assert chosen == [_walked(stage, p) for p in variants + variants], stage
        # only the base problem is Gluon's (and the one asking for side a's gradients, which no forward reads)
        gluon = [True, False, False, False, False, stage == "training forward"]
        assert [k.startswith("gluon") for k in chosen] == gluon + gluon, stage
        with forced("portable"):
            assert dispatch.select(stage, base).kernel.startswith("triton")
        monkeypatch.setattr(dispatch, "GLUON_MIN_SCORES", 2 * n * n)
        assert dispatch.select(stage, base).kernel.startswith("triton")
        monkeypatch.setattr(dispatch, "GLUON_MIN_SCORES", n * n)
        assert dispatch.select(stage, base).kernel == chosen[0]
