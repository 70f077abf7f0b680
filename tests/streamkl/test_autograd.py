"""Autograd wiring: the eager Function and the torch.library custom op agree, and torch.compile
(fullgraph=True) traces a model + attention_kl + backward without graph breaks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from streamkl import attention_kl
from streamkl._problem import KLSpec
from streamkl.autograd import AttentionKLFunction, attention_kl_fwd_op
from streamkl.dispatch import fuses_dq_b
from tests._helpers import assert_close

BACKENDS = ["reference", "triton"]  # triton runs under the CPU interpreter without a GPU
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(requires_teacher_grad=False):
    g = torch.Generator().manual_seed(1)
    shapes = [(2, 4, 19, 16), (2, 2, 23, 16), (2, 4, 19, 8), (2, 4, 23, 8)]
    xs = [torch.randn(*s, generator=g).to(DEVICE) for s in shapes]
    for i, x in enumerate(xs):
        x.requires_grad_(i >= 2 or requires_teacher_grad)
    return xs


SPEC = KLSpec(scale_a=0.25, scale_b=0.35, softcap_a=2.0, window_left=7, window_right=0)


def _sinks(grad=True):
    return [torch.randn(4, device=DEVICE).requires_grad_(grad) for _ in range(2)]


@pytest.mark.parametrize("backend, teacher_grad", [("reference", True), ("triton", True), ("triton", False)])
def test_custom_op_and_function_agree(backend, teacher_grad):
    """Same values and gradients from both autograd paths; ("triton", False) is the frozen side a, where the forward
    accumulates side b's query gradient (``fuse_dq_b``) and the backward runs only the key pass."""
    torch.manual_seed(3)
    sinks_f = _sinks()
    torch.manual_seed(3)
    sinks_o = _sinks()
    a = _inputs(teacher_grad) + sinks_f
    fuse = fuses_dq_b(backend, teacher_grad, teacher_grad, True)
    assert fuse == (not teacher_grad)
    kl_f, lse_f, _ = AttentionKLFunction.apply(*a, None, None, None, None, None, SPEC, backend, False, True, "none",
                                               None, fuse)
    (kl_f * torch.arange(kl_f.numel(), device=DEVICE).view_as(kl_f)).sum().backward()
    b = _inputs(teacher_grad) + sinks_o
    kl_o, lse_o, _, dq_o = attention_kl_fwd_op(*b, None, None, None, None, None, *dataclasses.astuple(SPEC), backend,
                                               False, True, fuse)
    assert dq_o.shape == (b[2].shape if fuse else (0,))
    (kl_o * torch.arange(kl_o.numel(), device=DEVICE).view_as(kl_o)).sum().backward()
    assert torch.equal(kl_f, kl_o) and torch.equal(lse_f, lse_o)
    for x, y in zip(a, b):
        assert (x.grad is None) == (y.grad is None) and (x.grad is None or torch.equal(x.grad, y.grad))


@pytest.mark.parametrize("backend, fuse", [("reference", False), ("triton", True)])
def test_custom_op_passes_opcheck(backend, fuse):
    """torch.library.opcheck: schema, fake tensor and autograd registration are consistent (also for the forward
    that returns side b's fused query gradient)."""
    xs = [x.detach().requires_grad_(i >= 2) for i, x in enumerate(_inputs())]
    sinks = [s.detach().requires_grad_(i == 1) for i, s in enumerate(_sinks())]
    torch.library.opcheck(attention_kl_fwd_op, (*xs, *sinks, None, None, None, None, None, *dataclasses.astuple(SPEC),
                                                backend, False, True, fuse))


@pytest.mark.parametrize("compiled", [False, True])
def test_the_forward_accumulates_the_query_gradient_only_when_a_backward_will_use_it(monkeypatch, compiled):
    """Fused only with side a frozen, side b's queries trainable and grad mode on: a metric under ``no_grad`` (or a
    trainable teacher) must get the plain forward (no extra products, no saved buffer)."""
    import streamkl.autograd as autograd_mod

    calls = []
    original = autograd_mod.fused_forward
    monkeypatch.setattr(autograd_mod, "fused_forward", lambda *args: calls.append(1) or original(*args))
    torch._dynamo.reset()
    q_t, k_t, q_s, k_s = _inputs()
    loss = torch.compile(attention_kl, fullgraph=True) if compiled else attention_kl

    def count(*args, grad=True):
        calls.clear()
        with torch.set_grad_enabled(grad):
            loss(*args, backend="triton")
        return len(calls)

    assert count(q_t, k_t, q_s, k_s) == 1
    assert count(q_t, k_t, q_s, k_s, grad=False) == 0
    assert count(q_t.detach().requires_grad_(True), k_t, q_s, k_s) == 0
    assert count(q_t, k_t, q_s.detach(), k_s) == 0


def test_custom_op_refuses_a_fused_query_gradient_without_triton():
    xs = _inputs()
    with pytest.raises(ValueError, match="fuse_dq_b=True"):
        attention_kl_fwd_op(*xs, None, None, None, None, None, None, None, *dataclasses.astuple(SPEC), "reference",
                            False, True, True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_fullgraph_matches_eager(backend):
    torch._dynamo.reset()
    proj_q = torch.nn.Linear(16, 8).to(DEVICE)
    proj_k = torch.nn.Linear(16, 8).to(DEVICE)

    def step(h_s, q_t, k_t):
        # a student's projections, the loss against a frozen teacher, and the backward, in one graph
        q_s = proj_q(h_s).transpose(1, 2)  # (B, N, H, 8) -> (B, H, N, 8)
        k_s = proj_k(h_s).transpose(1, 2)
        return attention_kl(q_t, k_t, q_s, k_s, causal=True, temperature=2.0, backend=backend)

    h_s = torch.randn(2, 19, 4, 16, device=DEVICE)
    q_t, k_t = torch.randn(2, 4, 19, 16, device=DEVICE), torch.randn(2, 2, 19, 16, device=DEVICE)
    eager = step(h_s, q_t, k_t)
    eager.backward()
    grads = [p.grad.clone() for p in (*proj_q.parameters(), *proj_k.parameters())]
    for p in (*proj_q.parameters(), *proj_k.parameters()):
        p.grad = None
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    out = compiled(h_s, q_t, k_t)
    out.backward()
    assert_close(out, eager, 1e-6, "loss")
    for g, p in zip(grads, (*proj_q.parameters(), *proj_k.parameters())):
        assert_close(p.grad, g, 1e-5, "grad")


@pytest.mark.slow
def test_torch_compile_inductor_fullgraph_reference():
    """The default inductor backend compiles around the op (CPU: C++ codegen, so this takes ~a minute)."""
    torch._dynamo.reset()
    q_t, k_t = torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    w = torch.randn(8, 8, requires_grad=True)

    def step(x):
        q_s = torch.tanh(x @ w)
        return attention_kl(q_t, k_t, q_s, q_s, backend="reference") * 3.0

    x = torch.randn(1, 2, 16, 8)
    expected = step(x)
    (g_expected,) = torch.autograd.grad(expected, w)
    out = torch.compile(step, fullgraph=True)(x)
    (g,) = torch.autograd.grad(out, w)
    assert_close(out, expected, 1e-5, "loss")
    assert_close(g, g_expected, 1e-4, "grad")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reduction_inside_the_function_equals_the_separate_ops(backend, reduction, dtype):
    """``reduction="mean"``/``"sum"`` is reduced inside the autograd Function (one node; its backward hands the one
    upstream gradient to the kernels, which read it with stride 0): loss and every gradient are bitwise those of the
    per-row op followed by the torch reduction with a contiguous upstream gradient, as before the fusion. Masks empty
    a whole batch row and exclude queries, so the mean's count is taken on the device."""
    from streamkl._reduction import reduce_per_row_kl

    if backend == "reference" and dtype == torch.float16:
        pytest.skip("fp16 is for the kernels' power-of-two dS scaling; the reference path is covered in fp32")
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(2, 2, 21, 8, generator=g).to(DEVICE, dtype) for _ in range(4)]
    key_mask = torch.rand(2, 21, generator=g) > 0.3
    key_mask[1] = False
    query_mask = (torch.rand(2, 21, generator=g) > 0.2).to(DEVICE)
    for masks in ({}, {"key_padding_mask": key_mask.to(DEVICE), "query_mask": query_mask}):
        fused = [x.clone().requires_grad_(True) for x in xs]
        loss = attention_kl(*fused, causal=True, reduction=reduction, backend=backend, **masks)
        assert type(loss.grad_fn).__name__ == "AttentionKLFunctionBackward"
        loss.backward()
        split = [x.clone().requires_grad_(True) for x in xs]
        per_row = attention_kl(*split, causal=True, reduction="none", backend=backend, **masks)
        if masks:  # counted rows: a causal row sees a real key at or before it, and query_mask keeps it
            counted = (key_mask.to(DEVICE).cumsum(1) > 0) & query_mask
            expected = reduce_per_row_kl(per_row, counted[:, None, :].expand_as(per_row), reduction)
        elif reduction == "mean":  # no row can be empty: the mean over every row, one kernel
            expected = per_row.mean()
        else:
            expected = per_row.sum()
        (upstream,) = torch.autograd.grad(expected, per_row, retain_graph=True)
        per_row.backward(upstream.contiguous())
        assert torch.equal(loss, expected)
        for a, b in zip(fused, split):
            assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_the_backward_materialises_no_gradients_for_the_log_sum_exps(reduction):
    """Host time: ``lse_a``/``lse_b`` are outputs nobody differentiates; the engine must hand the backward None for
    them rather than allocate and fill two zero tensors per call (``ctx.set_materialize_grads(False)``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    made = []

    class LogZeros(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.zeros.default, torch.ops.aten.zeros_like.default):
                made.append(tuple(out.shape))
            return out

    x = [torch.randn(1, 2, 8, 4, device=DEVICE, requires_grad=i >= 2) for i in range(4)]
    loss = attention_kl(*x, reduction=reduction, backend="reference")
    with LogZeros():
        (loss if reduction == "mean" else loss.sum()).backward()
    assert (1, 2, 8) not in made, made
    assert x[2].grad is not None and torch.isfinite(x[2].grad).all()


def _saved_by(fn):
    """The shapes and dtypes of every tensor autograd saves while ``fn`` runs, and its result."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((tuple(t.shape), t.dtype)) or t, lambda t: t):
        out = fn()
    return saved, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction, masked", [("mean", False), ("mean", True), ("sum", True)])
def test_a_reduced_training_loss_keeps_only_the_students_gradients(dtype, reduction, masked):
    """Memory: with a frozen teacher and ``reduction="mean"``/``"sum"``, the forward computes the student's query and
    key gradients per unit of the loss and saves only those (in the student's dtypes; fp32 for fp16, whose range
    cannot hold a gradient per unit of the loss): no teacher tensor and no student input stays alive for the backward.
    The gradients, under a real upstream gradient and twice with ``retain_graph``, agree with the float64 oracle, in
    the student's dtype; masks exclude rows, so the mean's count is taken on the device."""
    from tests.streamkl.oracle import TOLERANCES

    g = torch.Generator().manual_seed(7)
    q_t, q_s = (torch.randn(2, 4, 29, 16, generator=g).to(DEVICE, dtype) for _ in range(2))
    k_t, k_s = (torch.randn(2, 2, 29, 16, generator=g).to(DEVICE, dtype) for _ in range(2))
    masks = {}
    if masked:
        masks = {"key_padding_mask": (torch.rand(2, 29, generator=g) > 0.3).to(DEVICE),
                 "query_mask": (torch.rand(2, 29, generator=g) > 0.2).to(DEVICE)}
    student = [x.clone().requires_grad_(True) for x in (q_s, k_s)]
    saved, loss = _saved_by(lambda: attention_kl(q_t, k_t, *student, causal=True, reduction=reduction,
                                                 backend="triton", **masks))
    kept = torch.float32 if dtype == torch.float16 else dtype
    assert saved == [(tuple(q_s.shape), kept), (tuple(k_s.shape), kept)]
    upstream = torch.tensor(3.5, device=DEVICE)
    grads = torch.autograd.grad(loss, student, upstream, retain_graph=True)
    again = torch.autograd.grad(loss, student, upstream)
    exact = [x.double().requires_grad_(True) for x in (q_s, k_s)]
    oracle = attention_kl(q_t.double(), k_t.double(), *exact, causal=True, reduction=reduction, backend="reference",
                          **masks)
    expected = torch.autograd.grad(oracle, exact, upstream.double())
    assert_close(loss, oracle, TOLERANCES[dtype][0], "loss")
    for got, repeat, want, name in zip(grads, again, expected, ("dq_s", "dk_s")):
        assert got.dtype == dtype and torch.equal(got, repeat)
        assert_close(got, want, TOLERANCES[dtype][1], name)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_reduced_bf16_loss_writes_its_query_gradient_once_in_bf16(reduction):
    """A loss whose gradient the host knows (a sum, a mean over rows it counts): the training forward scales the
    student's query gradient by it and writes it in bf16 itself, at any size: no fp32 buffer of it and no copy kernel
    follow, and the bits are the fp32 buffer's rounded to nearest even (the copy it replaces)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from streamkl._problem import KLInputs
    from streamkl.autograd import fused_forward

    g = torch.Generator().manual_seed(11)
    q_t, q_s = (torch.randn(1, 4, 37, 16, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    k_t, k_s = (torch.randn(1, 2, 37, 16, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    student = [x.clone().requires_grad_(True) for x in (q_s, k_s)]
    ops = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and tuple(out.shape) == tuple(q_s.shape):
                ops.append((func.__name__, out.dtype))
            return out

    with Log():
        loss = attention_kl(q_t, k_t, *student, causal=True, reduction=reduction, backend="triton")
    assert not any(dtype == torch.float32 for _, dtype in ops), ops
    assert not any(name.startswith("_to_copy") for name, _ in ops), ops
    (dq_s,) = torch.autograd.grad(loss, student[:1])
    spec = KLSpec(0.25, 0.25, window_right=0)
    scale = 1.0 if reduction == "sum" else 1.0 / q_s[..., 0].numel()
    *_, wide = fused_forward(KLInputs(q_t, k_t, q_s, k_s, *[None] * 6), spec, "triton", False, scale)
    assert wide.dtype == torch.float32 and wide.abs().max() > 0
    assert torch.equal(dq_s, wide.to(torch.bfloat16))


def test_fp16_gradients_computed_ahead_survive_a_gradient_scalers_factor():
    """fp16 under a gradient scaler: a student close to its teacher, a mean over many rows. Its gradients per unit of
    the loss lie below fp16's smallest subnormal, so saving them in fp16 would flush them to zero; the scaler's factor
    (the upstream gradient, 2^16) brings them back into range. The op saves them in fp32 and rounds once, after the
    factor: the scaled gradients agree with the float64 oracle's to fp16's tolerance."""
    from tests.streamkl.oracle import TOLERANCES

    g = torch.Generator().manual_seed(11)
    q_t, k_t = (0.3 * torch.randn(2, 4, 64, 16, generator=g) for _ in range(2))
    q_s = q_t + 3e-4 * torch.randn(q_t.shape, generator=g)
    teacher = [x.to(DEVICE, torch.float16) for x in (q_t, k_t)]
    student = [x.to(DEVICE, torch.float16).requires_grad_(True) for x in (q_s, k_t)]
    loss = attention_kl(*teacher, *student, causal=True, reduction="mean", backend="triton")
    factor = torch.tensor(2.0**16, device=DEVICE)
    grads = torch.autograd.grad(loss, student, factor)
    exact = [x.detach().double().requires_grad_(True) for x in student]
    oracle = attention_kl(*(x.double() for x in teacher), *exact, causal=True, reduction="mean", backend="reference")
    expected = torch.autograd.grad(oracle, exact, factor.double())
    for want in expected:  # per unit of the loss: every one below fp16's smallest subnormal
        assert float(want.abs().max()) / 2**16 < 2**-24
    for got, want, name in zip(grads, expected, ("dq_s", "dk_s")):
        assert got.dtype == torch.float16
        assert_close(got, want, TOLERANCES[torch.float16][1], name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_loss_with_gradients_passes_opcheck(dtype):
    """The custom op a compiled training loss takes (``streamkl::attention_kl_loss_ahead``): schema, fake tensors and
    autograd registration agree (the mean counted on the device; the eager tests above cover the other reductions),
    for fp16 too, whose saved gradients are fp32 and whose input gradients are fp16.
    """
    from streamkl.autograd import attention_kl_loss_ahead_op

    xs = [x.detach().to(dtype).requires_grad_(i >= 2) for i, x in enumerate(_inputs())]
    torch.library.opcheck(attention_kl_loss_ahead_op, (*xs, None, None, None, None, None, None, None,
                                                       *dataclasses.astuple(SPEC), "triton", False, True, "mean", 0))
