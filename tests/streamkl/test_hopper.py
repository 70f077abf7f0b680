"""The Hopper (sm_90, Gluon) forwards and key pass: their selection everywhere, their results on an H100.

Gluon has no CPU interpreter, so CI checks which problems the dispatch table gives the Hopper kernels (scope, size
threshold, the ``dispatch.forced`` override); the GPU tests (skipped off sm_90) check that they ran and that they match the
float64 oracle as closely as the portable kernels do: the forward, gradients through the two-pass backward that reads
its log-sum-exps, and the student's gradients of the training call (frozen teacher, ``reduction="mean"`` as users
call it, and a weighted per-row loss) through the fused training forward, which gives the portable one's bits, and
the key pass.
"""

from __future__ import annotations

import importlib
from dataclasses import replace

import pytest
import torch

from streamkl import attention_kl, dispatch
from streamkl._problem import KLInputs, KLSpec, key_head_split
from streamkl.dispatch import Problem, forced
from tests._helpers import assert_close
from tests.streamkl.cases import Case, make_inputs
from tests.streamkl.oracle import TOLERANCES

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _gluon_module(name: str):
    """``streamkl._hopper.<name>``, or None where this Triton's Gluon API does not import (as the dispatch treats it)."""
    try:
        return importlib.import_module(f"streamkl._hopper.{name}")
    except (ImportError, AttributeError):
        return None


_forward = _gluon_module("forward")
_backward = _gluon_module("backward")
_fused = _gluon_module("fused_forward")
#: The Hopper key passes' rows of the dispatch table.
GLUON_KEY_PASSES = ("gluon_key_pass_warp_specialised", "gluon_key_pass_pipelined", "gluon_key_pass_stepwise")


def _inputs(*shape, dtype=torch.bfloat16, **extras) -> KLInputs:
    q = torch.randn(*shape).to(dtype)
    fields = dict(q_a=q, k_a=q, q_b=q, k_b=q, sink_a=None, sink_b=None, key_padding_mask=None, query_mask=None,
                  cu_seqlens_q=None, cu_seqlens_k=None)
    fields.update(extras)
    return KLInputs(**fields)


def _count_calls(monkeypatch, module, name: str) -> list:
    """Wrap ``module.<name>`` so that every call appends to the returned list (how the tests see a kernel ran)."""
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    return calls


def test_cpu_tensors_never_take_the_hopper_kernel():
    with forced("gluon"):  # even where a Gluon kernel could compute the call
        assert dispatch.select("forward", Problem(_inputs(1, 4, 4096, 64), KLSpec(0.125, 0.125))).kernel == \
            "triton_forward"


def test_forced_names_its_argument():
    with pytest.raises(ValueError, match=r"Expected argument `kernels` to be one of \['portable', 'gluon'\], but got 'all'"), \
            forced("all"):
        pass


@pytest.mark.parametrize(("inputs", "spec", "expected"), [
    (_inputs(1, 2, 256, 64), KLSpec(0.1, 0.1), True),
    (_inputs(1, 2, 256, 128, dtype=torch.float16), KLSpec(0.1, 0.1, window_right=0), True),
    (_inputs(1, 2, 256, 64, dtype=torch.float32), KLSpec(0.1, 0.1), False),  # fp32: portable kernel
    (_inputs(1, 2, 256, 96), KLSpec(0.1, 0.1), False),  # head dim outside {64, 128}
    (_inputs(1, 2, 256, 64), KLSpec(0.1, 0.1, softcap_a=30.0), False),
    (_inputs(1, 2, 256, 64), KLSpec(0.1, 0.1, window_left=16, window_right=0), False),
    (_inputs(1, 2, 256, 64), KLSpec(0.1, 0.1, window_right=4), False),
    (_inputs(1, 2, 256, 64, key_padding_mask=torch.ones(1, 256, dtype=torch.bool)), KLSpec(0.1, 0.1), False),
    (_inputs(1, 2, 256, 64, query_mask=torch.ones(1, 256, dtype=torch.bool)), KLSpec(0.1, 0.1), False),
    (_inputs(1, 2, 256, 64, sink_a=torch.zeros(2), sink_b=torch.zeros(2)), KLSpec(0.1, 0.1), False),
], ids=["bf16", "fp16-causal", "fp32", "d96", "softcap", "window", "right-window", "key-mask", "query-mask",
        "sinks"])
def test_scope(inputs, spec, expected):
    assert dispatch.in_scope("gluon_forward", Problem(inputs, spec)) is expected


def test_scope_needs_tma_addressable_tensors():
    q = torch.randn(1, 2, 256, 64).to(torch.bfloat16)
    spec = KLSpec(0.1, 0.1)
    strided = torch.randn(1, 2, 256, 65).to(torch.bfloat16)[..., :64]  # rows of 130 bytes: not 16-byte aligned
    scope = lambda inputs, spec: dispatch.in_scope("gluon_forward", Problem(inputs, spec))
    assert not scope(KLInputs(q, strided, q, q, None, None, None, None, None, None), spec)
    causal_short_keys = KLInputs(q, q[:, :, :100], q, q[:, :, :100], None, None, None, None, None, None)
    assert not scope(causal_short_keys, KLSpec(0.1, 0.1, window_right=0))  # a causal row with no key
    assert scope(causal_short_keys, spec)
    mixed = KLInputs(q, q, q.half(), q.half(), None, None, None, None, None, None)
    assert not scope(mixed, spec)


# ---------------------------------------------------------------------------------------------------------- H100
H = Case(b=1, h=4, h_kt=4, h_ks=4, n_q=1000, n_k=1000, d_t=64, d_s=64)
HOPPER_CASES = [
    (H, torch.bfloat16),
    (replace(H, n_q=777, n_k=777, causal=True, teacher_grad=True), torch.bfloat16),
    (replace(H, h=8, h_kt=2, n_q=1030, n_k=1030, d_t=128, d_s=128, causal=True), torch.bfloat16),
    (replace(H, h_ks=1, n_q=513, n_k=1500, d_t=128, d_s=64, causal=True, teacher_grad=True), torch.float16),
    (replace(H, b=2, n_q=300, n_k=2100, d_t=64, d_s=128, direction="reverse", temperature=2.0, layout="bnhd",
             teacher_grad=True), torch.bfloat16),
    (replace(H, n_q=1024, n_k=1024, causal=True, sharpness=30.0), torch.bfloat16),
    (replace(H, n_q=64, n_k=64, h=2, h_kt=2, h_ks=2), torch.float16),
]


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize(("case", "dtype"), [pytest.param(c, d, id=f"{c.id}-{d}".replace("torch.", ""))
                                             for c, d in HOPPER_CASES])
def test_hopper_forward_matches_the_oracle_and_runs(case: Case, dtype: torch.dtype, monkeypatch):
    """Every case runs the Hopper forward for a metric (no grad); cases whose teacher trains also run it under
    autograd (a frozen teacher's training forward is the fused one, :func:`streamkl.autograd.fuses_dq_b`), and the
    two-pass backward reads its log-sum-exps."""
    calls = _count_calls(monkeypatch, _forward, "attention_kl_fwd_hopper")
    inputs = make_inputs(case, dtype, "cuda")
    ref_tensors = inputs.float64_copies()
    ref = attention_kl(**ref_tensors, reduction="none", backend="reference", **case.kwargs())
    rtol_fwd, rtol_grad = TOLERANCES[dtype]
    with forced("gluon"), torch.no_grad():  # small shapes and head dim 64 too
        out = inputs.call(attention_kl, reduction="none", backend="triton", **case.kwargs())
    assert len(calls) == 1, "the Hopper forward did not run"
    assert_close(out, ref.detach(), rtol_fwd, "kl")
    with forced("portable"), torch.no_grad():  # the portable kernel on the same inputs
        portable = inputs.call(attention_kl, reduction="none", backend="triton", **case.kwargs())
    assert len(calls) == 1
    err = lambda x: float((x.double() - ref.detach()).norm() / ref.detach().norm())
    assert err(out) <= 2 * err(portable) + 1e-6, "the Hopper forward is less exact than the portable one"
    if not case.teacher_grad:
        return
    grad_out = torch.randn(ref.shape, dtype=torch.float64, device="cuda")
    with forced("gluon"):
        out = inputs.call(attention_kl, reduction="none", backend="triton", **case.kwargs())
        assert len(calls) == 2, "the Hopper forward did not run under autograd"
        (out * grad_out.float()).sum().backward()
    (ref * grad_out).sum().backward()
    assert_close(out, ref.detach(), rtol_fwd, "kl")
    for name, x in inputs.tensors.items():
        if ref_tensors[name].grad is not None:
            assert_close(x.grad, ref_tensors[name].grad, rtol_grad, f"d{name}")


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 (Hopper) GPU")
def test_default_selection_on_the_gpu():
    """Without an override: head dim 128 at the threshold runs the Hopper forward; head dim 64 and small problems
    do not (measured slower there)."""

    def picked(n, d):
        q = torch.randn(1, 4, n, d, device="cuda", dtype=torch.bfloat16)
        problem = Problem(KLInputs(q, q, q, q, None, None, None, None, None, None), KLSpec(0.1, 0.1))
        return dispatch.select("forward", problem).kernel == "gluon_forward"

    assert picked(8192, 128)
    assert not picked(8192, 64)
    assert not picked(1024, 128)


# ------------------------------------------------------------------------------------------------- fused forward
def test_cpu_tensors_never_take_the_hopper_fused_forward():
    with forced("gluon"):
        problem = Problem(_inputs(1, 4, 4096, 64), KLSpec(0.125, 0.125))
        assert dispatch.select("training forward", problem).kernel == "triton_training_forward"


@pytest.mark.parametrize(("inputs", "spec", "expected"), [
    (_inputs(1, 2, 256, 64), KLSpec(0.1, 0.1), True),
    (_inputs(1, 2, 256, 128), KLSpec(0.1, 0.1, window_right=0), True),
    (_inputs(1, 2, 256, 128, dtype=torch.float16), KLSpec(0.1, 0.1), True),
    (_inputs(1, 2, 256, 128, dtype=torch.float32), KLSpec(0.1, 0.1), False),  # fp32: the portable kernel
    (_inputs(1, 2, 256, 64), KLSpec(0.1, 0.1, softcap_b=30.0), False),
    (_inputs(1, 2, 256, 64), KLSpec(0.1, 0.1, window_left=16, window_right=0), True),  # a causal sliding window
    (_inputs(1, 2, 256, 64), KLSpec(0.1, 0.1, window_left=16, window_right=-1), False),  # a left bound alone
    (_inputs(1, 2, 256, 64, sink_a=torch.zeros(2), sink_b=torch.zeros(2)), KLSpec(0.1, 0.1, window_left=16,
                                                                                  window_right=0), True),
    (_inputs(1, 2, 256, 64, key_padding_mask=torch.ones(1, 256, dtype=torch.bool)), KLSpec(0.1, 0.1), False),
], ids=["bf16", "bf16-causal", "fp16", "fp32", "softcap", "sliding-window", "left-bound", "sinks-window", "key-mask"])
def test_fused_forward_scope(inputs, spec, expected):
    assert dispatch.in_scope("gluon_training_forward", Problem(inputs, spec)) is expected


FUSED_CASES = [  # every case in the fused Gluon forward's scope: bf16, head dims 64 and 128, no masks
    replace(H, b=2),
    replace(H, n_q=777, n_k=777, causal=True),
    replace(H, h=8, h_kt=2, h_ks=8, n_q=1030, n_k=1030, d_t=128, d_s=128, causal=True),
    replace(H, h=8, h_kt=8, h_ks=2, n_q=700, n_k=700, causal=True),
    replace(H, n_q=513, n_k=1500, d_t=128, d_s=64, causal=True),
    replace(H, b=2, n_q=300, n_k=2100, d_t=64, d_s=128, temperature=2.0, layout="bnhd"),
    replace(H, n_q=1024, n_k=1024, causal=True, sharpness=30.0),
    replace(H, n_q=64, n_k=64, h=2, h_kt=2, h_ks=2),
    replace(H, h=16, h_kt=16, h_ks=16, n_q=4096, n_k=4096, d_t=128, d_s=128, causal=True),  # dQ_s saved in bf16
]


def _fused_problem(case: Case) -> tuple[KLInputs, KLSpec]:
    inputs = make_inputs(case, torch.bfloat16, "cuda")
    t = {n: x.transpose(1, 2) if case.layout == "bnhd" else x for n, x in inputs.tensors.items()}
    spec = KLSpec(case.d_t ** -0.5 / case.temperature, case.d_s ** -0.5 / case.temperature,
                  window_right=0 if case.causal else -1)
    return KLInputs(t["q_t"], t["k_t"], t["q_s"], t["k_s"], None, None, None, None, None, None), spec


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in FUSED_CASES])
def test_hopper_fused_forward_gives_the_portable_forwards_bits(case: Case):
    """The Gluon training forward (KL, both lse and the student's query gradient) is bitwise the portable one, in
    either dQ_s dtype, and its query gradient matches the float64 oracle."""
    from streamkl._triton.forward import attention_kl_fwd, new_dq_b_buffer

    inputs, spec = _fused_problem(case)
    with forced("gluon"):
        assert dispatch.select("training forward", Problem(inputs, spec)).kernel == "gluon_training_forward"
    dq_gluon, dq_portable = new_dq_b_buffer(inputs), new_dq_b_buffer(inputs)
    gluon = (*_fused.attention_kl_fused_fwd_hopper(inputs, spec, dq_gluon), dq_gluon)
    portable = (*attention_kl_fwd(inputs, spec, dq_b=dq_portable), dq_portable)
    for name, x, y in zip(("kl", "lse_a", "lse_b", "dq_s"), gluon, portable):
        assert torch.equal(x, y), f"{name} differs from the portable kernel's"
    q_t, k_t, q_s, k_s = (x.detach().double() for x in inputs[:4])
    q_s.requires_grad_(True)
    ref = attention_kl(q_t, k_t, q_s, k_s, causal=case.causal, scale_t=spec.scale_a, scale_s=spec.scale_b,
                       reduction="sum", backend="reference")
    (ref_dq,) = torch.autograd.grad(ref, (q_s,))
    assert_close(dq_gluon, ref_dq, TOLERANCES[torch.bfloat16][1], "dq_s")


@pytest.mark.skipif(_forward is None, reason="this Triton has no Gluon Hopper API")
@pytest.mark.parametrize(("heads", "key_heads", "d"), [(16, 16, 64), (16, 4, 128), (3, 3, 128)])
def test_causal_gluon_forwards_order_their_rows_as_the_portable_forward(heads, key_heads, d):
    """Both Gluon forwards launch a causal problem as the portable forward does since v12 (v18): one-dimensional,
    longest row tiles first, in chunks of the portable forward's size (keys of both sides within half of the L2);
    without a mask, a (row tiles, pairs) grid."""
    from streamkl._triton.forward import _forward_plan
    from streamkl._triton_common.launch import tensor_geometry

    q = torch.randn(2, heads, 4096, d, dtype=torch.bfloat16)
    k = torch.randn(2, key_heads, 4096, d, dtype=torch.bfloat16)
    inputs = KLInputs(q, k, q, k, *[None] * 6)
    causal = KLSpec(0.1, 0.1, window_right=0)
    _, scalars, meta = _forward_plan(tensor_geometry(q, k, q, k, None, None, None), (q.dtype, q.dtype), causal,
                                     (False, False), 2, False, None, True)  # the CPU's 50 MiB of L2, as below
    assert dict(meta)["LONGEST_FIRST"]
    portable_chunk = scalars[-1]
    for rows in (64, 128):
        grid, chunk = _forward.row_tile_grid(inputs, causal, rows)
        assert grid == (4096 // rows * 2 * heads, 1) and chunk == portable_chunk
        assert _forward.row_tile_grid(inputs, KLSpec(0.1, 0.1), rows) == ((4096 // rows, 2 * heads), 1)


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("chunk", [1, 4])
def test_causal_gluon_forwards_in_longest_first_chunks_give_the_one_chunk_bits(chunk, monkeypatch):
    """With the chunk forced to 1 and to 4 (the 6 (sequence, head) pairs then end in a narrower chunk), both causal
    Gluon forwards give bitwise the outputs of a single chunk, and the fused one still the portable kernel's: each
    program's work does not depend on when it runs, and none is skipped or repeated."""
    from streamkl._hopper import forward
    from streamkl._triton.forward import attention_kl_fwd, new_dq_b_buffer

    inputs, spec = _fused_problem(replace(H, b=2, h=3, h_kt=3, h_ks=3, n_q=1030, n_k=1030, d_t=128, d_s=128,
                                          causal=True))

    def both():
        dq = new_dq_b_buffer(inputs)
        return (*forward.attention_kl_fwd_hopper(inputs, spec), *_fused.attention_kl_fused_fwd_hopper(inputs, spec,
                                                                                                         dq), dq)

    monkeypatch.setattr(forward, "longest_first_chunk", lambda *a: 6)
    whole = both()
    monkeypatch.setattr(forward, "longest_first_chunk", lambda *a: chunk)
    assert forward.row_tile_grid(inputs, spec, 64)[1] == chunk
    for name, x, y in zip(("kl", "lse_a", "lse_b", "fused kl", "fused lse_a", "fused lse_b", "dq_s"), both(), whole):
        assert torch.equal(x, y), f"{name} depends on the chunk"
    dq = new_dq_b_buffer(inputs)
    portable = (*attention_kl_fwd(inputs, spec, dq_b=dq), dq)
    assert all(torch.equal(x, y) for x, y in zip(whole[3:], portable))


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 (Hopper) GPU")
def test_default_fused_forward_selection_on_the_gpu():
    """Without an override: head dims 64 and 128 at the threshold, with or without a causal mask, bf16 or fp16, run
    the fused Gluon forward (measured faster there); small problems and fp32 do not."""

    def picked(n, d, dtype=torch.bfloat16, causal=False):
        q = torch.randn(1, 4, n, d, device="cuda", dtype=dtype)
        problem = Problem(KLInputs(q, q, q, q, *[None] * 6), KLSpec(0.1, 0.1, window_right=0 if causal else -1))
        return dispatch.select("training forward", problem).kernel == "gluon_training_forward"

    assert picked(8192, 128)
    assert picked(8192, 128, causal=True)
    assert picked(8192, 64)
    assert picked(8192, 64, causal=True)
    assert not picked(1024, 128)
    assert picked(8192, 128, torch.float16)
    assert not picked(8192, 128, torch.float32)


# ------------------------------------------------------------------------------------------------------ key pass
def test_cpu_tensors_never_take_the_hopper_key_pass():
    with forced("gluon"):
        problem = Problem(_inputs(1, 4, 4096, 64), KLSpec(0.125, 0.125), need_a=False, need_b=True)
        assert dispatch.select("key pass", problem).kernel == "triton_key_pass"


def test_the_size_threshold():
    """Every Gluon row pays from 2^28 score elements per distribution (B·H·N_q·N_k) up; the forward's only at head
    dim 128."""
    big, small = _inputs(1, 1, 1 << 14, 128), _inputs(1, 1, 1 << 13, 128)  # 2^28 and 2^26 score elements
    gluon_rows = [r for r in dispatch.TABLE if r.gluon]
    assert len(gluon_rows) == 5
    for row in gluon_rows:
        assert row.pays(Problem(big, KLSpec(0.1, 0.1))) and not row.pays(Problem(small, KLSpec(0.1, 0.1))), row.kernel
    (forward_row,) = [r for r in gluon_rows if r.kernel == "gluon_forward"]
    assert not forward_row.pays(Problem(_inputs(1, 1, 1 << 14, 64), KLSpec(0.1, 0.1)))


def test_packed_sequences_take_the_gluon_training_kernels_with_one_offsets_tensor():
    """Packed sequences whose queries and keys share one offsets tensor are in the training kernels' scope (one launch
    over every sequence), not in the plain forward's; two offsets tensors are not (a sequence could have fewer keys
    than rows); the size condition bounds the score elements by the longest sequence."""
    cu = torch.tensor([0, 100, 101, 256], dtype=torch.int32)
    one = _inputs(1, 4, 256, 64, cu_seqlens_q=cu, cu_seqlens_k=cu)
    two = _inputs(1, 4, 256, 64, cu_seqlens_q=cu, cu_seqlens_k=cu.clone())
    spec = KLSpec(0.125, 0.125, window_right=0, max_seqlen_q=155, max_seqlen_k=155)
    rows = ("gluon_training_forward", "gluon_key_pass_pipelined")
    for row in rows:
        assert dispatch.in_scope(row, Problem(one, spec, need_b=True)), row
        assert not dispatch.in_scope(row, Problem(two, spec, need_b=True)), row
    assert not dispatch.in_scope("gluon_forward", Problem(one, spec))
    (training,) = [r for r in dispatch.TABLE if r.kernel == "gluon_training_forward"]
    longest = 1 << 14
    packed = _inputs(1, 1, 1 << 14, 128, cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert training.pays(Problem(packed, replace(spec, max_seqlen_q=longest, max_seqlen_k=longest)))
    assert not training.pays(Problem(packed, replace(spec, max_seqlen_q=longest // 4, max_seqlen_k=longest // 4)))


def test_a_right_padded_batch_takes_the_gluon_training_kernels_with_its_lengths():
    """Masks are in the Gluon training kernels' scope only with the lengths of the prefixes they keep (set where the
    host checked them, :func:`streamkl.dispatch.read_masks`); never in the plain forward's."""
    mask = torch.arange(256) < torch.tensor([256, 100])[:, None]
    lengths = torch.tensor([[256, 100], [256, 100]], dtype=torch.int32)
    spec = KLSpec(0.125, 0.125, window_right=0)
    with_lengths = _inputs(2, 4, 256, 64, key_padding_mask=mask, query_mask=mask, lengths=lengths)
    without = _inputs(2, 4, 256, 64, key_padding_mask=mask, query_mask=mask)
    for row in ("gluon_training_forward", "gluon_key_pass_pipelined"):
        assert dispatch.in_scope(row, Problem(with_lengths, spec, need_b=True)), row
        assert not dispatch.in_scope(row, Problem(without, spec, need_b=True)), row
    assert not dispatch.in_scope("gluon_forward", Problem(with_lengths, spec))


def test_equal_offsets_become_one_device_tensor():
    """Offsets the host reads (on the CPU, or read because no maximum was given) that are equal for queries and keys
    reach the kernels as one tensor, which the Gluon training kernels need; unequal ones stay two."""
    from streamkl._validation import prepare_problem
    from streamkl.options import AttentionKLOptions

    q = torch.randn(10, 2, 16)
    cu, same_values = torch.tensor([0, 6, 10], dtype=torch.int32), torch.tensor([0, 6, 10], dtype=torch.int32)
    problem = prepare_problem(q, q, q, q, AttentionKLOptions(layout="thd", cu_seqlens_q=cu, cu_seqlens_k=same_values))
    assert problem.cu_seqlens_k is problem.cu_seqlens_q
    other = torch.tensor([0, 4, 10], dtype=torch.int32)
    problem = prepare_problem(q, q, q, q, AttentionKLOptions(layout="thd", cu_seqlens_q=cu, cu_seqlens_k=other))
    assert problem.cu_seqlens_k is not problem.cu_seqlens_q
    assert problem.cu_seqlens_k.tolist() == [0, 4, 10]


def _grouped(h_kt: int, h_ks: int, heads: int = 8) -> KLInputs:
    q = torch.randn(1, heads, 256, 64).to(torch.bfloat16)
    return KLInputs(q, q[:, :h_kt], q, q[:, :h_ks], None, None, None, None, None, None)


@pytest.mark.parametrize(("inputs", "spec", "grads", "expected"), [
    (_inputs(1, 2, 256, 64), KLSpec(0.1, 0.1), (False, True), True),
    (_inputs(1, 2, 256, 128), KLSpec(0.1, 0.1, window_right=0), (False, True), True),
    (_inputs(1, 2, 256, 64), KLSpec(0.1, 0.1), (True, True), False),  # the teacher trains: two-pass backward
    (_inputs(1, 2, 256, 64), KLSpec(0.1, 0.1), (True, False), False),
    (_inputs(1, 2, 256, 64, dtype=torch.float16), KLSpec(0.1, 0.1), (False, True), True),  # fp16, one gradient
    (_inputs(1, 2, 256, 64, dtype=torch.float16), KLSpec(0.1, 0.1), (False, True, True, False, False), False),
    (_inputs(1, 2, 256, 64, dtype=torch.float32), KLSpec(0.1, 0.1), (False, True), False),
    (_inputs(1, 2, 256, 96), KLSpec(0.1, 0.1), (False, True), False),
    (_inputs(1, 2, 256, 64), KLSpec(0.1, 0.1, softcap_b=30.0), (False, True), False),
    (_inputs(1, 2, 256, 64), KLSpec(0.1, 0.1, window_left=16, window_right=0), (False, True), True),
    (_inputs(1, 2, 256, 64), KLSpec(0.1, 0.1, window_left=16, window_right=4), (False, True), False),
    (_inputs(1, 2, 256, 64, key_padding_mask=torch.ones(1, 256, dtype=torch.bool)), KLSpec(0.1, 0.1),
     (False, True), False),
    (_inputs(1, 2, 256, 64, sink_a=torch.zeros(2), sink_b=torch.zeros(2)), KLSpec(0.1, 0.1), (False, True), True),
    (_grouped(2, 8), KLSpec(0.1, 0.1), (False, True), True),  # GQA teacher, MHA student
    (_grouped(2, 4), KLSpec(0.1, 0.1), (False, True), True),  # both grouped, the teacher coarser
    (_grouped(8, 2), KLSpec(0.1, 0.1), (False, True), True),  # a student key head spans 4 teacher key heads
    (_grouped(4, 6, heads=12), KLSpec(0.1, 0.1), (False, True), False),  # 3 and 2 query heads per key head
], ids=["bf16", "d128-causal", "teacher-grad", "teacher-only", "fp16", "fp16-per-row-gradient", "fp32", "d96",
        "softcap", "sliding-window", "two-sided-window",
        "key-mask", "sinks", "gqa-teacher", "gqa-both", "gqa-student-coarser", "groupings-that-do-not-divide"])
def test_key_pass_scope(inputs, spec, grads, expected):
    problem = Problem(inputs, spec, *grads)
    assert any(dispatch.in_scope(kernel, problem) for kernel in GLUON_KEY_PASSES) is expected
    assert sum(dispatch.in_scope(kernel, problem) for kernel in GLUON_KEY_PASSES) <= 1  # the variants do not overlap


@pytest.mark.parametrize(("causal", "d_t", "d_s", "kernel"), [
    (True, 128, 128, "gluon_key_pass_warp_specialised"), (True, 128, 64, "gluon_key_pass_warp_specialised"),
    (True, 64, 64, "gluon_key_pass_pipelined"), (False, 64, 64, "gluon_key_pass_pipelined"),
    (False, 128, 64, "gluon_key_pass_pipelined"), (False, 128, 128, "gluon_key_pass_stepwise"),
    (False, 64, 128, "gluon_key_pass_stepwise")])
def test_the_key_pass_variant_by_mask_and_head_dims(causal, d_t, d_s, kernel):
    """The warp-specialised key pass with a causal mask and a head dim above 64; else the one-warpgroup pass, its
    full steps pipelined where side b's head dim is at most 64 and one at a time above."""
    q_t, q_s = torch.randn(1, 2, 256, d_t).to(torch.bfloat16), torch.randn(1, 2, 256, d_s).to(torch.bfloat16)
    problem = Problem(KLInputs(q_t, q_t, q_s, q_s, *[None] * 6), KLSpec(0.1, 0.1, window_right=0 if causal else -1),
                      need_a=False, need_b=True)
    assert [k for k in GLUON_KEY_PASSES if dispatch.in_scope(k, problem)] == [kernel]


def test_no_gluon_key_pass_beside_atomic_query_gradients():
    inputs = _inputs(1, 2, 256, 64)
    atomic = Problem(inputs, KLSpec(0.1, 0.1), need_a=False, need_b=True, deterministic=False)
    assert not any(dispatch.in_scope(k, atomic) for k in GLUON_KEY_PASSES)
    fused = atomic._replace(fused=True)  # the training forward's backward is the key pass alone: deterministic
    assert dispatch.in_scope("gluon_key_pass_pipelined", fused)


@pytest.mark.parametrize(("group_a", "group_b", "split"), [(1, 1, 1), (4, 1, 1), (4, 2, 1), (4, 4, 1), (1, 4, 4),
                                                           (2, 8, 4), (3, 2, None), (2, 3, None)])
def test_key_head_split(group_a, group_b, split):
    """Programs per student key head: one when its query heads share a teacher key head, else one per teacher key
    head it spans."""
    assert key_head_split(group_a, group_b) == split


KEY_PASS_CASES = [  # (case, loss): every case has a frozen teacher and a trainable student (the fused path)
    (replace(H, b=2), "mean"),
    (replace(H, n_q=777, n_k=777, causal=True), "mean"),
    (replace(H, h=8, h_kt=2, h_ks=8, n_q=1030, n_k=1030, d_t=128, d_s=128, causal=True), "mean"),
    (replace(H, h=8, h_kt=2, h_ks=4, n_q=1030, n_k=1030, d_t=128, d_s=128, causal=True), "sum"),
    (replace(H, h=8, h_kt=8, h_ks=2, n_q=700, n_k=700, causal=True), "mean"),  # a student key head spans 4 teacher's
    (replace(H, h=8, h_kt=4, h_ks=1, n_q=500, n_k=500, d_t=128), "weighted"),  # ... and 4 again, per-row gradient
    (replace(H, n_q=513, n_k=1500, d_t=128, d_s=64, causal=True), "weighted"),
    (replace(H, b=2, n_q=300, n_k=2100, d_t=64, d_s=128, temperature=2.0, layout="bnhd"), "mean"),
    (replace(H, n_q=1024, n_k=1024, causal=True, sharpness=30.0), "mean"),
    (replace(H, n_q=64, n_k=64, h=2, h_kt=2, h_ks=2), "weighted"),
]


def _student_grads(case: Case, loss: str, dtype: torch.dtype, after_call=lambda label: None):
    """``(oracle, {"hopper": ..., "portable": ...})``: the student's ``(dQ_s, dK_s)`` of the frozen-teacher training
    call in ``dtype`` (``loss``: "mean", "sum", or "weighted", a per-row weighted sum), from the float64 reference
    and from the Triton backend forced onto the Gluon and the portable kernels; ``after_call(label)`` runs after
    each."""
    inputs = make_inputs(case, dtype, "cuda")
    inputs.tensors["q_s"].requires_grad_(True)
    inputs.tensors["k_s"].requires_grad_(True)
    ref_tensors = inputs.float64_copies()
    reduction = "none" if loss == "weighted" else loss
    ref_out = attention_kl(**ref_tensors, **inputs.extras, reduction=reduction, backend="reference", **case.kwargs())
    weights = torch.rand(ref_out.shape, dtype=torch.float64, device="cuda")

    def loss_of(out):
        return (out * weights.to(out.dtype)).sum() if loss == "weighted" else out

    ref = loss_of(ref_out)
    ref_grads = torch.autograd.grad(ref, (ref_tensors["q_s"], ref_tensors["k_s"]))
    grads = {}
    for label, switch in (("hopper", "gluon"), ("portable", "portable")):
        with forced(switch):
            out = loss_of(inputs.call(attention_kl, reduction=reduction, backend="triton", **case.kwargs()))
            grads[label] = torch.autograd.grad(out, (inputs.tensors["q_s"], inputs.tensors["k_s"]))
        after_call(label)
    return ref_grads, grads


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize(("case", "loss"), [pytest.param(c, loss, id=f"{c.id}-{loss}") for c, loss in KEY_PASS_CASES])
def test_hopper_key_pass_matches_the_oracle_and_runs(case: Case, loss: str, monkeypatch):
    """The training call with a frozen teacher, bf16: the student's gradients match the float64 oracle with the
    Hopper fused forward and key pass (forced onto these small shapes), as closely as with the portable kernels; dQ_s
    (the forward's) is bitwise the same either way."""
    calls = _count_calls(monkeypatch, _backward, "attention_kl_key_pass_hopper")
    fused_calls = _count_calls(monkeypatch, _fused, "attention_kl_fused_fwd_hopper")

    def ran_once(label):
        assert len(calls) == 1, f"the Hopper key pass ran {len(calls)} times after the {label} call, expected once"
        assert len(fused_calls) == 1, f"the fused Hopper forward ran {len(fused_calls)} times after the {label} call"

    ref_grads, grads = _student_grads(case, loss, torch.bfloat16, ran_once)
    _, rtol_grad = TOLERANCES[torch.bfloat16]
    assert_close(grads["hopper"][0], ref_grads[0], rtol_grad, "dq_s")
    assert_close(grads["hopper"][1], ref_grads[1], rtol_grad, "dk_s")
    assert torch.equal(grads["hopper"][0], grads["portable"][0])
    err = lambda x: float((x.double() - ref_grads[1]).norm() / ref_grads[1].norm())
    assert err(grads["hopper"][1]) <= 1.5 * err(grads["portable"][1]) + 1e-6, \
        "the Hopper key pass is less exact than the portable one"


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize(("case", "loss"), [pytest.param(c, loss, id=f"{c.id}-{loss}") for c, loss in KEY_PASS_CASES])
def test_fp16_training_call_on_the_hopper_kernels_matches_the_oracle(case: Case, loss: str, monkeypatch):
    """fp16, frozen teacher: the fused Hopper forward runs, and so does the Hopper key pass where the upstream
    gradient is one number (``"mean"``, ``"sum"``: in the forward, writing fp32 gradients; a per-row one takes the
    portable pass in the backward); the student's gradients (fp16) are
    within 1.5× the portable kernels' error against the float64 oracle (whose fp16 accuracy the portable tests hold;
    on two of these cases it exceeds the 1e-2 of ``TOLERANCES`` for both kernels alike, up to 0.1 for ``dK_s`` with
    D_s = 128 over 2100 keys)."""
    calls = _count_calls(monkeypatch, _backward, "attention_kl_key_pass_hopper")
    fused_calls = _count_calls(monkeypatch, _fused, "attention_kl_fused_fwd_hopper")
    ref_grads, grads = _student_grads(case, loss, torch.float16)
    assert len(fused_calls) == 1
    assert len(calls) == (0 if loss == "weighted" else 1)
    for i, name in enumerate(("dq_s", "dk_s")):
        assert grads["hopper"][i].dtype == torch.float16, name
        err = lambda x: float((x.double() - ref_grads[i]).norm() / ref_grads[i].norm())  # noqa: B023
        assert err(grads["hopper"][i]) <= 1.5 * err(grads["portable"][i]) + 1e-6, f"{name}: less exact than portable"


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("closeness", [1e-2, 1e-4], ids=["close", "closer"])
def test_fp16_training_forward_of_a_student_close_to_its_teacher_keeps_its_query_gradient(closeness, monkeypatch):
    """fp16 with the student within ``closeness`` of its teacher (the end of a distillation): ``p_b·r − p_a`` is far
    below the probabilities, and the Gluon training forward's fp16 frames (one power of two per row, set by its first
    tile, moved down only: :func:`streamkl._hopper.fused_forward._fp16_frame`) must keep it from fp16's subnormals.
    Its ``dQ_s`` stays within 1.5× the portable kernel's error against the float64 oracle (the portable kernel scales
    every tile by its own largest magnitude)."""
    fused_calls = _count_calls(monkeypatch, _fused, "attention_kl_fused_fwd_hopper")
    g = torch.Generator(device="cuda").manual_seed(0)
    q_t, k_t = (torch.randn(2, 4, 1000, 64, device="cuda", generator=g, dtype=torch.float64) for _ in range(2))
    q_s, k_s = (x + closeness * torch.randn(x.shape, device="cuda", generator=g, dtype=torch.float64)
                for x in (q_t, k_t))
    q_t, k_t, q_s, k_s = (x.to(torch.float16) for x in (q_t, k_t, q_s, k_s))  # the oracle sees the same inputs
    ref_q = q_s.double().requires_grad_(True)
    ref_grad, = torch.autograd.grad(
        attention_kl(q_t.double(), k_t.double(), ref_q, k_s.double(), causal=True, backend="reference"), ref_q)
    errors = {}
    for switch in ("gluon", "portable"):
        q = q_s.clone().requires_grad_(True)
        with forced(switch):
            grad, = torch.autograd.grad(attention_kl(q_t, k_t, q, k_s, causal=True), q)
        errors[switch] = float((grad.double() - ref_grad).norm() / ref_grad.norm())
    assert len(fused_calls) == 1
    assert errors["gluon"] <= 1.5 * errors["portable"] + 1e-6, errors


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 (Hopper) GPU")
def test_default_key_pass_selection_on_the_gpu():
    """Without an override: both head dims at the threshold run a Hopper key pass (measured faster there); small
    problems and a trainable teacher do not."""

    def picked(n, d, need_grad_a=False):
        q = torch.randn(1, 4, n, d, device="cuda", dtype=torch.bfloat16)
        inputs = KLInputs(q, q, q, q, None, None, None, None, None, None)
        return dispatch.select("key pass", Problem(inputs, KLSpec(0.1, 0.1), need_grad_a, True)).gluon

    assert picked(8192, 128)
    assert picked(8192, 64)
    assert not picked(1024, 128)
    assert not picked(8192, 64, need_grad_a=True)


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 (Hopper) GPU")
def test_the_hopper_kernels_never_synchronise_with_the_host():
    """The Hopper forward (a metric call) and key pass (a training call, frozen teacher): no implicit host
    synchronisation (``torch.cuda.set_sync_debug_mode("error")`` raises on one)."""
    q_t, k_t = (torch.randn(2, 4, 512, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q_s, k_s = (torch.randn(2, 4, 512, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))

    def calls():
        with torch.no_grad():
            attention_kl(q_t, k_t, q_s, k_s)
        attention_kl(q_t, k_t, q_s, k_s, causal=True).backward()
        attention_kl(q_t, k_t, q_s, k_s).backward()

    with forced("gluon"):
        calls()  # compile outside the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            calls()
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("poison", ["future-keys", "query-row"])
def test_hopper_key_pass_contains_non_finite_inputs_like_the_portable_pass(poison, monkeypatch):
    """Non-finite keys only later rows see, or a NaN query row, under a causal mask: the training call's loss rows and
    the student's gradients through the Hopper fused forward and key pass are bitwise those of the portable kernels,
    NaNs in the same places (the portable kernels' containment is tested in test_real_teacher.py and
    test_reliability.py); the poisoned rows are left out of the loss, as a user masking them would."""
    calls = _count_calls(monkeypatch, _backward, "attention_kl_key_pass_hopper")
    fused_calls = _count_calls(monkeypatch, _fused, "attention_kl_fused_fwd_hopper")
    g = torch.Generator(device="cuda").manual_seed(0)
    q_t, k_t, q_s, k_s = (torch.randn(1, 2, 300, 64, device="cuda", generator=g).to(torch.bfloat16) for _ in range(4))
    if poison == "future-keys":
        k_t[0, :, 200] = float("nan")
        k_s[0, :, 250] = float("inf")
    else:
        q_s[0, 1, 100, 3] = float("nan")
    results = {}
    for switch in ("gluon", "portable"):
        with forced(switch):
            q, k = q_s.clone().requires_grad_(True), k_s.clone().requires_grad_(True)
            out = attention_kl(q_t, k_t, q, k, causal=True, reduction="none")
            out.masked_fill(~torch.isfinite(out.detach()), 0.0).sum().backward()
            results[switch] = (out.detach(), q.grad, k.grad)
    assert len(calls) == 1, "the Hopper key pass did not run"
    assert len(fused_calls) == 1, "the fused Hopper forward did not run"
    assert not torch.isfinite(results["portable"][0]).all(), "the poison reached no row: the test checks nothing"
    for name, hopper_value, portable_value in zip(("kl", "dq_s", "dk_s"), results["gluon"], results["portable"]):
        torch.testing.assert_close(hopper_value, portable_value, rtol=0, atol=0, equal_nan=True, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("chunk", [1, 3])
def test_hopper_causal_key_pass_in_longest_first_chunks_is_bitwise_the_one_chunk_pass(chunk, monkeypatch):
    """The causal Hopper key pass runs its longest sweeps first in chunks of (sequence, key head, part) triples sized
    from the L2 cache (v12). With the L2 size forced so that the 8 triples (2 sequences, 2 student key heads, a split
    of 2) split into chunks of 1 and of 3 (the last one narrower), the student's key gradient is bitwise the one of a
    single chunk: each program's work does not depend on when it runs, and none is skipped or repeated."""
    from streamkl._hopper import backward

    case = replace(H, b=2, h=8, h_kt=4, h_ks=2, n_q=1030, n_k=1030, causal=True)
    calls = _count_calls(monkeypatch, _backward, "attention_kl_key_pass_hopper")
    inputs = make_inputs(case, torch.bfloat16, "cuda")
    inputs.tensors["k_s"].requires_grad_(True)

    def key_gradient():
        with forced("gluon"):
            out = inputs.call(attention_kl, backend="triton", **case.kwargs())
            return torch.autograd.grad(out, (inputs.tensors["k_s"],))[0]

    whole = key_gradient()
    query_bytes = (8 // 2 // 2) * 1030 * (64 + 64) * 2  # per program: 2 query heads, both sides' queries, bf16
    monkeypatch.setattr(backward, "l2_cache_bytes", lambda index: 2 * chunk * query_bytes)
    assert torch.equal(key_gradient(), whole)
    assert len(calls) == 2


def _key_pass_problem(case: Case, grad: str):
    """``(views, inputs, spec, kl, lse_a, lse_b, g)`` of a key-pass case on the GPU: the (B, H, N, D) views of its
    tensors, the kernels' problem, the training forward's outputs and an upstream gradient (``"scalar"``: the mean's,
    else random per row)."""
    from streamkl._triton.forward import attention_kl_fwd, new_dq_b_buffer

    tensors = make_inputs(case, torch.bfloat16, "cuda").tensors
    views = [tensors[name] for name in ("q_t", "k_t", "q_s", "k_s")]
    if case.layout == "bnhd":
        views = [x.transpose(1, 2) for x in views]
    inputs = KLInputs(*views, None, None, None, None, None, None)
    spec = KLSpec(case.d_t ** -0.5, case.d_s ** -0.5, window_right=0 if case.causal else -1)
    kl, lse_a, lse_b = attention_kl_fwd(inputs, spec, dq_b=new_dq_b_buffer(inputs))
    g = torch.full((1,), 1.0 / kl.numel(), device="cuda") if grad == "scalar" else torch.rand(kl.shape, device="cuda")
    return views, inputs, spec, kl, lse_a, lse_b, g


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("grad", ["scalar", "per row"])
@pytest.mark.parametrize("case", [c for c, _ in KEY_PASS_CASES], ids=lambda c: c.id)
def test_both_hopper_key_passes_agree_and_match_the_oracle(case: Case, grad: str):
    """The warp-specialised key pass (v13) and the one-warpgroup pass (v10, its causal diagonal swept apart since v14),
    each with its own default tiles, forced on every key-pass case (causal or not, key-head splits, odd lengths, both
    layouts): the student's key gradient is bitwise the same wherever both sweep each key's query tiles in the same
    order (no mask, or one query head per program); with a causal mask and several query heads per program the
    one-warpgroup pass sweeps every head's diagonal first, and both match the float64 oracle as closely."""
    views, inputs, spec, kl, lse_a, lse_b, g = _key_pass_problem(case, grad)
    assert any(dispatch.in_scope(k, Problem(inputs, spec, False, True)) for k in GLUON_KEY_PASSES)
    one = _backward.attention_kl_key_pass_hopper(g, inputs, spec, lse_a, lse_b, specialised=False,
                                                 overlap=case.d_s <= 64)  # the variant the table runs
    ws = _backward.attention_kl_key_pass_hopper(g, inputs, spec, lse_a, lse_b, specialised=True, overlap=False)
    assert torch.isfinite(ws).all() and ws.abs().max() > 0
    group_a, group_b = case.h // case.h_kt, case.h // case.h_ks
    heads_per_program = group_b // key_head_split(group_a, group_b)
    if not case.causal or heads_per_program == 1:
        assert torch.equal(ws, one)
        return
    k_s = views[3].double().requires_grad_(True)
    per_row = attention_kl(views[0].double(), views[1].double(), views[2].double(), k_s, reduction="none",
                           causal=True, backend="reference")  # the default scales, D^-1/2 per side, as in spec
    ref = torch.autograd.grad((per_row * g.double().expand(kl.shape)).sum(), k_s)[0]
    err = lambda x: float((x.double() - ref).norm() / ref.norm())
    assert not torch.equal(ws, one), "the orders differ here: equal results mean the diagonal was not swept first"
    assert err(one) <= 1.05 * err(ws) and err(ws) <= 1.05 * err(one), (err(one), err(ws))
    assert_close(one, ref, TOLERANCES[torch.bfloat16][1], "dk_s")


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize(("causal", "d", "specialised"), [(True, 128, True), (True, 64, False), (False, 128, False),
                                                        (False, 64, False)])
def test_the_training_call_picks_the_key_pass_by_mask_and_head_dim(causal, d, specialised, monkeypatch):
    """The key pass of a causal training call at head dim 128 runs the warp-specialised kernel, and at head dim 64 or
    without a mask the one-warpgroup kernel, whose full steps are pipelined at head dim 64 and taken one at a time at
    head dim 128 (the dispatch table's variants, forced onto this small shape); the gradients match the float64
    oracle."""
    ws_calls, one_calls = [], []
    real_ws, real_one = _backward._launch_ws, _backward._launch_dk
    monkeypatch.setattr(_backward, "_launch_ws", lambda *a: (ws_calls.append(1), real_ws(*a))[1])
    monkeypatch.setattr(_backward, "_launch_dk", lambda *a: (one_calls.append(dict(a[3])), real_one(*a))[1])
    case = replace(H, h=4, n_q=700, n_k=700, d_t=d, d_s=d, causal=causal)
    inputs = make_inputs(case, torch.bfloat16, "cuda")
    inputs.tensors["k_s"].requires_grad_(True)
    ref_tensors = inputs.float64_copies()
    with forced("gluon"):
        out = inputs.call(attention_kl, backend="triton", **case.kwargs())
        dk = torch.autograd.grad(out, (inputs.tensors["k_s"],))[0]
    ref = attention_kl(**ref_tensors, backend="reference", **case.kwargs())
    dk_ref = torch.autograd.grad(ref, (ref_tensors["k_s"],))[0]
    assert (len(ws_calls), len(one_calls)) == ((1, 0) if specialised else (0, 1))
    assert all(meta["OVERLAP"] == (d <= 64) for meta in one_calls), "full steps pipelined at head dim 64 only"
    assert_close(dk, dk_ref, TOLERANCES[torch.bfloat16][1], "dk_s")


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("grad", ["scalar", "per row"])
@pytest.mark.parametrize("case", [c for c, _ in KEY_PASS_CASES], ids=lambda c: c.id)
def test_the_one_warpgroup_key_pass_gives_the_same_gradient_pipelined_or_one_step_at_a_time(case: Case, grad: str):
    """The one-warpgroup key pass with its full steps pipelined (two register sets of scores in flight) and one at a
    time (v16's choice at head dim 128) folds the same steps in the same order: bitwise the same key gradient on every
    key-pass case, both head dims, causal or not."""
    _, inputs, spec, _, lse_a, lse_b, g = _key_pass_problem(case, grad)
    pipelined, single = (_backward.attention_kl_key_pass_hopper(g, inputs, spec, lse_a, lse_b, specialised=False,
                                                                overlap=overlap) for overlap in (True, False))
    assert torch.isfinite(single).all() and single.abs().max() > 0
    assert torch.equal(pipelined, single)


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 (Hopper) GPU")
def test_masks_that_mask_nothing_leave_the_call_on_the_gluon_kernels(monkeypatch):
    """On a problem where the Gluon rows pay, an all-True ``key_padding_mask`` and ``query_mask`` on the GPU stay with
    the lengths of every token (:func:`streamkl.dispatch.read_masks`, no synchronisation): the fused Gluon forward
    runs, with the maskless call's per-row KL and gradients, bitwise; a mask with one False key runs there too, its
    row reading its key mask, with the portable kernels' result within the bf16 tolerances."""
    fused_calls = _count_calls(monkeypatch, _fused, "attention_kl_fused_fwd_hopper")
    q_t, k_t = (torch.randn(1, 16, 4096, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q_s, k_s = (torch.randn(1, 16, 4096, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))
    everything = torch.ones(1, 4096, dtype=torch.bool, device="cuda")

    def run(**options):
        kl = attention_kl(q_t, k_t, q_s, k_s, causal=True, **options)
        return (kl, *torch.autograd.grad(kl, (q_s, k_s)))

    plain = run(reduction="sum")
    assert len(fused_calls) == 1
    full = run(key_padding_mask=everything, query_mask=everything, reduction="sum")
    assert len(fused_calls) == 2
    for x, y in zip(full, plain):
        assert torch.equal(x, y)
    one_dropped = everything.clone()
    one_dropped[0, 1000] = False
    got = run(key_padding_mask=one_dropped)
    assert len(fused_calls) == 3
    with forced("portable"):
        want = run(key_padding_mask=one_dropped)
    rtol_fwd, rtol_grad = TOLERANCES[torch.bfloat16]
    assert_close(got[0], want[0], rtol_fwd, "kl")
    for x, y, name in zip(got[1:], want[1:], ("dq_s", "dk_s")):
        assert_close(x, y, rtol_grad, name)
    assert not got[2][0, :, 1000].any()


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("causal", [True, False])
def test_a_right_padded_batch_runs_in_one_gluon_launch(causal, monkeypatch):
    """A right-padded batch (the same prefix kept by ``key_padding_mask`` and ``query_mask`` in each batch row) runs
    in one launch of the fused Gluon forward and one of the Gluon key pass, which read each row's lengths; its loss
    and gradients are the masked call's (the masks read as they are, on the portable kernels), within the tolerance
    of two kernels that sum in different orders, and zero on the padding. Masks on the GPU and masks given on the CPU
    run the same way without a synchronisation (an all-True CPU one is dropped)."""
    fused_calls = _count_calls(monkeypatch, _fused, "attention_kl_fused_fwd_hopper")
    key_pass_calls = _count_calls(monkeypatch, _backward, "attention_kl_key_pass_hopper")
    lengths = (8192, 6000)
    q_t, k_t = (torch.randn(2, 16, 8192, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q_s, k_s = (torch.randn(2, 16, 8192, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))
    mask = torch.arange(8192, device="cuda") < torch.tensor(lengths, device="cuda")[:, None]

    def run():
        kl = attention_kl(q_t, k_t, q_s, k_s, causal=causal, key_padding_mask=mask, query_mask=mask)
        return (kl, *torch.autograd.grad(kl, (q_s, k_s)))

    split = _split_matches_unsplit(run, "_reads_masks", fused_calls, 1, monkeypatch)
    assert len(key_pass_calls) == 1
    for got in split[1:]:
        assert not got[1, :, lengths[1]:].any()
    monkeypatch.undo()
    # the masks on the CPU (as a data collator makes them): the same launch, and an all-True mask dropped, read
    # without a synchronisation
    fused_calls = _count_calls(monkeypatch, _fused, "attention_kl_fused_fwd_hopper")
    host, everything = mask.cpu(), torch.ones(2, 8192, dtype=torch.bool)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        kl = attention_kl(q_t, k_t, q_s, k_s, causal=causal, key_padding_mask=host, query_mask=host)
        kl_everything = attention_kl(q_t, k_t, q_s, k_s, causal=causal, key_padding_mask=everything)
        kl_on_gpu = attention_kl(q_t, k_t, q_s, k_s, causal=causal, key_padding_mask=mask, query_mask=mask)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(fused_calls) == 3
    assert torch.equal(kl, split[0]) and torch.equal(kl_on_gpu, split[0])
    assert torch.equal(kl_everything, attention_kl(q_t, k_t, q_s, k_s, causal=causal))


PADDED_CASES = [  # (kwargs, loss): a masked batch B=4, N=1000, H=4 (_batch_masks)
    (dict(causal=True), "mean"),  # one-warpgroup key pass, head dim 64
    (dict(causal=True, d_t=128, d_s=128, h_kt=2), "sum"),  # warp-specialised key pass, a GQA teacher
    (dict(causal=False, d_t=128), "weighted"),  # not causal, D_t -> D_s, one upstream gradient per row
    (dict(causal=False), "mean"),  # not causal at head dim 64 on both sides
    (dict(causal=True, window=(100, 0)), "mean"),  # a causal sliding window
    (dict(causal=True, sinks=True), "mean"),  # sinks
]


def _batch_masks(kind: str, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(query_mask, key_padding_mask)`` of 4 batch rows of ``n`` tokens: ``"right-padded"``, rows of 1000, 617, 1
    and 0 real tokens (one mask for both); ``"any"``, rows a right-padded row's (617 tokens), a left-padded one's
    (from token 383), one with random holes (a tenth of the keys and of the rows) and a full one."""
    if kind == "right-padded":
        mask = torch.arange(n) < torch.tensor([1000, 617, 1, 0])[:, None]
        return mask, mask
    keys = torch.arange(n) < torch.tensor([617, n, n, n])[:, None]
    keys[1, :383] = False
    rows = keys.clone()
    keys[2] = torch.rand(n, generator=g) > 0.1
    rows[2] = torch.rand(n, generator=g) > 0.1
    return rows, keys


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("masks", ["right-padded", "any"])
@pytest.mark.parametrize(("kw", "loss"), PADDED_CASES, ids=[f"{'-'.join(map(str, k.items()))}-{loss}"
                                                         for k, loss in PADDED_CASES])
def test_masked_training_call_in_one_gluon_launch_matches_the_oracle(kw: dict, loss: str, masks: str, monkeypatch):
    """A masked batch with its masks read (as for a large call), forced onto the Gluon training kernels at these
    small shapes: one fused forward and one key pass over every row, right-padded rows sweeping their prefixes and
    the others (left padding, holes) reading their masks; the KL within the bf16 tolerance of the float64 oracle,
    the student's gradients within it and within 1.5× the portable kernels' error, and exactly zero on every row the
    query mask excludes and every key the key mask drops."""
    monkeypatch.setattr(dispatch, "_reads_masks",
                        lambda problem: problem.key_padding_mask is not None or problem.query_mask is not None)
    calls = _count_calls(monkeypatch, _backward, "attention_kl_key_pass_hopper")
    fused_calls = _count_calls(monkeypatch, _fused, "attention_kl_fused_fwd_hopper")
    kw = dict(kw)
    d_t, d_s, h_kt, sinks = kw.pop("d_t", 64), kw.pop("d_s", 64), kw.pop("h_kt", 4), kw.pop("sinks", False)
    g = torch.Generator().manual_seed(0)
    n, heads = 1000, 4
    query_mask, key_mask = _batch_masks(masks, n, g)
    tensors = {"q_t": torch.randn(4, heads, n, d_t, generator=g), "k_t": torch.randn(4, h_kt, n, d_t, generator=g),
               "q_s": torch.randn(4, heads, n, d_s, generator=g), "k_s": torch.randn(4, heads, n, d_s, generator=g)}
    if sinks:
        tensors.update(sinks_t=torch.randn(heads, generator=g), sinks_s=torch.randn(heads, generator=g))
    query_mask, key_mask = query_mask.cuda(), key_mask.cuda()
    weights = torch.rand(4, heads, n, generator=g, dtype=torch.float64).cuda()

    def grads(dtype, **options):
        t = {k: v.to("cuda", dtype if k.startswith(("q", "k")) else torch.float32) for k, v in tensors.items()}
        t = {k: v.to(torch.float64) if dtype == torch.float64 else v for k, v in t.items()}
        t["q_s"].requires_grad_(True)
        t["k_s"].requires_grad_(True)
        out = attention_kl(**t, key_padding_mask=key_mask, query_mask=query_mask,
                           reduction="none" if loss == "weighted" else loss, **kw, **options)
        out = (out * weights.to(out.dtype)).sum() if loss == "weighted" else out
        return (out.detach(), *torch.autograd.grad(out, (t["q_s"], t["k_s"])))

    ref = grads(torch.float64, backend="reference")
    with forced("gluon"):
        hopper = grads(torch.bfloat16)
    assert (len(fused_calls), len(calls)) == (1, 1)
    with forced("portable"):
        portable = grads(torch.bfloat16)
    assert (len(fused_calls), len(calls)) == (1, 1)
    rtol_fwd, rtol_grad = TOLERANCES[torch.bfloat16]
    assert_close(hopper[0], ref[0], rtol_fwd, "loss")
    for i, name, dropped in ((1, "dq_s", ~query_mask), (2, "dk_s", ~key_mask)):
        assert_close(hopper[i], ref[i], rtol_grad, name)
        err = lambda x: float((x.double() - ref[i]).norm() / ref[i].norm())  # noqa: B023
        assert err(hopper[i]) <= 1.5 * err(portable[i]) + 1e-6, f"{name}: less exact than portable"
        assert not hopper[i].transpose(1, 2)[dropped].any(), f"{name}: a gradient on a masked token"


def _split_matches_unsplit(run, gate: str, fused_calls: list, fused: int, monkeypatch) -> tuple:
    """``run()`` (the result and the gradients of a call) split into pieces, with ``fused`` calls of the fused Gluon
    forward, against the same call with the dispatch's ``gate`` closed (on the portable kernels, no further fused
    call): the KL and the gradients within the bf16 tolerances of kernels that sum in different orders. Returns the
    split call's."""
    split = run()
    assert len(fused_calls) == fused
    monkeypatch.setattr(dispatch, gate, lambda problem: False)
    whole = run()
    assert len(fused_calls) == fused
    rtol_fwd, rtol_grad = TOLERANCES[torch.bfloat16]
    assert_close(split[0], whole[0], rtol_fwd, "kl")
    for got, want, name in zip(split[1:], whole[1:], ("dq_s", "dk_s")):
        assert_close(got, want, rtol_grad, name)
    return split


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_packed_sequences_run_in_one_gluon_launch_without_a_synchronisation(reduction, head_dim, monkeypatch):
    """Packed sequences (``layout="thd"``, one offsets tensor on the GPU, the maxima given) run in one launch of the
    fused Gluon forward and one of the Gluon key pass, with no host synchronisation; a GQA student, odd sequence
    lengths. Loss (or per-row KL) and gradients are the packed call's on the portable kernels, within the tolerance of
    kernels that sum in different orders, under a real upstream gradient; the same offsets on the CPU (as a data
    collator makes them, two tensors of equal values) give the same bits."""
    fused_calls = _count_calls(monkeypatch, _fused, "attention_kl_fused_fwd_hopper")
    key_pass_calls = _count_calls(monkeypatch, _backward, "attention_kl_key_pass_hopper")
    offsets = [0, 9000, 9100, 17000]
    cu = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    total, heads = offsets[-1], 16
    q_t, k_t = (torch.randn(total, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q_s = torch.randn(total, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k_s = torch.randn(total, 4, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    packing = {"layout": "thd", "cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": 9000, "max_seqlen_k": 9000}
    upstream = torch.randn((total, heads) if reduction == "none" else (), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(0))

    def run():
        kl = attention_kl(q_t, k_t, q_s, k_s, causal=True, reduction=reduction, **packing)
        return (kl, *torch.autograd.grad(kl, (q_s, k_s), upstream.to(kl.dtype)))

    run()  # compile outside the check
    torch.cuda.synchronize()
    fused_calls.clear()
    key_pass_calls.clear()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gluon = run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert (len(fused_calls), len(key_pass_calls)) == (1, 1)
    with forced("portable"):
        portable = run()
    assert (len(fused_calls), len(key_pass_calls)) == (1, 1)
    rtol_fwd, rtol_grad = TOLERANCES[torch.bfloat16]
    assert_close(gluon[0], portable[0], rtol_fwd, "kl")
    for got, want, name in zip(gluon[1:], portable[1:], ("dq_s", "dk_s")):
        assert_close(got, want, rtol_grad, name)
    packing.update(cu_seqlens_q=cu.cpu(), cu_seqlens_k=cu.cpu().clone())
    on_cpu = run()
    assert (len(fused_calls), len(key_pass_calls)) == (2, 2)
    for got, want in zip(on_cpu, gluon):
        assert torch.equal(got, want)


PACKED_CASES = [  # (case, loss): packed sequences (one offsets tensor), frozen teacher, trainable student
    (replace(H, seqlens=(300, 1, 0, 64, 700, 129), causal=True), "mean"),  # one-warpgroup key pass, head dim 64
    (replace(H, h=8, h_kt=2, h_ks=8, seqlens=(513, 200, 77), d_t=128, d_s=128, causal=True), "sum"),  # warp-specialised
    (replace(H, seqlens=(450, 130, 65), d_t=128, d_s=64), "weighted"),  # not causal, D_t -> D_s
    (replace(H, h=8, h_kt=8, h_ks=2, seqlens=(333, 500), d_t=128, d_s=128), "mean"),  # one step at a time, GQA student
    (replace(H, seqlens=(400, 90, 611), causal=True, window=(100, 0)), "mean"),  # a causal sliding window
    (replace(H, seqlens=(700, 300), causal=True, sinks=True), "mean"),  # sinks
]


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize(("case", "loss"), [pytest.param(c, loss, id=f"{c.id}-{loss}") for c, loss in PACKED_CASES])
def test_packed_training_call_on_the_gluon_kernels_matches_the_oracle(case: Case, loss: str, monkeypatch):
    """Packed sequences of odd lengths (one of a single token, an empty one), forced onto the Gluon training kernels at
    these small shapes: one fused forward and one key pass over every sequence, and the student's gradients match
    the float64 oracle as closely as the portable kernels' do (within 1.5× their error)."""
    calls = _count_calls(monkeypatch, _backward, "attention_kl_key_pass_hopper")
    fused_calls = _count_calls(monkeypatch, _fused, "attention_kl_fused_fwd_hopper")

    def ran_once(label):
        assert (len(fused_calls), len(calls)) == (1, 1), f"after the {label} call: {len(fused_calls)}, {len(calls)}"

    ref_grads, grads = _student_grads(case, loss, torch.bfloat16, ran_once)
    _, rtol_grad = TOLERANCES[torch.bfloat16]
    for i, name in enumerate(("dq_s", "dk_s")):
        assert_close(grads["hopper"][i], ref_grads[i], rtol_grad, name)
        err = lambda x: float((x.double() - ref_grads[i]).norm() / ref_grads[i].norm())  # noqa: B023
        assert err(grads["hopper"][i]) <= 1.5 * err(grads["portable"][i]) + 1e-6, f"{name}: less exact than portable"


SLIDING_CASES = [  # (case, loss): a causal sliding window, frozen teacher, trainable student
    (replace(H, n_q=1000, n_k=1000, causal=True, window=(100, 0)), "mean"),  # one-warpgroup key pass, head dim 64
    (replace(H, h=8, h_kt=2, h_ks=8, n_q=777, n_k=777, d_t=128, d_s=128, causal=True, window=(200, 0)), "mean"),
    (replace(H, h=8, h_kt=8, h_ks=2, n_q=700, n_k=700, causal=True, window=(5, 0)), "weighted"),  # below a tile
    (replace(H, n_q=513, n_k=513, d_t=128, d_s=64, causal=True, window=(0, 0)), "sum"),  # the diagonal alone
    # keys far before the queries: key tiles no row's window reaches (their gradient is zero)
    (replace(H, n_q=300, n_k=1100, causal=True, window=(150, 0)), "mean"),
    (replace(H, n_q=300, n_k=1100, d_t=128, d_s=128, causal=True, window=(150, 0)), "mean"),
    (replace(H, b=2, n_q=1030, n_k=1030, causal=True, window=(4096, 0), layout="bnhd"), "mean"),  # wider than N
]


def _sliding_spec(case: Case) -> KLSpec:
    return KLSpec(case.d_t ** -0.5, case.d_s ** -0.5, window_left=case.window[0], window_right=0)


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize(("case", "loss"), [pytest.param(c, loss, id=f"{c.id}-{loss}") for c, loss in SLIDING_CASES])
def test_a_causal_sliding_window_runs_on_the_gluon_training_kernels(case: Case, loss: str, monkeypatch):
    """A causal sliding window, as users call it (``window=(left, 0)``, frozen teacher): the fused Gluon forward and a
    Gluon key pass run; the training forward gives the portable one's KL and lse bits, and its dQ_s bits where both
    decide the rescaling over the same rows (head dim 64: 64 rows; at 128 the portable kernel decides over 128, each
    Gluon consumer over its 64, and rows whose windows start at different tiles round ``w`` differently), else dQ_s
    as exact as the portable one's; both key passes (warp-specialised and one warpgroup) match the float64 oracle as
    closely as the portable pass, the key tiles no row's window reaches included; the student's gradients of the call
    match the oracle."""
    from streamkl._triton.configs import forward_config
    from streamkl._triton.forward import attention_kl_fwd, new_dq_b_buffer

    views, inputs, _, _, _, _, _ = _key_pass_problem(replace(case, window=None), "scalar")
    spec = _sliding_spec(case)
    for stage, problem in (("training forward", Problem(inputs, spec, fused=True)),
                           ("key pass", Problem(inputs, spec, False, True, fused=True))):
        with forced("gluon"):
            assert dispatch.select(stage, problem).gluon, stage
    dq_gluon, dq_portable = new_dq_b_buffer(inputs), new_dq_b_buffer(inputs)
    gluon = (*_fused.attention_kl_fused_fwd_hopper(inputs, spec, dq_gluon), dq_gluon)
    portable = (*attention_kl_fwd(inputs, spec, dq_b=dq_portable), dq_portable)
    for name, x, y in zip(("kl", "lse_a", "lse_b"), gluon, portable):
        assert torch.equal(x, y), f"{name} differs from the portable kernel's"
    kl, lse_a, lse_b = portable[:3]
    g = torch.rand(kl.shape, device="cuda")
    q_s, k_s = views[2].double().requires_grad_(True), views[3].double().requires_grad_(True)
    per_row = attention_kl(views[0].double(), views[1].double(), q_s, k_s, reduction="none", causal=True,
                           window=case.window, backend="reference")
    dk_ref = torch.autograd.grad((per_row * g.double()).sum(), k_s, retain_graph=True)[0]
    if forward_config(case.d_t, case.d_s, fused_dq=True).block_m == _fused.fused_forward_config(
            case.d_t, case.d_s).block_m:
        assert torch.equal(dq_gluon, dq_portable), "dq_s differs from the portable kernel's"
    else:  # per unit upstream gradient of the sum: the oracle's with g = 1
        dq_unit = torch.autograd.grad(per_row.sum(), q_s)[0]
        dq_err = lambda x: float((x.double() - dq_unit).norm() / dq_unit.norm())
        assert dq_err(dq_gluon) <= 1.05 * dq_err(dq_portable) + 1e-6, (dq_err(dq_gluon), dq_err(dq_portable))
    err = lambda x: float((x.double() - dk_ref).norm() / dk_ref.norm())
    dk_portable = _run_portable_key_pass(g, inputs, spec, kl, lse_a, lse_b)
    for specialised in (True, False):
        dk = _backward.attention_kl_key_pass_hopper(g, inputs, spec, lse_a, lse_b, specialised=specialised,
                                                    overlap=not specialised and case.d_s <= 64)
        assert_close(dk, dk_ref, TOLERANCES[torch.bfloat16][1], f"dk_s (specialised={specialised})")
        assert err(dk) <= 1.5 * err(dk_portable) + 1e-6, f"specialised={specialised}: less exact than portable"

    calls = _count_calls(monkeypatch, _backward, "attention_kl_key_pass_hopper")
    fused_calls = _count_calls(monkeypatch, _fused, "attention_kl_fused_fwd_hopper")
    ref_grads, grads = _student_grads(case, loss, torch.bfloat16)
    assert (len(fused_calls), len(calls)) == (1, 1), "the Gluon training kernels did not run"
    for i, name in enumerate(("dq_s", "dk_s")):
        assert_close(grads["hopper"][i], ref_grads[i], TOLERANCES[torch.bfloat16][1], name)
    assert torch.equal(grads["hopper"][0], grads["portable"][0])


def _run_portable_key_pass(g, inputs: KLInputs, spec: KLSpec, kl, lse_a, lse_b) -> torch.Tensor:
    """Side b's key gradient from the portable key pass (the frozen teacher's two-pass backward)."""
    from streamkl._triton.backward import attention_kl_bwd

    return attention_kl_bwd(g, inputs, spec, kl, lse_a, lse_b, False, True, False)[3]


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 (Hopper) GPU")
def test_fp16_sliding_window_on_the_gluon_training_kernels_matches_the_oracle(monkeypatch):
    """fp16, a causal sliding window, ``reduction="mean"``: both Gluon training kernels run and the student's
    gradients are within 1.5× the portable kernels' error against the float64 oracle."""
    calls = _count_calls(monkeypatch, _backward, "attention_kl_key_pass_hopper")
    fused_calls = _count_calls(monkeypatch, _fused, "attention_kl_fused_fwd_hopper")
    case = replace(H, n_q=1000, n_k=1000, causal=True, window=(300, 0))
    ref_grads, grads = _student_grads(case, "mean", torch.float16)
    assert (len(fused_calls), len(calls)) == (1, 1)
    for i, name in enumerate(("dq_s", "dk_s")):
        err = lambda x: float((x.double() - ref_grads[i]).norm() / ref_grads[i].norm())  # noqa: B023
        assert err(grads["hopper"][i]) <= 1.5 * err(grads["portable"][i]) + 1e-6, f"{name}: less exact than portable"


SINK_CASES = [  # (case, train the student's sinks): gpt-oss's attention (sinks, and a sliding window on some layers)
    (replace(H, n_q=1000, n_k=1000, causal=True, sinks=True), False),  # frozen sinks: gradients ahead
    (replace(H, n_q=1000, n_k=1000, causal=True, sinks=True), True),  # trainable sinks: the two-pass backward
    (replace(H, h=8, h_kt=2, h_ks=2, n_q=777, n_k=777, causal=True, sinks=True, window=(128, 0)), True),
    (replace(H, h=8, h_kt=2, h_ks=8, n_q=1030, n_k=1030, d_t=128, d_s=128, causal=True, sinks=True), False),
    (replace(H, b=2, n_q=700, n_k=700, sinks=True), True),  # not causal
]


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize(("case", "train_sinks"), [pytest.param(c, t, id=f"{c.id}-{'train' if t else 'frozen'}")
                                                   for c, t in SINK_CASES])
def test_sinks_run_on_the_gluon_training_kernels(case: Case, train_sinks: bool, monkeypatch):
    """Sinks (gpt-oss), as users call them (``sinks_t``, ``sinks_s``, a frozen teacher, ``reduction="mean"``): the
    fused Gluon forward and a Gluon key pass run; the training forward gives the portable one's KL, lse and dQ_s within
    fp32 rounding (its epilogue, where the sinks are merged, rounds differently), and a dQ_s as exact; the student's
    query, key and, where they train, sink gradients match the float64 oracle as closely as the portable kernels'."""
    from streamkl._triton.forward import attention_kl_fwd, new_dq_b_buffer

    _, inputs, _, _, _, _, _ = _key_pass_problem(replace(case, window=None, sinks=False), "scalar")
    sinks = make_inputs(case, torch.bfloat16, "cuda").tensors
    inputs = inputs._replace(sink_a=sinks["sinks_t"].detach(), sink_b=sinks["sinks_s"].detach())
    spec = KLSpec(case.d_t ** -0.5, case.d_s ** -0.5, window_left=case.window[0] if case.window else -1,
                  window_right=0 if case.causal else -1)
    with forced("gluon"):
        assert dispatch.select("training forward", Problem(inputs, spec, fused=True)).gluon
    dq_gluon, dq_portable = new_dq_b_buffer(inputs), new_dq_b_buffer(inputs)
    gluon = (*_fused.attention_kl_fused_fwd_hopper(inputs, spec, dq_gluon), dq_gluon)
    portable = (*attention_kl_fwd(inputs, spec, dq_b=dq_portable), dq_portable)
    for name, x, y in zip(("kl", "lse_a", "lse_b", "dq_s"), gluon, portable):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=f"{name} differs from the portable kernel's")
    q_t, k_t, q_s, k_s = (x.detach().double() for x in inputs[:4])
    q_s.requires_grad_(True)
    ref = attention_kl(q_t, k_t, q_s, k_s, causal=case.causal, window=case.window, scale_t=spec.scale_a,
                       scale_s=spec.scale_b, sinks_t=inputs.sink_a.double(), sinks_s=inputs.sink_b.double(),
                       reduction="sum", backend="reference")
    (dq_ref,) = torch.autograd.grad(ref, (q_s,))
    dq_err = lambda x: float((x.double() - dq_ref).norm() / dq_ref.norm())
    assert dq_err(dq_gluon) <= 1.05 * dq_err(dq_portable) + 1e-6, (dq_err(dq_gluon), dq_err(dq_portable))

    calls = _count_calls(monkeypatch, _backward, "attention_kl_key_pass_hopper")
    fused_calls = _count_calls(monkeypatch, _fused, "attention_kl_fused_fwd_hopper")
    tensors = make_inputs(case, torch.bfloat16, "cuda").tensors
    tensors["sinks_s"].requires_grad_(train_sinks)
    wrt = ["q_s", "k_s"] + (["sinks_s"] if train_sinks else [])
    ref_tensors = {n: x.detach().double().requires_grad_(n in wrt) for n, x in tensors.items()}
    ref = attention_kl(**ref_tensors, backend="reference", **case.kwargs())
    ref_grads = torch.autograd.grad(ref, [ref_tensors[n] for n in wrt])
    grads = {}
    for label, switch in (("hopper", "gluon"), ("portable", "portable")):
        with forced(switch):
            out = attention_kl(**tensors, backend="triton", **case.kwargs())
            grads[label] = torch.autograd.grad(out, [tensors[n] for n in wrt])
        if label == "hopper":
            assert (len(fused_calls), len(calls)) == (1, 1), "the Gluon training kernels did not run"
            assert_close(out, ref.detach(), TOLERANCES[torch.bfloat16][0], "loss")
    for i, name in enumerate(wrt):
        err = lambda x: float((x.double() - ref_grads[i]).norm() / ref_grads[i].norm())  # noqa: B023
        assert_close(grads["hopper"][i], ref_grads[i], TOLERANCES[torch.bfloat16][1], f"d{name}")
        assert err(grads["hopper"][i]) <= 1.5 * err(grads["portable"][i]) + 1e-6, f"d{name}: less exact than portable"
