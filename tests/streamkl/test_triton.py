"""The fused Triton kernels against the float64 oracle.

On a machine without a GPU these run through Triton's CPU interpreter (``TRITON_INTERPRET=1``, set by
the root conftest) at small odd shapes; on a GPU the same cases run on the device. Every allocation
made while a test runs is poisoned with NaN, so a row or gradient the kernels forget to write fails.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from streamkl import attention_kl
from tests._helpers import assert_close
from tests.streamkl.cases import BASE, ORACLE_CASES, Case, make_inputs, params
from tests.streamkl.oracle import check_against_oracle

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def poison_allocations(monkeypatch):
    """``torch.empty``/``empty_like`` return NaN-filled floating tensors (FLA's trick)."""
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned(fn):
        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            if out.is_floating_point():
                out.fill_(float("nan"))
            return out

        return wrapper

    monkeypatch.setattr(torch, "empty", poisoned(empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(empty_like))


@pytest.mark.parametrize("case", params(ORACLE_CASES))
def test_triton_matches_oracle_float32(case: Case):
    check_against_oracle(case, torch.float32, "triton", DEVICE)


LOW_PRECISION_CASES = [
    replace(BASE, n_q=63, n_k=63, d_t=40, d_s=72, causal=True),
    replace(BASE, h=6, h_kt=2, h_ks=3, d_t=24, d_s=12, key_mask="random", teacher_grad=True),
    replace(BASE, layout="bnhd", direction="reverse", query_mask=True, n_q=17, n_k=45, causal=True),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", params(LOW_PRECISION_CASES))
def test_triton_matches_oracle_half(case: Case, dtype: torch.dtype):
    check_against_oracle(case, dtype, "triton", DEVICE, reduction_checks=False)


DETERMINISTIC_CASES = [
    replace(BASE, n_q=45, n_k=37, causal=True, key_mask="random", teacher_grad=True),
    replace(BASE, h=4, h_kt=1, h_ks=2, direction="reverse", teacher_grad=True, d_t=20),
]


@pytest.mark.parametrize("case", params(DETERMINISTIC_CASES))
def test_deterministic_backward_matches_oracle_and_is_bitwise_stable(case: Case):
    q_t, k_t, q_s, k_s, kpm, qm = make_inputs(case, torch.float32, DEVICE)
    grads = []
    for _ in range(2):
        for x in (q_t, k_t, q_s, k_s):
            x.grad = None
        out = attention_kl(q_t, k_t, q_s, k_s, key_padding_mask=kpm, query_mask=qm, reduction="sum",
                           backend="triton", deterministic=True, **case.kwargs())
        out.backward()
        grads.append([x.grad.clone() for x in (q_t, k_t, q_s, k_s)])
    for g0, g1 in zip(*grads):
        assert torch.equal(g0, g1)
    # and the deterministic gradients agree with the default (atomic) ones
    for x in (q_t, k_t, q_s, k_s):
        x.grad = None
    attention_kl(q_t, k_t, q_s, k_s, key_padding_mask=kpm, query_mask=qm, reduction="sum", backend="triton",
                 deterministic=False, **case.kwargs()).backward()
    for g_det, x in zip(grads[0], (q_t, k_t, q_s, k_s)):
        assert_close(x.grad, g_det, 1e-5, "deterministic vs atomic")


def test_torch_deterministic_mode_overrides_atomic_request(monkeypatch):
    seen = {}
    from streamkl._triton import backward

    original = backward.attention_kl_bwd

    def spy(*args):
        seen["deterministic"] = args[-1]
        return original(*args)

    monkeypatch.setattr(backward, "attention_kl_bwd", spy)
    q = torch.randn(1, 2, 20, 16, device=DEVICE, requires_grad=True)
    attention_kl(q, q.detach(), q, q.detach() * 2, backend="triton", deterministic=False).backward()
    assert seen["deterministic"] is False
    torch.use_deterministic_algorithms(True)
    try:
        attention_kl(q, q.detach(), q, q.detach() * 2, backend="triton", deterministic=False).backward()
    finally:
        torch.use_deterministic_algorithms(False)
    assert seen["deterministic"] is True


def test_triton_equals_reference_on_identical_and_empty_rows():
    q = torch.randn(2, 2, 30, 16, device=DEVICE)
    kpm = torch.ones(2, 30, dtype=torch.bool, device=DEVICE)
    kpm[1] = False
    out = attention_kl(q, q, q, q, key_padding_mask=kpm, reduction="none", backend="triton")
    assert torch.all(out == 0)
    assert attention_kl(q, q, q, q, key_padding_mask=kpm, backend="triton").item() == 0.0


def test_triton_empty_inputs():
    for shape_q, shape_k in [((0, 2, 5, 16), (0, 2, 5, 16)), ((1, 2, 0, 16), (1, 2, 5, 16)),
                             ((1, 2, 5, 16), (1, 2, 0, 16))]:
        q = torch.randn(*shape_q, device=DEVICE, requires_grad=True)
        k = torch.randn(*shape_k, device=DEVICE, requires_grad=True)
        out = attention_kl(q, k, q.detach(), k.detach() * 2, reduction="none", backend="triton")
        assert out.shape == shape_q[:3] and torch.all(out == 0)
        out.sum().backward()
        assert torch.all(q.grad == 0) and torch.all(k.grad == 0)


def test_triton_rejects_float64_and_huge_heads():
    x = torch.randn(1, 1, 4, 8, dtype=torch.float64, device=DEVICE)
    with pytest.raises(TypeError, match="does not take float64"):
        attention_kl(x, x, x, x, backend="triton")
    big = torch.randn(1, 1, 4, 264, device=DEVICE)
    with pytest.raises(ValueError, match="head dims up to 256, but got D_t, D_s = \\(264, 264\\)"):
        attention_kl(big, big, big, big, backend="triton")


@pytest.mark.parametrize("causal", [False, True])
def test_pipelined_forward_variant_matches_reference(causal):
    """The software-pipelined forward loop (next tile's products issued first) computes the same KL."""
    from streamkl import reference
    from streamkl._triton.configs import LaunchConfig
    from streamkl._triton.forward import attention_kl_fwd

    q_t, k_t, q_s, k_s = (torch.randn(2, 2, n, 16, device=DEVICE) for n in (37, 53, 37, 53))
    kpm = torch.rand(2, 53, device=DEVICE) > 0.2
    cfg = LaunchConfig(16, 16, 4, 2, pipeline=True)
    got = attention_kl_fwd(q_t, k_t, q_s, k_s, kpm, None, causal, 0.3, 0.2, config=cfg)
    want = reference.chunked_attention_kl_fwd(q_t, k_t, q_s, k_s, kpm, None, causal, 0.3, 0.2)
    for g, w, name in zip(got, want, ("kl", "lse_a", "lse_b")):
        finite = torch.isfinite(w)
        assert torch.equal(finite, torch.isfinite(g)), name
        assert_close(g[finite], w[finite], 1e-5, name)


def test_wide_offset_path_matches_oracle(monkeypatch):
    """Regression: in-slice offsets ``row * stride`` overflowed int32 once a (batch, head) slice held more
    than 2^31 elements (illegal address on an H100). The 64-bit path is forced here on small inputs."""
    from streamkl._triton import backward, forward

    monkeypatch.setattr(forward, "needs_wide_offsets", lambda *x: True)
    monkeypatch.setattr(backward, "needs_wide_offsets", lambda *x: True)
    case = replace(BASE, n_q=37, n_k=29, causal=True, key_mask="random", teacher_grad=True)
    check_against_oracle(case, torch.float32, "triton", DEVICE, reduction_checks=False)
    check_against_oracle(replace(case, layout="bnhd", direction="reverse"), torch.float32, "triton", DEVICE,
                         reduction_checks=False)
