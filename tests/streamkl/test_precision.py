"""The precision of the op's products (``streamkl.precision``): autocast casts the inputs once, as it does for
``F.scaled_dot_product_attention``; float32 inputs outside autocast follow ``torch.get_float32_matmul_precision()``;
teacher and student may compute in different dtypes. Both backends run these on the CPU (Triton through its
interpreter), so the reference and the kernels must agree under autocast."""

from __future__ import annotations

import pytest
import torch

from streamkl import attention_kl, naive_attention_kl
from streamkl.precision import product_precision, resolve_allow_tf32
from tests._helpers import assert_close

BACKENDS = ["reference", "triton"]
LOW = [torch.bfloat16, torch.float16]


def _inputs(b=2, h=4, h_k=2, n=24, d_t=16, d_s=8, *, scale=1.0, close=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_t, k_t = torch.randn(b, h, n, d_t, generator=g) * scale, torch.randn(b, h_k, n, d_t, generator=g) * scale
    if close:  # a student very near its teacher (same head dim)
        q_s, k_s = q_t * 1.01 + 1e-3 * torch.randn(q_t.shape, generator=g), k_t.clone()
    else:
        q_s, k_s = torch.randn(b, h, n, d_s, generator=g) * scale, torch.randn(b, h_k, n, d_s, generator=g) * scale
    return [x.requires_grad_() for x in (q_t, k_t, q_s, k_s)]


def _grads(out: torch.Tensor, tensors: list[torch.Tensor], upstream: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad((out * upstream).sum(), tensors))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", LOW)
def test_under_autocast_the_op_equals_the_call_on_inputs_cast_to_the_autocast_dtype(backend, dtype):
    """What autocast does to sdpa: the inputs are cast once; the value, and the gradients reaching the float32 inputs
    through the cast, are those of the call on the cast inputs outside autocast."""
    tensors = _inputs()
    mask = torch.rand(2, 24, generator=torch.Generator().manual_seed(1)) > 0.2
    kw = dict(causal=True, key_padding_mask=mask, query_mask=mask, reduction="none", backend=backend)
    with torch.autocast("cpu", dtype=dtype):
        out = attention_kl(*tensors, **kw)
    upstream = torch.randn(out.shape)
    grads = _grads(out, tensors, upstream)

    cast = [x.detach().to(dtype).requires_grad_() for x in tensors]
    expected = attention_kl(*cast, **kw)
    expected_grads = _grads(expected, cast, upstream)
    assert out.dtype == torch.float32
    assert torch.equal(out, expected)
    for got, want in zip(grads, expected_grads):
        assert got.dtype == torch.float32
        assert torch.equal(got, want.float())


@pytest.mark.parametrize("dtype", LOW)
def test_under_autocast_the_two_backends_agree_with_the_float64_oracle_of_the_cast_inputs(dtype):
    """Near-identical teacher and student under autocast (the reference used to run its chunked products in bf16:
    KL 8.5e-5 against the true 2.3e-6, a query-gradient relative error of 13): both backends compute the exact KL of
    the rounded inputs, forward and gradients, mean reduction, backward inside the autocast block too."""
    tensors = _inputs(d_s=16, close=True)
    results = {}
    for backend in BACKENDS:
        with torch.autocast("cpu", dtype=dtype):
            loss = attention_kl(*tensors, causal=True, backend=backend)
            grads = torch.autograd.grad(loss, tensors[2:])  # a backward run under autocast as well
        results[backend] = (loss, grads)
    rounded = [x.detach().to(dtype).double().requires_grad_() for x in tensors]
    oracle = naive_attention_kl(*rounded, causal=True, compute_dtype=torch.float64)
    oracle_grads = torch.autograd.grad(oracle, rounded[2:])
    for loss, grads in results.values():
        # the value of a KL this small is a difference of two fp32 log-sum-exps (docs/faq.md: "Can the KL be
        # negative?"): accurate in magnitude; the gradients are not affected
        assert_close(loss.double(), oracle, 5e-3, "kl")
        for got, want in zip(grads, oracle_grads):
            assert_close(got.double(), want, 1e-2, "grad")  # the kernels' dS tiles are in the input dtype
    assert_close(results["reference"][0], results["triton"][0], 5e-3, "reference vs triton")


def test_fp16_autocast_with_large_scores_is_finite():
    """Raw scores far above fp16's range (|q·k| ~ 1e5) under fp16 autocast: the products accumulate in fp32, so the
    KL is a number, as in fp32 (it was NaN when the reference's products ran in fp16)."""
    tensors = _inputs(scale=30.0, d_s=16)
    for backend in BACKENDS:
        with torch.autocast("cpu", dtype=torch.float16):
            value = attention_kl(*tensors, backend=backend)
        rounded = [x.detach().half().double() for x in tensors]
        assert torch.isfinite(value)
        assert_close(value.double(), naive_attention_kl(*rounded, compute_dtype=torch.float64), 1e-4, backend)


def test_autocast_leaves_float64_inputs_alone():
    tensors = [x.detach().double() for x in _inputs()]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        value = attention_kl(*tensors)
    assert value.dtype == torch.float64
    assert_close(value, naive_attention_kl(*tensors, compute_dtype=torch.float64), 1e-10, "fp64")


@pytest.mark.parametrize("backend", BACKENDS)
def test_teacher_and_student_in_different_dtypes(backend):
    """A bf16 teacher beside a float32 student: each side's products in its own dtype (the teacher's bf16 values,
    the student's float32), both exact against the float64 oracle of those values, gradients in the student's
    dtype."""
    q_t, k_t, q_s, k_s = _inputs()
    q_t, k_t = q_t.detach().bfloat16(), k_t.detach().bfloat16()
    loss = attention_kl(q_t, k_t, q_s, k_s, causal=True, backend=backend, allow_tf32=False)
    grads = torch.autograd.grad(loss, (q_s, k_s))
    exact = [x.detach().double().requires_grad_(x.requires_grad) for x in (q_t, k_t, q_s, k_s)]
    oracle = naive_attention_kl(*exact, causal=True, compute_dtype=torch.float64)
    oracle_grads = torch.autograd.grad(oracle, exact[2:])
    assert_close(loss.double(), oracle, 1e-5, "kl")
    for got, want in zip(grads, oracle_grads):
        assert got.dtype == torch.float32
        assert_close(got.double(), want, 1e-4, "grad")
    assert (product_precision(q_t.dtype, backend=backend), product_precision(q_s.dtype, False, backend=backend)) == (
        "bf16", "fp32 (IEEE)")


@pytest.fixture
def matmul_precision():
    previous = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(previous)


@pytest.mark.parametrize(("setting", "allow_tf32", "expected"), [
    ("highest", None, "ieee"), ("high", None, "tf32"), ("medium", None, "tf32"),
    ("high", False, "ieee"), ("highest", True, "tf32"),
])
def test_the_float32_matmul_precision_reaches_the_triton_launch(monkeypatch, matmul_precision, setting, allow_tf32,
                                                                 expected):
    """float32 inputs follow ``torch.get_float32_matmul_precision()`` as torch.matmul does; an explicit ``allow_tf32``
    decides instead. What the kernels are launched with is read at the launch (forward and backward)."""
    from streamkl._triton import _helpers, backward, forward

    launched = []

    def spy(dtype, allow):
        launched.append(_helpers.dot_precision(dtype, allow))
        return launched[-1]

    monkeypatch.setattr(forward, "dot_precision", spy)
    monkeypatch.setattr(backward, "dot_precision", spy)
    forward._forward_plan.cache_clear()  # the launch plans are cached (per shape, dtype and allow_tf32)
    backward._backward_plan.cache_clear()
    matmul_precision(setting)
    q_t, k_t, q_s, k_s = _inputs()
    q_t, k_t = q_t.detach(), k_t.detach()
    attention_kl(q_t, k_t, q_s, k_s, backend="triton", allow_tf32=allow_tf32, deterministic=True).backward()
    assert launched and set(launched) == {expected}
    assert resolve_allow_tf32(allow_tf32) is (expected == "tf32")


def test_torch_compile_traces_the_autocast_cast_and_the_precision_setting_without_a_graph_break(matmul_precision):
    """``fullgraph=True``: the autocast cast and ``torch.get_float32_matmul_precision()`` (read when the graph is
    traced) trace into one graph, with the eager call's value."""
    torch._dynamo.reset()
    matmul_precision("high")
    tensors = [x.detach() for x in _inputs()]

    def loss(*xs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return attention_kl(*xs, causal=True, backend="reference")

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(*tensors), loss(*tensors))
