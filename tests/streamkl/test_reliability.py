"""Defined behaviour on adversarial inputs and numerical edges, for the reference and the Triton backend
(Triton runs through the CPU interpreter without a GPU). docs/reliability.md lists each behaviour."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamkl import attention_kl, naive_attention_kl
from tests._helpers import assert_close
from tests.streamkl.cases import BASE, Case
from tests.streamkl.oracle import check_against_oracle

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["reference", "triton"]


def _qk(b=2, h=2, n=24, d=16, dtype=torch.float32, scale=1.0):
    return [(torch.randn(b, h, n, d, dtype=torch.float64) * scale).to(DEVICE, dtype) for _ in range(4)]


NON_FINITE_WARNINGS = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # interpreter


@NON_FINITE_WARNINGS
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_one_query_row_poisons_only_that_row(backend):
    q_t, k_t, q_s, k_s = _qk()
    clean = attention_kl(q_t, k_t, q_s, k_s, reduction="none", backend=backend, causal=True)
    q_s[0, 1, 5, 3] = float("nan")
    out = attention_kl(q_t, k_t, q_s, k_s, reduction="none", backend=backend, causal=True)
    assert torch.isnan(out[0, 1, 5])
    mask = torch.ones_like(out, dtype=torch.bool)
    mask[0, 1, 5] = False
    torch.testing.assert_close(out[mask], clean[mask])
    assert torch.isnan(attention_kl(q_t, k_t, q_s, k_s, backend=backend, causal=True))


@NON_FINITE_WARNINGS
@pytest.mark.parametrize("backend", BACKENDS)
def test_inf_in_a_key_gives_non_finite_rows_and_never_crashes(backend):
    q_t, k_t, q_s, k_s = (x.requires_grad_(True) for x in _qk())
    with torch.no_grad():
        k_t[1, 0, 7, 0] = float("inf")
    out = attention_kl(q_t, k_t, q_s, k_s, reduction="none", backend=backend)
    assert not torch.isfinite(out[1, 0]).all()
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[1, 1]).all()
    out.sum().backward()  # completes; the touched gradients are non-finite, others finite
    assert torch.isfinite(q_s.grad[0]).all()


@pytest.mark.parametrize("name", ["q_t", "k_t", "q_s", "k_s"])
def test_check_finite_names_the_tensor(name):
    inputs = dict(zip(["q_t", "k_t", "q_s", "k_s"], _qk()))
    inputs[name][0, 0, 0, 0] = float("nan")
    inputs[name][1, 0, 0, 0] = float("-inf")
    with pytest.raises(ValueError, match=rf"`{name}` to hold only finite values .* contains 1 NaN and 1 infinite"):
        attention_kl(*inputs.values(), check_finite=True)


def test_check_finite_passes_clean_inputs():
    x = _qk()
    assert torch.equal(attention_kl(*x, check_finite=True), attention_kl(*x))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_logits_times_100(backend, dtype):
    case = replace(BASE, sharpness=100.0, causal=True, n_q=29, n_k=29, teacher_grad=True)
    tol = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}[dtype]
    check_against_oracle(case, dtype, backend, DEVICE, tolerances=tol, reduction_checks=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16_scores_beyond_the_fp16_range(backend):
    """q·k reaches ~1e5 > 65504 (the fp16 maximum): products accumulate in fp32, so nothing overflows."""
    q_t, k_t, q_s, k_s = (torch.full((1, 2, 16, 64), 40.0) + torch.randn(1, 2, 16, 64) for _ in range(4))
    q_t, k_t, q_s, k_s = (x.to(DEVICE, torch.float16) for x in (q_t, k_t, q_s, k_s))
    assert float(q_t[0, 0, 0].float() @ k_t[0, 0, 0].float()) > 65504
    out = attention_kl(q_t, k_t, q_s, k_s, reduction="none", backend=backend, scale_t=1e-3, scale_s=1e-3)
    ref = naive_attention_kl(*(x.double() for x in (q_t, k_t, q_s, k_s)), reduction="none", scale_t=1e-3,
                             scale_s=1e-3)
    assert torch.isfinite(out).all()
    assert_close(out, ref, 1e-2, "kl")


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_hot_teacher_and_disjoint_support_give_large_finite_kl(backend):
    """The teacher puts ~all mass on key 0, the student on key 1: KL ≈ 60 nats, finite, with finite grads."""
    n, d = 8, 16
    k = torch.eye(n, d, dtype=torch.float64)[None, None]
    q_t = torch.zeros(1, 1, 4, d, dtype=torch.float64)
    q_t[..., 0] = 60.0
    q_s = torch.zeros(1, 1, 4, d, dtype=torch.float64)
    q_s[..., 1] = 60.0
    args = [x.to(DEVICE, torch.float32) for x in (q_t, k, q_s, k)]
    args[2].requires_grad_(True)
    out = attention_kl(*args, reduction="none", backend=backend, scale_t=1.0, scale_s=1.0)
    ref = naive_attention_kl(q_t, k, q_s, k, reduction="none", scale_t=1.0, scale_s=1.0)
    assert torch.isfinite(out).all() and float(out.detach().min()) > 50
    assert_close(out, ref, 1e-5, "kl")
    out.sum().backward()
    assert torch.isfinite(args[2].grad).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("n_q", "n_k", "d"), [(1, 1, 16), (1, 37, 16), (37, 1, 16), (5, 9, 256)],
                         ids=["Nq1-Nk1", "Nq1", "Nk1", "D256"])
def test_tiny_lengths_and_extreme_head_dims(backend, n_q, n_k, d):
    case = Case(b=1, h=2, h_kt=2, h_ks=1, n_q=n_q, n_k=n_k, d_t=d, d_s=d, causal=True, teacher_grad=True)
    check_against_oracle(case, torch.float32, backend, DEVICE, reduction_checks=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_non_contiguous_inputs(backend):
    """Inputs sliced with a step in the head dim and permuted: used in place, same result as contiguous."""
    base = [torch.randn(2, 30, 3, 32, device=DEVICE) for _ in range(4)]
    views = [x.permute(0, 2, 1, 3)[..., ::2] for x in base]  # (B, H, N, 16) with strides (., 32, 96, 2)
    assert not any(v.is_contiguous() for v in views)
    for v in views[2:]:
        v.requires_grad_(True)
    out = attention_kl(*views, causal=True, reduction="none", backend=backend)
    out.sum().backward()
    dense = [v.detach().contiguous().requires_grad_(v.requires_grad) for v in views]
    ref = attention_kl(*dense, causal=True, reduction="none", backend=backend)
    ref.sum().backward()
    torch.testing.assert_close(out, ref)
    for v, w in zip(views[2:], dense[2:]):
        torch.testing.assert_close(v.grad, w.grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bitwise_reproducible(backend):
    q_t, k_t, q_s, k_s = _qk()
    q_s.requires_grad_(True)
    k_s.requires_grad_(True)
    results = []
    for _ in range(2):
        q_s.grad = k_s.grad = None
        out = attention_kl(q_t, k_t, q_s, k_s, causal=True, reduction="sum", backend=backend)
        out.backward()
        results.append((out.detach().clone(), q_s.grad.clone(), k_s.grad.clone()))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    groups=st.sampled_from([(1, 1, 1), (2, 1, 2), (4, 2, 1)]),
    n_q=st.integers(1, 40),
    n_k=st.integers(1, 40),
    d_t=st.integers(1, 48),
    d_s=st.integers(1, 48),
    causal=st.booleans(),
    key_mask=st.sampled_from(["none", "random", "empty_batch"]),
    query_mask=st.booleans(),
    direction=st.sampled_from(["forward", "reverse"]),
    sharpness=st.sampled_from([1.0, 10.0]),
    layout=st.sampled_from(["bhnd", "bnhd"]),
    teacher_grad=st.booleans(),
)
def test_triton_matches_oracle_property(groups, n_q, n_k, d_t, d_s, causal, key_mask, query_mask, direction,
                                        sharpness, layout, teacher_grad):
    h, h_kt, h_ks = groups
    case = Case(b=2, h=h, h_kt=h_kt, h_ks=h_ks, n_q=n_q, n_k=n_k, d_t=d_t, d_s=d_s, causal=causal,
                key_mask=key_mask, query_mask=query_mask, direction=direction, sharpness=sharpness, layout=layout,
                teacher_grad=teacher_grad)
    check_against_oracle(case, torch.float32, "triton", DEVICE, reduction_checks=False)
