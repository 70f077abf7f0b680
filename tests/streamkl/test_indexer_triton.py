"""The fused indexer-loss kernels against the float64 oracle.

Without a GPU these run through Triton's CPU interpreter (``TRITON_INTERPRET=1``, set by the root conftest) at
small odd shapes with the smallest tiles, so every case spans several tiles (online rescaling, tails, the causal
band, GQA groups, several slot chunks in the sparse stage). Every allocation made during a test is NaN-poisoned:
an output the kernels forget to write fails.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from streamkl import indexer_kl
from tests._helpers import assert_close, relative_error
from tests.streamkl.indexer_cases import BASE, ORACLE_CASES, check_against_oracle, make_inputs, oracle, params
from tests.streamkl.test_triton import poison_allocations  # noqa: F401  (autouse fixture)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("case", params(ORACLE_CASES))
def test_triton_matches_oracle_float32(case):
    # the reductions are one host-side function shared by every backend: checked on the dense cases only here
    check_against_oracle(case, torch.float32, "triton", DEVICE, reduction_checks=case.topk is None)


HALF_CASES = [
    replace(BASE, n_q=45, n_k=45, d=24, d_i=40, key_mask="random"),
    replace(BASE, n_q=21, n_k=37, topk=12, layout="bnhd", h_kv=1, lse=True),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", params(HALF_CASES))
def test_triton_matches_oracle_half(case, dtype):
    check_against_oracle(case, dtype, "triton", DEVICE, reduction_checks=False)


@pytest.mark.parametrize(("b", "n", "topk"), [(2, 96, None), (1, 64, 32)], ids=["dense", "sparse"])
def test_fp16_mean_gradients_do_not_underflow(b, n, topk):
    """As users call it: ``reduction="mean"``, fp16, at the largest shapes the interpreter allows here, with the loss
    weighted by 2^-12 so that ``dI ≈ g·(q − p)`` has the magnitudes of a B=1, N=8192 mean (``g`` ~43x and
    ``q − p`` ~85x smaller there). Those are far below fp16's smallest normal: without the power-of-two row scaling
    before the products 2-8% of ``dq_idx``/``dk_idx`` flush to 0 and the error is 4-27%. The reference for the
    comparison is the float64 oracle rounded to fp16 (gradients are returned in the input dtype)."""
    case = replace(BASE, b=b, h=2, h_kv=1, n_q=n, n_k=n, d=16, h_i=2, d_i=16, topk=topk)
    inputs = make_inputs(case, torch.float16, DEVICE)
    loss = indexer_kl(**inputs, backend="triton")
    (loss * 2**-12).backward()
    ref, ref_inputs = oracle(case, inputs, "mean")
    (ref * 2**-12).backward()
    assert_close(loss, ref, 1e-2, "loss")
    for n in ("q_idx", "k_idx", "w_idx"):
        g, r = inputs[n].grad, ref_inputs[n].grad.half()
        assert 0 < r.abs().max() < 1e-4  # the regime in question: around fp16's subnormals
        flushed = ((g == 0) & (r != 0)).float().mean().item()
        assert flushed < 0.005, f"{n}: {flushed:.1%} of the gradient entries flushed to 0"
        assert relative_error(g, r) < 1e-2, n


def test_triton_lse_matches_its_own_first_pass():
    """Passing the lse the op computes itself gives the same loss and gradients (the first pass is skipped)."""
    from streamkl._triton.indexer_forward import indexer_kl_fwd

    for case in (replace(BASE, n_q=19, n_k=19, key_mask="random"), replace(BASE, n_q=13, n_k=13, topk=6)):
        inputs = make_inputs(case, torch.float32, DEVICE)
        names = ("q", "k", "q_idx", "k_idx", "w_idx")
        _, lse_h, _, _ = indexer_kl_fwd(*(inputs[n].detach() for n in names), None, inputs["topk_indices"],
                                        inputs["key_padding_mask"], True, case.d ** -0.5)
        without = indexer_kl(**inputs, reduction="none", backend="triton")
        given = indexer_kl(**{**inputs, "lse": lse_h}, reduction="none", backend="triton")
        assert torch.equal(without, given)


def test_triton_empty_inputs_and_all_masked():
    for b, n_q, n_k in ((0, 5, 5), (1, 0, 5), (1, 5, 0)):
        q, k = torch.randn(b, 2, n_q, 16, device=DEVICE), torch.randn(b, 1, n_k, 16, device=DEVICE)
        q_idx = torch.randn(b, 2, n_q, 16, device=DEVICE, requires_grad=True)
        k_idx = torch.randn(b, n_k, 16, device=DEVICE, requires_grad=True)
        w = torch.randn(b, n_q, 2, device=DEVICE, requires_grad=True)
        out = indexer_kl(q, k, q_idx, k_idx, w, reduction="none", backend="triton")
        assert out.shape == (b, n_q) and torch.all(out == 0)
        indexer_kl(q, k, q_idx, k_idx, w, backend="triton").backward()
        assert all(torch.all(x.grad == 0) for x in (q_idx, k_idx, w))
    case = replace(BASE, n_q=9, n_k=9, topk=3)
    inputs = make_inputs(case, torch.float32, DEVICE)
    inputs["topk_indices"].fill_(-1)  # nothing selected anywhere: loss 0, zero gradients, no NaN
    loss = indexer_kl(**inputs, backend="triton")
    loss.backward()
    assert loss.item() == 0.0
    assert all(torch.all(inputs[n].grad == 0) for n in ("q_idx", "k_idx", "w_idx"))


def test_triton_rejects_float64_and_huge_heads():
    x = torch.randn(1, 1, 4, 8, dtype=torch.float64, device=DEVICE)
    kx = torch.randn(1, 4, 8, dtype=torch.float64, device=DEVICE)
    w = torch.randn(1, 4, 1, dtype=torch.float64, device=DEVICE)
    with pytest.raises(TypeError, match="does not take float64"):
        indexer_kl(x, x, x, kx, w, backend="triton")
    big = torch.randn(1, 1, 4, 264, device=DEVICE)
    with pytest.raises(ValueError, match=r"head dims up to 256 .* but got D=264, D_I=8, H_I=1"):
        indexer_kl(big, big, x.float(), kx.float(), w.float(), backend="triton")


def test_wide_offset_path_matches_oracle(monkeypatch):
    """The 64-bit in-slice offsets (taken when a slice of an input exceeds 2^31 elements) compute the same."""
    from streamkl._triton import indexer_forward

    monkeypatch.setattr(indexer_forward, "needs_wide_offsets", lambda *x: True)
    check_against_oracle(replace(BASE, n_q=23, n_k=29, key_mask="random", layout="bnhd"), torch.float32, "triton",
                         DEVICE, reduction_checks=False)


def test_dense_backward_in_several_row_chunks(monkeypatch):
    """The dense backward stages dI for a bounded block of rows at a time; several chunks give the same gradients."""
    from streamkl._triton import indexer_backward

    monkeypatch.setattr(indexer_backward, "dense_chunk_rows", lambda b, n_q, n_k: 16)
    check_against_oracle(replace(BASE, n_q=45, n_k=37, key_mask="random"), torch.float32, "triton", DEVICE,
                         reduction_checks=False)
