"""The Hopper (sm_90, Gluon) forward: its selection everywhere, its results on an H100.

Gluon has no CPU interpreter, so CI checks which problems take the Hopper kernel (scope, size threshold, the
``STREAMKL_HOPPER_KERNELS`` switch); the GPU tests (skipped off sm_90) check that it ran and that it matches the
float64 oracle as closely as the portable kernel does, forward and, through the two-pass backward that reads its
log-sum-exps, gradients.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import streamkl._hopper as hopper
from streamkl import attention_kl
from streamkl._problem import KLInputs, KLSpec
from tests._helpers import assert_close
from tests.streamkl.cases import Case, make_inputs
from tests.streamkl.oracle import TOLERANCES

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
_forward = hopper._module()


def _inputs(*shape, dtype=torch.bfloat16, **extras) -> KLInputs:
    q = torch.randn(*shape).to(dtype)
    fields = dict(q_a=q, k_a=q, q_b=q, k_b=q, sink_a=None, sink_b=None, key_padding_mask=None, query_mask=None,
                  cu_seqlens_q=None, cu_seqlens_k=None)
    fields.update(extras)
    return KLInputs(**fields)


def test_cpu_tensors_never_take_the_hopper_kernel():
    assert hopper.hopper_forward(_inputs(1, 4, 4096, 64), KLSpec(0.125, 0.125)) is None


def test_the_environment_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv(hopper.ENV_SWITCH, "0")
    assert not hopper.hopper_enabled()
    monkeypatch.setenv(hopper.ENV_SWITCH, "all")
    assert hopper.hopper_enabled()
    monkeypatch.delenv(hopper.ENV_SWITCH)
    assert hopper.hopper_enabled()


@pytest.mark.skipif(_forward is None, reason="this Triton has no Gluon Hopper API")
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
    assert _forward.in_scope(inputs, spec) is expected


@pytest.mark.skipif(_forward is None, reason="this Triton has no Gluon Hopper API")
def test_scope_needs_tma_addressable_tensors():
    q = torch.randn(1, 2, 256, 64).to(torch.bfloat16)
    spec = KLSpec(0.1, 0.1)
    strided = torch.randn(1, 2, 256, 65).to(torch.bfloat16)[..., :64]  # rows of 130 bytes: not 16-byte aligned
    assert not _forward.in_scope(KLInputs(q, strided, q, q, None, None, None, None, None, None), spec)
    causal_short_keys = KLInputs(q, q[:, :, :100], q, q[:, :, :100], None, None, None, None, None, None)
    assert not _forward.in_scope(causal_short_keys, KLSpec(0.1, 0.1, window_right=0))  # a causal row with no key
    assert _forward.in_scope(causal_short_keys, spec)
    mixed = KLInputs(q, q, q.half(), q.half(), None, None, None, None, None, None)
    assert not _forward.in_scope(mixed, spec)


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
    monkeypatch.setenv(hopper.ENV_SWITCH, "all")  # small shapes and head dim 64 too
    module = hopper._module()
    calls = []
    real = module.attention_kl_fwd_hopper
    monkeypatch.setattr(module, "attention_kl_fwd_hopper", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    inputs = make_inputs(case, dtype, "cuda")
    ref_tensors = inputs.float64_copies()
    ref = attention_kl(**ref_tensors, reduction="none", backend="reference", **case.kwargs())
    rtol_fwd, rtol_grad = TOLERANCES[dtype]
    with torch.no_grad():
        out = inputs.call(attention_kl, reduction="none", backend="triton", **case.kwargs())
    assert len(calls) == 1, "the Hopper forward did not run"
    assert_close(out, ref.detach(), rtol_fwd, "kl")
    monkeypatch.setenv(hopper.ENV_SWITCH, "0")  # the portable kernel on the same inputs
    with torch.no_grad():
        portable = inputs.call(attention_kl, reduction="none", backend="triton", **case.kwargs())
    assert len(calls) == 1
    err = lambda x: float((x.double() - ref.detach()).norm() / ref.detach().norm())
    assert err(out) <= 2 * err(portable) + 1e-6, "the Hopper forward is less exact than the portable one"
    if not case.teacher_grad:
        return
    monkeypatch.setenv(hopper.ENV_SWITCH, "all")
    out = inputs.call(attention_kl, reduction="none", backend="triton", **case.kwargs())
    assert len(calls) == 2, "the Hopper forward did not run under autograd"
    grad_out = torch.randn(out.shape, dtype=torch.float64, device="cuda")
    (out * grad_out.float()).sum().backward()
    (ref * grad_out).sum().backward()
    assert_close(out, ref.detach(), rtol_fwd, "kl")
    for name, x in inputs.tensors.items():
        if ref_tensors[name].grad is not None:
            assert_close(x.grad, ref_tensors[name].grad, rtol_grad, f"d{name}")


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 (Hopper) GPU")
def test_default_selection_on_the_gpu(monkeypatch):
    """Without the switch: head dim 128 at the threshold runs the Hopper forward; head dim 64 and small problems
    do not (measured slower there, docs/perf-notes.md v7)."""
    monkeypatch.delenv(hopper.ENV_SWITCH, raising=False)

    def picked(n, d):
        q = torch.randn(1, 4, n, d, device="cuda", dtype=torch.bfloat16)
        return hopper.hopper_forward(KLInputs(q, q, q, q, None, None, None, None, None, None), KLSpec(0.1, 0.1))

    assert picked(8192, 128) is not None
    assert picked(8192, 64) is None
    assert picked(1024, 128) is None
