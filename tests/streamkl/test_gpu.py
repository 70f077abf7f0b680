"""GPU suite: the Triton kernels at realistic shapes against the float64 oracle (skipped without CUDA).

Run on a GPU machine with ``python -m pytest -m gpu tests/streamkl/test_gpu.py``. Up to N=2048 the oracle
is the materialising ``naive_attention_kl``; beyond, the chunked reference in float64 (itself checked
against the naive oracle to 1e-10 in test_reference.py). Allocations are NaN-poisoned.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from streamkl import attention_kl, reference
from tests._helpers import assert_close
from tests.streamkl.cases import Case, make_inputs
from tests.streamkl.oracle import TOLERANCES, counted_rows
from tests.streamkl.test_triton import poison_allocations  # noqa: F401  (autouse fixture)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

G = Case(b=1, h=4, h_kt=4, h_ks=4, n_q=8192, n_k=8192, d_t=64, d_s=64)
GPU_CASES = [
    (G, torch.bfloat16),
    (replace(G, causal=True), torch.bfloat16),
    (replace(G, n_q=4096, n_k=4096, d_t=128, d_s=128, causal=True, h_kt=1, h_ks=2), torch.bfloat16),
    (replace(G, n_q=4096, n_k=4096, d_t=128, d_s=64, causal=True, teacher_grad=True, layout="bnhd"), torch.bfloat16),
    (replace(G, n_q=2048, n_k=2048, causal=True, key_mask="random", query_mask=True), torch.float16),
    (replace(G, n_q=2048, n_k=2048, d_t=128, d_s=128, direction="reverse", teacher_grad=True), torch.float16),
    (replace(G, n_q=1024, n_k=1024, d_t=128, d_s=128, direction="reverse", teacher_grad=True, causal=True), torch.float32),
    (replace(G, n_q=2048, n_k=2048, key_mask="empty_batch", b=2), torch.float32),
    (replace(G, n_q=1000, n_k=3000, causal=True, h_kt=2, d_t=96, d_s=80), torch.float16),
    (replace(G, n_q=3001, n_k=1003, causal=True, d_t=256, d_s=256, h=2, h_kt=2, h_ks=2), torch.bfloat16),
    (replace(G, n_q=2048, n_k=2048, sharpness=8.0, temperature=2.0, causal=True), torch.bfloat16),
    # padding that fills whole tiles, which the kernels skip: right- and left-padded rows, a trainable teacher
    (replace(G, b=2, n_q=3000, n_k=3000, causal=True, key_mask="padded", query_mask=True), torch.bfloat16),
    (replace(G, b=2, n_q=2500, n_k=2500, key_mask="padded", query_mask=True, teacher_grad=True,
             direction="reverse"), torch.float16),
]


GPU_REAL_TEACHER_CASES = [
    (replace(G, n_q=1, n_k=1, seqlens=(3000, 1, 4096, 1000, 0, 2047), causal=True), torch.bfloat16),
    (replace(G, n_q=1, n_k=1, seqlens=(1500, 2600), seqlens_k=(2048, 3000), causal=True, h_kt=2,
             teacher_grad=True, window=(700, -1)), torch.float16),
    (replace(G, n_q=4096, n_k=4096, window=(1000, 1000), softcap_t=50.0, softcap_s=30.0, teacher_grad=True),
     torch.bfloat16),
    (replace(G, n_q=4096, n_k=4096, causal=True, window=(511, -1), sinks=True, teacher_grad=True,
             direction="reverse", d_t=128, d_s=64), torch.bfloat16),
    (replace(G, n_q=1, n_k=1, seqlens=(4000, 3000, 1100), causal=True, window=(1024, -1), softcap_t=30.0, sinks=True,
             teacher_grad=True, d_t=128, d_s=64, h_kt=1), torch.float16),
    (replace(G, n_q=2048, n_k=2048, causal=True, key_mask="random", query_mask=True, window=(300, -1), sinks=True,
             softcap_s=20.0), torch.float32),
    (replace(G, n_q=4096, n_k=4096, attn_mask="prefix", teacher_grad=True, b=2), torch.bfloat16),
    (replace(G, n_q=1500, n_k=2100, attn_mask="random", key_mask="random", window=(400, 300), sinks=True,
             softcap_t=30.0, d_t=128, d_s=64), torch.float16),
]


def _oracle(case, inputs, grad_out):
    """float64 per-row KL and gradients of Σ grad_out·KL, by the naive map or the fp64 chunked reference."""
    ref_tensors = inputs.float64_copies()
    kw = case.kwargs()
    if not case.packed and case.n_q * case.n_k <= 2048 * 2048:
        from streamkl import naive_attention_kl

        ref = naive_attention_kl(**ref_tensors, **inputs.extras, reduction="none", **kw)
    else:
        ref = attention_kl(**ref_tensors, **inputs.extras, reduction="none", backend="reference", **kw)
    (ref * grad_out).sum().backward()
    return ref.detach(), {n: x.grad for n, x in ref_tensors.items()}


@pytest.mark.parametrize(("case", "dtype"), [pytest.param(c, d, id=f"{c.id}-{d}".replace("torch.", ""))
                                             for c, d in GPU_CASES + GPU_REAL_TEACHER_CASES])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_gpu_matches_float64_oracle(case: Case, dtype: torch.dtype, deterministic: bool, monkeypatch):
    monkeypatch.setattr(reference, "DEFAULT_CHUNK_SIZE", 1024)
    inputs = make_inputs(case, dtype, "cuda")
    out = inputs.call(attention_kl, reduction="none", backend="triton", deterministic=deterministic, **case.kwargs())
    grad_out = torch.randn(out.shape, dtype=torch.float64, device="cuda")
    (out * grad_out.float()).sum().backward()
    ref, ref_grads = _oracle(case, inputs, grad_out)
    rtol_fwd, rtol_grad = TOLERANCES[dtype]
    assert_close(out, ref, rtol_fwd, "kl")
    empty = ~counted_rows(case, inputs).cuda()
    assert torch.all(out[empty] == 0)
    for name, x in inputs.tensors.items():
        if ref_grads[name] is None:
            assert x.grad is None
        else:
            assert_close(x.grad, ref_grads[name], rtol_grad, f"d{name}")


@pytest.mark.parametrize(("dtype", "loss_scale"), [(torch.bfloat16, 1.0), (torch.float16, 2.0**16), (torch.float16, 1.0)],
                         ids=["bf16", "fp16-gradscaler", "fp16-unscaled"])
def test_gpu_low_precision_gradients_of_a_mean_loss_at_long_context(dtype, loss_scale, monkeypatch):
    """Regression (fp16 underflow): ``loss = attention_kl(..., reduction="mean")``, then ``loss.backward()`` (bf16) or
    ``(loss * 2**16).backward()`` (fp16 with a GradScaler at its default initial scale) at B·H = 256, N = 32768.
    Each element of ``g·(P_s − P_t)`` is ~scale/(B·H·N²), under fp16's subnormals even with the GradScaler; cast to
    fp16 before the products it lost most of dK. Unscaled fp16 gradients are themselves mostly below fp16's range
    (~1e-8): the best any fp16 result can do is the oracle rounded to fp16, which is what is checked there.
    The gradient of a (b, h) slice depends only on that slice, so four slices are checked against float64."""
    monkeypatch.setattr(reference, "DEFAULT_CHUNK_SIZE", 4096)
    b, h, n, d = 16, 16, 32768, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    q_t, k_t, q_s, k_s = (torch.randn(b, h, n, d, device="cuda", generator=g, dtype=dtype) for _ in range(4))
    q_s.requires_grad_(True)
    k_s.requires_grad_(True)
    (attention_kl(q_t, k_t, q_s, k_s, causal=True) * loss_scale).backward()
    for bi, hi in ((0, 0), (3, 7), (9, 15), (15, 2)):
        sl = (slice(bi, bi + 1), slice(hi, hi + 1))
        ref_q, ref_k = (x.detach()[sl].double().requires_grad_(True) for x in (q_s, k_s))
        ref = attention_kl(q_t[sl].double(), k_t[sl].double(), ref_q, ref_k, causal=True, reduction="sum",
                           backend="reference") * (loss_scale / (b * h * n))
        ref.backward()
        for name, got, want in (("dq_s", q_s.grad[sl], ref_q.grad), ("dk_s", k_s.grad[sl], ref_k.grad)):
            if dtype == torch.float16 and loss_scale == 1.0:
                torch.testing.assert_close(got.double(), want.to(dtype).double(), atol=6e-8, rtol=2e-2)
            else:
                zeros = float((got == 0).float().mean())
                assert zeros < 0.01, f"{name}: {zeros:.1%} of the entries flushed to zero"
                assert_close(got, want, 2e-2, f"{name} (b={bi}, h={hi})")


def test_gpu_memory_is_linear_in_n():
    """Peak extra memory of forward+backward at N=16384 (B=1, H=16, D=64, bf16) beyond inputs and grads."""
    b, h, n, d = 1, 16, 16384, 64
    q_t, k_t, q_s, k_s = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    q_s.requires_grad_(True)
    k_s.requires_grad_(True)
    q_s.grad = torch.zeros_like(q_s)
    k_s.grad = torch.zeros_like(k_s)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    attention_kl(q_t, k_t, q_s, k_s, causal=True).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    rows = b * h * n
    per_row = extra / rows
    print(f"peak extra bytes: {extra} = {per_row:.1f} bytes per (b, h, query row)")
    # The gradients themselves (dq 2·D and dk 2·D bytes in bf16 before they are accumulated into .grad),
    # the saved kl/lse and the upstream gradient (16 bytes), and 4·D of slack for the fp32 dQ accumulator
    # the atomic backward would add: linear in N, nothing proportional to N². Measured on an H100 with
    # the default (deterministic) backward: 280 bytes per row at D=64.
    assert per_row <= 2 * d + 2 * d + 4 * d + 32
    assert extra < b * h * n * n * 4 / 100  # under 1% of one materialised fp32 map


def test_gpu_64bit_offsets():
    """B·H·N_q·D > 2^31 elements: rows past the 2^31st element are computed and differentiated correctly."""
    n_q, n_k, d = (1 << 25) + 100, 64, 64  # q has 2^31 + 6400 elements
    q_t = torch.randn(1, 1, n_q, d, device="cuda", dtype=torch.bfloat16)
    q_s = torch.randn(1, 1, n_q, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k_t, k_s = (torch.randn(1, 1, n_k, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = attention_kl(q_t, k_t, q_s, k_s, reduction="none", backend="triton")
    out[..., -200:].sum().backward()
    tail = slice(n_q - 200, n_q)
    qs_tail = q_s.detach()[:, :, tail].double().requires_grad_(True)
    ref = attention_kl(q_t[:, :, tail].double(), k_t.double(), qs_tail, k_s.double(), reduction="none",
                       backend="reference")
    ref.sum().backward()
    assert_close(out[..., tail], ref, 2e-2, "kl tail")
    assert_close(q_s.grad[:, :, tail], qs_tail.grad, 2e-2, "dq tail")
    assert torch.all(q_s.grad[:, :, : n_q - 200] == 0)


def test_gpu_cuda_graph_capture_of_forward_and_backward():
    """Forward+backward captured in a CUDA graph and replayed on new data equals eager."""
    shape = (1, 4, 1024, 64)
    q_t, k_t = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q_s, k_s = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))

    def step():
        loss = attention_kl(q_t, k_t, q_s, k_s, causal=True)
        loss.backward()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm up: compile the kernels outside the capture
            q_s.grad = k_s.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    q_s.grad = k_s.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step()
    new = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    with torch.no_grad():
        for x, y in zip((q_t, k_t, q_s, k_s), new):
            x.copy_(y)
    graph.replay()
    torch.cuda.synchronize()
    ref_q, ref_k = (x.detach().clone().requires_grad_(True) for x in (q_s, k_s))
    ref = attention_kl(q_t, k_t, ref_q, ref_k, causal=True)
    ref.backward()
    torch.testing.assert_close(static_loss, ref)
    torch.testing.assert_close(q_s.grad, ref_q.grad)
    torch.testing.assert_close(k_s.grad, ref_k.grad)


def test_gpu_forward_and_backward_never_synchronise_with_the_host():
    """No host synchronisation anywhere in the op's default path (masks, a padded batch on the Hopper kernels under
    autocast, mean reduction, packed with both maxima given, windows, caps, sinks): ``torch.cuda.set_sync_debug_mode("error")`` raises on any implicit sync."""
    q_t, k_t, q_s, k_s = (torch.randn(2, 4, 512, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    q_s.requires_grad_(True)
    kpm = torch.rand(2, 512, device="cuda") > 0.1
    cu = torch.tensor([0, 300, 1024], dtype=torch.int32, device="cuda")
    packed = [x.transpose(1, 2).reshape(1024, 4, 64) for x in (q_t, k_t, q_s, k_s)]
    sinks = torch.zeros(4, device="cuda")
    # a right-padded batch at a shape of the Hopper kernels, its masks on the GPU, under autocast
    b_t, b_s = (torch.randn(2, 4, 2048, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    b_s.requires_grad_(True)
    right_padded = torch.arange(2048, device="cuda") < torch.tensor([[2048], [1500]], device="cuda")

    def padded():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return attention_kl(b_t, b_t, b_s, b_s, causal=True, key_padding_mask=right_padded,
                                query_mask=right_padded)

    calls = [
        padded,
        lambda: attention_kl(q_t, k_t, q_s, k_s, causal=True, key_padding_mask=kpm, window=(100, 0)),
        lambda: attention_kl(q_t, k_t, q_s, k_s, softcap_t=30.0, sinks_t=sinks, sinks_s=sinks),
        lambda: attention_kl(*packed, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=724,
                             max_seqlen_k=724, causal=True),
    ]
    for call in calls:
        call().backward()  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for call in calls:
            call().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
