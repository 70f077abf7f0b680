"""The chunked reference backend against the float64 oracle, plus its O(N) memory."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamkl import attention_kl, chunked_attention_kl, naive_attention_kl, reference
from streamkl._problem import KLInputs, KLSpec
from tests._helpers import assert_close
from tests.streamkl.cases import ORACLE_CASES, REAL_TEACHER_CASES, Case, params
from tests.streamkl.memory import peak_live_bytes
from tests.streamkl.oracle import check_against_oracle


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    """Small chunks, so the test shapes span several query and key chunks (online rescaling, causal skips)."""
    monkeypatch.setattr(reference, "DEFAULT_CHUNK_SIZE", 16)


@pytest.mark.parametrize("case", params(ORACLE_CASES))
def test_reference_matches_oracle_float64(case: Case):
    check_against_oracle(case, torch.float64, "reference")


@pytest.mark.parametrize("case", params(REAL_TEACHER_CASES))
def test_reference_matches_oracle_on_real_teacher_options(case: Case):
    check_against_oracle(case, torch.float64, "reference")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", params([ORACLE_CASES[3], ORACLE_CASES[11], ORACLE_CASES[16]]))
def test_reference_low_precision_inputs(case: Case, dtype: torch.dtype):
    check_against_oracle(case, dtype, "reference", reduction_checks=False)


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
def test_reference_chunk_size_does_not_change_the_result(chunk_size: int):
    q_t, k_t, q_s, k_s = (torch.randn(2, 3, 37, 8, dtype=torch.float64) * 4 for _ in range(4))
    kpm = torch.rand(2, 37) > 0.5
    inputs = KLInputs(q_t, k_t, q_s, k_s, None, None, kpm, None, None, None, None)
    spec = KLSpec(scale_a=0.3, scale_b=0.4, window_right=0)
    kl, lse_a, _ = reference.chunked_attention_kl_fwd(inputs, spec, chunk_size=chunk_size)
    ref = naive_attention_kl(q_t, k_t, q_s, k_s, causal=True, key_padding_mask=kpm, scale_t=0.3, scale_s=0.4,
                             reduction="none")
    assert_close(kl, ref, 1e-12, "kl")
    expected_lse = torch.logsumexp(
        (q_t @ k_t.transpose(-1, -2) * 0.3).masked_fill(
            ~(torch.ones(37, 37, dtype=torch.bool).tril() & kpm[:, None, None, :]), float("-inf")), -1)
    finite = torch.isfinite(expected_lse)
    assert torch.allclose(lse_a[finite], expected_lse[finite])
    assert torch.all(torch.isposinf(lse_a[~finite]))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    b=st.integers(1, 3),
    groups=st.sampled_from([(1, 1, 1), (2, 1, 2), (4, 2, 1), (6, 3, 2)]),
    n_q=st.integers(1, 40),
    n_k=st.integers(1, 40),
    d_t=st.integers(1, 24),
    d_s=st.integers(1, 24),
    causal=st.booleans(),
    key_mask=st.sampled_from(["none", "random", "empty_batch"]),
    query_mask=st.booleans(),
    direction=st.sampled_from(["forward", "reverse"]),
    temperature=st.sampled_from([0.5, 1.0, 3.0]),
    sharpness=st.sampled_from([1.0, 10.0, 30.0]),
    layout=st.sampled_from(["bhnd", "bnhd"]),
    teacher_grad=st.booleans(),
)
def test_reference_matches_oracle_property(b, groups, n_q, n_k, d_t, d_s, causal, key_mask, query_mask,
                                           direction, temperature, sharpness, layout, teacher_grad):
    h, h_kt, h_ks = groups
    case = Case(b=b, h=h, h_kt=h_kt, h_ks=h_ks, n_q=n_q, n_k=n_k, d_t=d_t, d_s=d_s, causal=causal,
                key_mask=key_mask, query_mask=query_mask, direction=direction, temperature=temperature,
                sharpness=sharpness, layout=layout, teacher_grad=teacher_grad)
    check_against_oracle(case, torch.float64, "reference", reduction_checks=False)


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_identical_distributions_give_zero(direction):
    q = torch.randn(2, 4, 50, 16) * 5
    k = torch.randn(2, 2, 50, 16)
    kl = attention_kl(q, k, q, k, causal=True, direction=direction, reduction="none")
    assert torch.all(kl == 0)


def test_constant_shift_of_student_logits_gives_zero():
    """Adding the same vector v to every student key shifts each row of logits by q·v: softmax is unchanged."""
    q_t = torch.randn(2, 4, 40, 16, dtype=torch.float64)
    k_t = torch.randn(2, 4, 40, 16, dtype=torch.float64)
    v = torch.randn(1, 1, 1, 16, dtype=torch.float64) * 3
    kpm = torch.rand(2, 40) > 0.2
    kl = attention_kl(q_t, k_t, q_t, k_t + v, key_padding_mask=kpm, reduction="none")
    assert kl.abs().max() < 1e-12
    kl32 = attention_kl(q_t.float(), k_t.float(), q_t.float(), (k_t + v).float(), reduction="none")
    assert kl32.abs().max() < 1e-5


def test_rows_without_keys_are_zero_with_zero_gradient():
    q_t, k_t = torch.randn(3, 2, 10, 8), torch.randn(3, 2, 12, 8)
    q_s = torch.randn(3, 2, 10, 8, requires_grad=True)
    k_s = torch.randn(3, 2, 12, 8, requires_grad=True)
    kpm = torch.ones(3, 12, dtype=torch.bool)
    kpm[1] = False  # batch 1 has no real key at all
    qm = torch.ones(3, 10, dtype=torch.bool)
    qm[2, :4] = False  # the first four rows of batch 2 are excluded
    kl = attention_kl(q_t, k_t, q_s, k_s, key_padding_mask=kpm, query_mask=qm, reduction="none")
    assert torch.all(kl[1] == 0) and torch.all(kl[2, :, :4] == 0)
    assert torch.all(kl[0] > 0)
    kl.sum().backward()
    assert torch.all(q_s.grad[1] == 0) and torch.all(q_s.grad[2, :, :4] == 0)
    assert torch.all(k_s.grad[1] == 0)
    assert torch.isfinite(q_s.grad).all() and torch.isfinite(k_s.grad).all()
    # the mean counts only rows with keys: 2 heads x (10 rows of batch 0 + 6 rows of batch 2)
    mean = attention_kl(q_t, k_t, q_s, k_s, key_padding_mask=kpm, query_mask=qm)
    assert torch.allclose(mean, kl.sum() / (2 * 16))


def test_mean_of_no_counted_rows_is_zero_not_nan():
    q = torch.randn(1, 1, 4, 8, requires_grad=True)
    kl = attention_kl(q, q, q, q, key_padding_mask=torch.zeros(1, 4, dtype=torch.bool))
    assert kl.item() == 0.0
    kl.backward()
    assert torch.all(q.grad == 0)


def test_gradcheck_float64():
    """Our analytic backward against finite differences (independent of the oracle), teacher grads included."""
    inputs = [torch.randn(1, 2, 6, d, dtype=torch.float64, requires_grad=True) for d in (5, 5, 3, 3)]
    inputs[1] = torch.randn(1, 1, 7, 5, dtype=torch.float64, requires_grad=True)
    inputs[3] = torch.randn(1, 2, 7, 3, dtype=torch.float64, requires_grad=True)
    for direction in ("forward", "reverse"):
        fn = lambda *x, d=direction: attention_kl(*x, causal=True, direction=d, reduction="none", temperature=1.7)
        assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_gradcheck_float64_real_teacher_options(direction):
    """Finite differences through soft-caps (the tanh), sinks, a window and packed sequences, both sides."""
    x = [torch.randn(13, 2, d, dtype=torch.float64, requires_grad=True) for d in (5, 5, 3, 3)]
    x[1] = torch.randn(13, 1, 5, dtype=torch.float64, requires_grad=True)
    sinks = [torch.randn(2, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    cu = torch.tensor([0, 6, 13], dtype=torch.int32)

    def fn(q_t, k_t, q_s, k_s, sinks_t, sinks_s):
        return attention_kl(q_t * 3, k_t, q_s * 3, k_s, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True,
                            window=(3, 0), softcap_t=1.5, softcap_s=2.5, sinks_t=sinks_t, sinks_s=sinks_s,
                            direction=direction, temperature=1.3, reduction="none")

    assert torch.autograd.gradcheck(fn, [*x, *sinks])


def test_teacher_without_grad_gets_none_and_is_not_computed():
    q_t, k_t = torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    q_s = torch.randn(1, 2, 9, 8, requires_grad=True)
    k_s = torch.randn(1, 2, 9, 8)  # only q_s requires grad
    attention_kl(q_t, k_t, q_s, k_s).backward()
    assert q_s.grad is not None and q_t.grad is None and k_t.grad is None


def test_chunked_attention_kl_is_the_reference_backend():
    x = [torch.randn(1, 2, 9, 8) for _ in range(4)]
    assert torch.equal(chunked_attention_kl(*x, causal=True), attention_kl(*x, causal=True, backend="reference"))
    with pytest.raises(TypeError, match="backend"):
        chunked_attention_kl(*x, backend="triton")


def test_empty_batch_and_empty_keys():
    empty = [torch.randn(0, 2, 5, 8, requires_grad=True) for _ in range(4)]
    out = attention_kl(*empty, reduction="none")
    assert out.shape == (0, 2, 5)
    assert attention_kl(*empty).item() == 0.0
    no_keys = [torch.randn(1, 2, 5, 8), torch.randn(1, 2, 0, 8)] * 2
    assert torch.all(attention_kl(*no_keys, reduction="none") == 0)


def _reference_peak_bytes(n: int) -> int:
    b, h, d = 1, 2, 16
    q_t, k_t, q_s, k_s = (torch.randn(b, h, n, d) for _ in range(4))
    g = torch.ones(b, h, n)

    inputs, spec = KLInputs(q_t, k_t, q_s, k_s, *[None] * 7), KLSpec(scale_a=0.25, scale_b=0.25)

    def run():
        kl, la, lb = reference.chunked_attention_kl_fwd(inputs, spec)
        reference.chunked_attention_kl_bwd(g, inputs, spec, kl, la, lb, True, True)

    return peak_live_bytes(run)


def test_reference_memory_grows_linearly_in_n(monkeypatch):
    """Peak bytes allocated by the reference forward+backward, measured op by op: linear in N.

    A materialising implementation would need at least 2·B·H·N² fp32 (4 MiB at N=512, 64 MiB at 2048);
    the chunked one holds the O(N·D) gradients plus O(B·H·chunk²) score chunks.
    """
    monkeypatch.setattr(reference, "DEFAULT_CHUNK_SIZE", 128)
    sizes = [256, 512, 1024, 2048]
    peaks = [_reference_peak_bytes(n) for n in sizes]
    per_step = [peaks[i + 1] - peaks[i] for i in range(len(sizes) - 1)]
    print("N -> peak bytes:", dict(zip(sizes, peaks)), "increments:", per_step)
    # doubling N adds a constant amount per added row (linear), rather than quadrupling (quadratic)
    bytes_per_row = [inc / (sizes[i + 1] - sizes[i]) for i, inc in enumerate(per_step)]
    assert max(bytes_per_row) <= 1.2 * min(bytes_per_row)
    quadratic = 2 * 1 * 2 * sizes[-1] ** 2 * 4
    assert peaks[-1] < quadratic / 8
