"""The fused Triton kernels against the float64 oracle.

On a machine without a GPU these run through Triton's CPU interpreter (``TRITON_INTERPRET=1``, set by
the root conftest) at small odd shapes; on a GPU the same cases run on the device. Every allocation
made while a test runs is poisoned with NaN, so a row or gradient the kernels forget to write fails.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl

from streamkl import attention_kl
from streamkl._triton._helpers import _clip_band, _kept_span, _longest_first, _to_bf16_nearest_even
from tests._helpers import assert_close
from tests.streamkl.cases import BASE, ORACLE_CASES, REAL_TEACHER_CASES, Case, make_inputs, params
from tests.streamkl.oracle import TOLERANCES, check_against_oracle

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


@pytest.mark.parametrize("case", params(REAL_TEACHER_CASES))
def test_triton_matches_oracle_on_real_teacher_options(case: Case):
    check_against_oracle(case, torch.float32, "triton", DEVICE)


LOW_PRECISION_CASES = [
    replace(BASE, n_q=63, n_k=63, d_t=40, d_s=72, causal=True),
    replace(BASE, h=6, h_kt=2, h_ks=3, d_t=24, d_s=12, key_mask="random", teacher_grad=True),
    replace(BASE, layout="bnhd", direction="reverse", query_mask=True, n_q=17, n_k=45, causal=True),
    replace(BASE, seqlens=(21, 40), causal=True, window=(9, -1), softcap_t=2.0, sinks=True, teacher_grad=True),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", params(LOW_PRECISION_CASES))
def test_triton_matches_oracle_half(case: Case, dtype: torch.dtype):
    check_against_oracle(case, dtype, "triton", DEVICE, reduction_checks=False)


DETERMINISTIC_CASES = [
    replace(BASE, n_q=45, n_k=37, causal=True, key_mask="random", teacher_grad=True),
    replace(BASE, h=4, h_kt=1, h_ks=2, direction="reverse", teacher_grad=True, d_t=20),
    replace(BASE, seqlens=(19, 30), causal=True, window=(7, -1), softcap_s=3.0, teacher_grad=True),
]


@pytest.mark.parametrize("case", params(DETERMINISTIC_CASES))
def test_deterministic_backward_matches_oracle_and_is_bitwise_stable(case: Case):
    inputs = make_inputs(case, torch.float32, DEVICE)
    tensors = list(inputs.tensors.values())
    grads = []
    for _ in range(2):
        for x in tensors:
            x.grad = None
        inputs.call(attention_kl, reduction="sum", backend="triton", deterministic=True, **case.kwargs()).backward()
        grads.append([x.grad.clone() for x in tensors])
    for g0, g1 in zip(*grads):
        assert torch.equal(g0, g1)
    # and the deterministic gradients agree with the atomic ones
    for x in tensors:
        x.grad = None
    inputs.call(attention_kl, reduction="sum", backend="triton", deterministic=False, **case.kwargs()).backward()
    for g_det, x in zip(grads[0], tensors):
        assert_close(x.grad, g_det, 1e-5, "deterministic vs atomic")


def test_torch_deterministic_mode_overrides_atomic_request(monkeypatch):
    seen = {}
    from streamkl._triton import backward

    original = backward.attention_kl_bwd

    def spy(*args, **kwargs):
        seen["deterministic"] = kwargs["deterministic"]
        return original(*args, **kwargs)

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


def test_wide_offset_path_matches_oracle(monkeypatch, request):
    """Regression: in-slice offsets ``row * stride`` overflowed int32 once a (batch, head) slice held more
    than 2^31 elements (illegal address on an H100). The 64-bit path is forced here on small inputs."""
    from streamkl._triton import backward, forward

    def clear_plans():  # launch plans are cached per geometry; WIDE is part of them
        forward._forward_plan.cache_clear()
        backward._backward_plan.cache_clear()

    monkeypatch.setattr(forward, "wide_offsets", lambda *x: True)
    monkeypatch.setattr(backward, "wide_offsets", lambda *x: True)
    clear_plans()
    request.addfinalizer(clear_plans)
    case = replace(BASE, n_q=37, n_k=29, causal=True, key_mask="random", teacher_grad=True)
    check_against_oracle(case, torch.float32, "triton", DEVICE, reduction_checks=False)
    check_against_oracle(replace(case, layout="bnhd", direction="reverse"), torch.float32, "triton", DEVICE,
                         reduction_checks=False)



def test_fp16_gradient_tiles_do_not_underflow_before_the_products():
    """Regression (fp16 underflow): ``g·(P_s − P_t)`` was cast to fp16 before the tensor-core products, so elements
    below fp16's smallest subnormal (6e-8) became 0 even where their sum, dK, is a normal fp16 number. Here every
    one of 8192 rows holds the same query (a long run of one token), so dK_j sums 8192 equal elements of ~2e-8:
    without the power-of-two tile scaling dK_s came out exactly 0; its true value is ~8e-5."""
    n_q, d = 8192, 16
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 1, d, generator=g).expand(1, 1, n_q, d)
    k_t, k_s = (torch.randn(1, 1, 2, d, generator=g) for _ in range(2))
    q_t, q_s = q.to(DEVICE, torch.float16), q.to(DEVICE, torch.float16).contiguous().requires_grad_(True)
    k_t, k_s = k_t.to(DEVICE, torch.float16), k_s.to(DEVICE, torch.float16).requires_grad_(True)
    (2e-3 * attention_kl(q_t, k_t, q_s, k_s, backend="triton")).backward()  # a weighted mean, as users call it
    ref_q, ref_k = (x.detach().double().requires_grad_(True) for x in (q_s, k_s))
    (2e-3 * attention_kl(q_t.double(), k_t.double(), ref_q, ref_k, backend="reference")).backward()
    assert ref_k.grad.abs().max() > 6.1e-5, "dK_s is a normal fp16 number"
    assert_close(k_s.grad, ref_k.grad, 1e-2, "dk_s")
    # dQ_s (~3e-9 per element) is below fp16's range: the best fp16 answer is the oracle rounded, i.e. 0
    torch.testing.assert_close(q_s.grad.double(), ref_q.grad.to(torch.float16).double(), atol=6e-8, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("teacher_grad", [False, True])
def test_query_gradient_keeps_its_precision_when_the_student_matches_the_teacher(dtype, teacher_grad):
    """Regression guard for the forward-accumulated dQ_s (frozen teacher, ``teacher_grad=False``). Near convergence
    ``dQ_s ∝ Σ_j (P_s − P_t) k_j`` is a small difference of large terms; accumulating ``E_Ps[k]`` and ``E_Pt[k]``
    separately (each with its P tile rounded to bf16/fp16 for the tensor cores) loses it to cancellation
    (relative error ~``|P| / |P_s − P_t|`` times the rounding, ~1 here in bf16). The fused forward rounds the
    difference tile instead, so it must be as exact as the two-pass backward (``teacher_grad=True``)."""
    g = torch.Generator().manual_seed(5)
    b, h, n, d = 1, 2, 80, 32
    q, k = (torch.randn(b, h, n, d, generator=g).to(DEVICE, dtype) for _ in range(2))
    scale_t = d**-0.5
    scale_s = scale_t * (1 + 2e-3)  # the same tensors, a 0.2 % sharper student: KL ~ 1e-6 per row
    q_t, k_t = q.clone().requires_grad_(teacher_grad), k.clone().requires_grad_(teacher_grad)
    q_s, k_s = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    loss_scale = 1024.0  # what a GradScaler does: keeps the fp16 gradients in range
    kw = dict(causal=True, scale_t=scale_t, scale_s=scale_s)
    (loss_scale * attention_kl(q_t, k_t, q_s, k_s, backend="triton", **kw)).backward()
    ref_q, ref_k = (x.detach().double().requires_grad_(True) for x in (q_s, k_s))
    (loss_scale * attention_kl(q.double(), k.double(), ref_q, ref_k, backend="reference", **kw)).backward()
    assert_close(q_s.grad, ref_q.grad, TOLERANCES[dtype][1], "dq_s")
    assert_close(k_s.grad, ref_k.grad, TOLERANCES[dtype][1], "dk_s")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("position, boost_t, boost_s, close", [
    (0, 6.0, 0.0, False),  # an attention sink only the teacher has: the first tile's ratio of the sums is far off
    (70, 9.0, 8.0, False),  # a late key far above every earlier score: both frames move mid-sweep (> 2^8)
    (70, -30.0, 12.0, False),  # a late key the student attends to and the teacher ignores
    (70, 9.0, 9.0, True),  # a student close to its teacher: the frames move and the ratio of the sums does not
])
def test_query_gradient_stays_exact_when_one_key_dominates(dtype, position, boost_t, boost_s, close):
    """The frozen-teacher forward keeps ``dQ_s`` with a reference ratio of the running sums and lazily moved frames
    (``_fused_dq_fold``): a key that moves the ratio or a row's max far must not cost precision. The key at
    ``position`` gets ``boost`` added to every query's score (through a key component that all queries share), on the
    teacher's and the student's side apart; the gradients are compared with float64 as users compute them."""
    g = torch.Generator().manual_seed(11)
    b, h, n, d = 1, 2, 150, 32
    q_t, k_t, q_s, k_s = (torch.randn(b, h, n, d, generator=g) for _ in range(4))
    if close:  # the same tensors, a 0.2 % sharper student (as in the test above)
        q_s, k_s = q_t.clone(), k_t.clone()
    scale = dict(scale_t=d**-0.5, scale_s=d**-0.5 * (1.002 if close else 1.0))
    for q in (q_t, q_s):
        q[..., 0] = 1.0
    for k, boost in ((k_t, boost_t), (k_s, boost_s)):
        k[..., 0] = 0.0
        k[..., position, 0] = boost * d**0.5
    q_t, k_t = q_t.to(DEVICE, dtype), k_t.to(DEVICE, dtype)
    q_s, k_s = (x.to(DEVICE, dtype).requires_grad_(True) for x in (q_s, k_s))
    loss_scale = 1024.0 if close else 64.0  # a GradScaler's: keeps fp16 gradients in range
    (loss_scale * attention_kl(q_t, k_t, q_s, k_s, causal=True, backend="triton", **scale)).backward()
    ref_q, ref_k = (x.detach().double().requires_grad_(True) for x in (q_s, k_s))
    (loss_scale * attention_kl(q_t.double(), k_t.double(), ref_q, ref_k, causal=True, backend="reference",
                               **scale)).backward()
    assert_close(q_s.grad, ref_q.grad, TOLERANCES[dtype][1], "dq_s")
    assert_close(k_s.grad, ref_k.grad, TOLERANCES[dtype][1], "dk_s")


@pytest.mark.parametrize("dtype, narrow_bytes, saved", [
    (torch.bfloat16, None, torch.float32),  # a small buffer stays fp32: one rounding fewer
    (torch.bfloat16, 0, torch.bfloat16),  # at or above NARROW_DQ_MIN_BYTES: half the memory
    (torch.float16, 0, torch.float32),
    (torch.float32, 0, torch.float32),
])
def test_the_forward_accumulated_query_gradient_is_saved_like_the_queries(monkeypatch, dtype, narrow_bytes, saved):
    """Memory: with a frozen teacher the forward's dQ_s is the one extra saved tensor, bf16 for bf16 inputs once it is
    large (fp32's range), fp32 below that and for fp16 (whose range would flush it) and fp32 inputs. Gradients agree
    with the fp64 reference either way. (A per-row loss: a reduced one keeps the gradients themselves, see
    test_autograd.py.)"""
    from streamkl._triton import forward

    if narrow_bytes is not None:
        monkeypatch.setattr(forward, "NARROW_DQ_MIN_BYTES", narrow_bytes)
    g = torch.Generator().manual_seed(2)
    q_t, k_t, q_s, k_s = (torch.randn(1, 2, 20, 16, generator=g).to(DEVICE, dtype) for _ in range(4))
    q_s.requires_grad_(True)
    k_s.requires_grad_(True)
    kl = attention_kl(q_t, k_t, q_s, k_s, backend="triton", reduction="none")
    dq_b = kl.grad_fn.saved_tensors[-1]
    assert dq_b.dtype == saved and dq_b.shape == q_s.shape
    kl.sum().backward()
    assert q_s.grad.dtype == dtype
    ref_q = q_s.detach().double().requires_grad_(True)
    attention_kl(q_t.double(), k_t.double(), ref_q, k_s.detach().double(), backend="reference",
                 reduction="sum").backward()
    assert_close(q_s.grad, ref_q.grad, TOLERANCES[dtype][1], "dq_s")


@triton.jit
def _round_kernel(X, Y, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(Y + i, _to_bf16_nearest_even(tl.load(X + i)))


def test_bf16_rounding_is_torchs_to_nearest_even():
    """The kernels' fp32 -> bf16 rounding gives torch's bits on ties (both directions), carries into the exponent,
    overflow to inf, infinities, signed zeros, subnormals, NaN and random values."""
    one_ulp = 2.0 ** -7
    special = [1.0 + one_ulp / 2, 1.0 + 3 * one_ulp / 2, -(1.0 + one_ulp / 2), 1.0 + one_ulp / 2 + 2.0 ** -20,
               2.0 - 2.0 ** -20, 3.4e38, float("inf"), float("-inf"), 0.0, -0.0, 1e-40, -3e-39, float("nan")]
    x = torch.cat([torch.tensor(special), torch.randn(256 - len(special), generator=torch.Generator().manual_seed(0))
                   * 10.0 ** torch.randint(-30, 30, (256 - len(special),), generator=torch.Generator().manual_seed(1))])
    x = x.to(DEVICE, torch.float32)
    y = torch.empty(256, dtype=torch.bfloat16, device=DEVICE)
    _round_kernel[(1,)](x, y, 256)
    expected = x.to(torch.bfloat16)
    same = (y.view(torch.int16) == expected.view(torch.int16)) | (y.isnan() & expected.isnan())
    assert same.all(), x[~same]


@pytest.mark.parametrize("causal", [False, True])
def test_the_kernel_writes_a_bf16_query_gradient_as_rounding_its_fp32_one_would(monkeypatch, causal):
    """v15: from NARROW_DQ_MIN_BYTES up the fused forward writes dQ_s as bf16 itself, with no fp32 buffer and no copy
    kernel; the values are bitwise the fp32 buffer's rounded to nearest even by torch (the copy it replaces), on odd
    lengths, a key-head split and a rescaled frame (a dominant late key)."""
    from streamkl._problem import KLInputs, KLSpec
    from streamkl._triton import forward

    g = torch.Generator().manual_seed(5)
    q_t, q_s = (torch.randn(1, 4, 37, 16, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    k_t, k_s = (torch.randn(1, 2, 37, 16, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    k_s[0, :, 30] *= 6.0  # moves the student's frame late in the sweep
    inputs = KLInputs(q_t, k_t, q_s, k_s, *[None] * 6)
    spec = KLSpec(0.25, 0.25, window_right=0 if causal else -1)
    wide = forward.new_dq_b_buffer(inputs)
    assert wide.dtype == torch.float32
    outputs_wide = forward.attention_kl_fwd(inputs, spec, dq_b=wide)
    monkeypatch.setattr(forward, "NARROW_DQ_MIN_BYTES", 0)
    narrow = forward.new_dq_b_buffer(inputs)
    assert narrow.dtype == torch.bfloat16
    outputs_narrow = forward.attention_kl_fwd(inputs, spec, dq_b=narrow)
    assert torch.equal(narrow, wide.to(torch.bfloat16)) and wide.abs().max() > 0
    assert all(torch.equal(a, b) for a, b in zip(outputs_narrow, outputs_wide))


def test_a_frozen_teacher_gets_bitwise_reproducible_gradients_even_with_deterministic_false():
    """docs/faq.md: with a frozen teacher the forward accumulates dQ_s and the backward runs only the key pass, so
    there are no atomics to make ``deterministic=False`` vary."""
    g = torch.Generator().manual_seed(4)
    q_t, k_t, q_s, k_s = (torch.randn(2, 2, 40, 16, generator=g).to(DEVICE) for _ in range(4))
    grads = []
    for _ in range(2):
        x = [q_s.clone().requires_grad_(True), k_s.clone().requires_grad_(True)]
        attention_kl(q_t, k_t, *x, causal=True, backend="triton", deterministic=False).backward()
        grads.append([t.grad for t in x])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_launch_cache_keys_a_tma_descriptor_on_what_triton_specialises():
    """A host-side TMA descriptor (the Hopper kernels' arguments) is keyed on its base tensor's dtype and alignment,
    shape, strides and block shape: a descriptor that differs in any of these is a new launch-cache entry, one over
    another tensor of the same geometry is not."""
    from types import SimpleNamespace

    from streamkl._triton_common.launch import _signature

    def desc(x, block=(1, 1, 64, 64)):
        return SimpleNamespace(base=x, shape=list(x.shape), strides=list(x.stride()), block_shape=list(block))

    x = torch.zeros(1, 2, 128, 64, dtype=torch.bfloat16)
    assert _signature(desc(x)) == _signature(desc(torch.ones_like(x)))
    unaligned = torch.zeros(1 + x.numel(), dtype=torch.bfloat16)[1:].view_as(x)  # base 2 bytes past 16
    variants = [desc(x, (1, 1, 32, 64)), desc(x.transpose(1, 2).contiguous().transpose(1, 2)), desc(x.half()),
                desc(torch.zeros(1, 2, 256, 64, dtype=torch.bfloat16)), desc(unaligned)]
    assert len({_signature(d) for d in variants} | {_signature(desc(x))}) == len(variants) + 1
    assert _signature(x) == (torch.bfloat16, True) and _signature(None) is None


def test_cached_launch_passes_exactly_what_triton_passes():
    """The launch cache (``_triton_common/launch.py``) calls a compiled kernel's launcher directly once Triton has
    launched that specialisation: it must pass the same grid, stream and arguments as Triton's own path, and a
    new specialisation (another dtype, an unaligned pointer, a scalar equal to 1) must go back through Triton.
    A fake driver and a stand-in compiled kernel record the launches (no GPU, no compilation)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    from streamkl._triton_common.launch import KernelLauncher

    def kernel(X, Y, n, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr):  # tensors, scalars, then constexprs
        pass

    fn = JITFunction(kernel)  # the compiled-kernel path (the decorator gives the interpreter's under TRITON_INTERPRET)
    launches, compiles = [], []

    class FakeDriver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 7

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    class Compiled:
        function, packed_metadata = "function", "metadata"

        def launch_metadata(self, grid, stream, *args):
            return None

        def run(self, *args):
            launches.append(args)

    def _do_compile(key, signature, device, constexprs, options, attrs, warmup):
        compiles.append(key)
        fn.device_caches[device][0][key] = compiled = Compiled()
        return compiled

    fn._do_compile = _do_compile
    previous = driver._active  # None until something asked for it (and no GPU driver is active on CPU)
    driver.set_active(FakeDriver())
    try:
        launch = KernelLauncher(fn)
        x, y = torch.zeros(64), torch.zeros(64)
        meta = (("BLOCK", 16), ("FLAG", True), ("num_warps", 4), ("num_stages", 2))
        launch((3, 2), (x, y), (48, 0.5), meta)  # through Triton: compiles
        launch((3, 2), (x, y), (48, 0.5), meta)  # cached: direct
        assert len(compiles) == 1 and len(launches) == 2
        assert launches[0][:4] == launches[1][:4] == (3, 2, 1, 7)
        assert launches[0][4:] == launches[1][4:]  # function, metadata, hooks, every argument (constexprs too)
        assert launches[1][-6:] == (x, y, 48, 0.5, 16, True)
        launch((3, 2), (x, y), (1, 0.5), meta)  # n == 1 is a new specialisation
        launch((3, 2), (x[1:], y), (48, 0.5), meta)  # an unaligned pointer too
        launch((3, 2), (x.double(), y), (48, 0.5), meta)  # and another dtype
        assert len(compiles) == 4
    finally:
        driver._active = previous


@triton.jit
def _order_kernel(out, n_tiles, chunk):
    """Writes ``_longest_first``'s (rank, pair) of every program."""
    pid = tl.program_id(0)
    rank, pair = _longest_first(pid, n_tiles, chunk)
    tl.store(out + 2 * pid, rank)
    tl.store(out + 2 * pid + 1, pair)


def test_longest_first_order_runs_every_tile_once_longest_first():
    """``_longest_first`` maps a one-dimensional grid onto (rank, pair) one-to-one, in chunks of ``chunk`` consecutive
    pairs (the last one narrower), rank-major within a chunk: every pair's rank 0 (its longest tile) before any
    rank 1."""
    for n_tiles, pairs, chunk in ((5, 7, 3), (4, 6, 2), (3, 4, 1), (6, 3, 12)):
        out = torch.full((n_tiles * pairs, 2), -1, dtype=torch.int32, device=DEVICE)
        _order_kernel[(n_tiles * pairs,)](out, n_tiles, chunk)
        got = [tuple(x) for x in out.tolist()]
        expected = [(rank, first + i) for first in range(0, pairs, chunk)
                    for rank in range(n_tiles) for i in range(min(chunk, pairs - first))]
        assert got == expected, (n_tiles, pairs, chunk)


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_causal_grids_run_longest_first_in_chunks_of_heads(monkeypatch, request, chunk):
    """Causal forwards and backwards run their grids longest first, in chunks of (sequence, head) pairs sized from the
    L2 cache. With the L2 size forced so that 10 pairs split into chunks of 1, 2 and 5 (the backward's key pass into
    chunks of its own), every row and gradient still matches the oracle (a tile the order skipped would leave NaN
    behind): GQA, a window, the frozen-teacher forward and both passes of the two-pass backward."""
    from streamkl._triton import backward, forward

    key_bytes = 40 * (16 * 4 * 1 + 16 * 4 * 5) // 5  # N_k = 40, D = 16, fp32, teacher 1 and student 5 key heads
    for module in (forward, backward):
        monkeypatch.setattr(module, "l2_cache_bytes", lambda index: int(2 * chunk * key_bytes))
    forward._forward_plan.cache_clear()
    backward._backward_plan.cache_clear()
    request.addfinalizer(forward._forward_plan.cache_clear)
    request.addfinalizer(backward._backward_plan.cache_clear)
    plans = {"forward": [], "backward": []}

    def recording(name, original):
        def plan(*args, **kwargs):
            plans[name].append(original(*args, **kwargs))
            return plans[name][-1]
        return plan

    monkeypatch.setattr(forward, "_forward_plan", recording("forward", forward._forward_plan))
    monkeypatch.setattr(backward, "_backward_plan", recording("backward", backward._backward_plan))
    case = replace(BASE, b=2, h=5, h_kt=1, h_ks=5, n_q=37, n_k=40, causal=True)
    check_against_oracle(case, torch.float32, "triton", DEVICE, reduction_checks=False)
    check_against_oracle(replace(case, teacher_grad=True, window=(9, 0)), torch.float32, "triton", DEVICE,
                         reduction_checks=False)
    check_against_oracle(replace(case, direction="reverse"), torch.float32, "triton", DEVICE, reduction_checks=False)
    check_against_oracle(replace(case, causal=False), torch.float32, "triton", DEVICE, reduction_checks=False)
    orders = {(dict(meta)["LONGEST_FIRST"], grid[1], scalars[-1]) for grid, scalars, meta in plans["forward"]}
    assert orders == {(True, 1, chunk), (False, 10, 1)}  # causal: one-dimensional, chunked; not causal: unchanged
    for dk_grid, dk_scalars, dk_meta, dq_grid, dq_scalars, dq_meta, _ in plans["backward"]:
        causal = dict(dk_meta)["LONGEST_FIRST"]
        assert dict(dq_meta)["LONGEST_FIRST"] == causal and (dk_grid[1] == dq_grid[1] == 1) == causal
        assert dq_scalars[-1] == (chunk if causal else 1)
        assert 1 <= dk_scalars[-1] <= (chunk if causal else 1)  # the key pass's queries weigh more than the keys
    assert {dict(p[2])["LONGEST_FIRST"] for p in plans["backward"]} == {True, False}


@triton.jit
def _span_kernel(X, OUT, n, FINITE: tl.constexpr, SCAN: tl.constexpr):
    r = tl.program_id(0)
    first, end = _kept_span(X + r * n, 1, n, FINITE, SCAN)
    tl.store(OUT + 2 * r, first)
    tl.store(OUT + 2 * r + 1, end)


@pytest.mark.parametrize("n", [1, 16, 37, 100])
@pytest.mark.parametrize("finite", [False, True])
def test_the_kept_span_of_a_mask_or_a_row_state(n, finite):
    """``_kept_span``: the first kept position and one past the last, over several scan steps, for masks with none,
    all, right or left padding and holes (``(n, 0)`` when none is kept); with ``finite``, a row state's finite
    log-sum-exps (excluded and empty rows hold +inf)."""
    g = torch.Generator().manual_seed(n)
    kept = torch.rand(8, n, generator=g) > 0.5
    kept[0] = False
    kept[1] = True
    kept[2] = torch.arange(n) < (n * 3) // 10
    kept[3] = torch.arange(n) >= n // 2
    if finite:
        x = torch.where(kept, torch.randn(8, n, generator=g), torch.tensor(float("inf")))
    else:
        x = kept.to(torch.uint8)
    out = torch.empty(8, 2, dtype=torch.int32)
    _span_kernel[(8,)](x, out, n, FINITE=finite, SCAN=16)
    idx = torch.arange(n)
    first = torch.where(kept, idx, n).min(1).values
    end = torch.where(kept, idx + 1, 0).max(1).values
    assert out[:, 0].tolist() == first.tolist() and out[:, 1].tolist() == end.tolist()


@triton.jit
def _clip_kernel(BANDS, OUT, K: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, K) * 6
    lo, b, c, hi = _clip_band(tl.load(BANDS + i), tl.load(BANDS + i + 1), tl.load(BANDS + i + 2),
                              tl.load(BANDS + i + 3), tl.load(BANDS + i + 4), tl.load(BANDS + i + 5), BLOCK)
    o = tl.arange(0, K) * 4
    tl.store(OUT + o, lo)
    tl.store(OUT + o + 1, b)
    tl.store(OUT + o + 2, c)
    tl.store(OUT + o + 3, hi)


def test_a_clipped_band_visits_every_kept_position_once_and_only_band_tiles():
    """``_clip_band`` on random bands of ``_band``'s form (``[lo, b)`` and ``[c, hi)`` masked, ``[b, c)`` full tiles)
    and random spans, empty ones included: the three loops still visit every kept position of the band, no position
    twice, only tiles of the band, full tiles only where the band had them, each loop starting on a tile boundary;
    and a band with no tiles below its full ones (no left bound) keeps none."""
    block, k = 8, 256
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(k):
        n = int(torch.randint(1, 90, (1,), generator=g))
        lo, b, c = sorted(int(torch.randint(0, n // block + 1, (1,), generator=g)) * block for _ in range(3))
        hi = int(torch.randint(c, n + 1, (1,), generator=g)) if c <= n else c
        lo, b, c = min(lo, hi), min(b, hi), min(c, hi)  # as _band clamps them
        if torch.rand(1, generator=g) < 0.3:
            lo = b  # no tiles below the full ones
        first = int(torch.randint(0, n + 1, (1,), generator=g))
        end = int(torch.randint(first, n + 1, (1,), generator=g))
        if torch.rand(1, generator=g) < 0.15:
            first, end = n, 0  # nothing kept
        rows.append((lo, b, c, hi, first, end))
    bands = torch.tensor(rows, dtype=torch.int32)
    out = torch.empty(k, 4, dtype=torch.int32)
    _clip_kernel[(1,)](bands, out, K=k, BLOCK=block)

    def tiles(start, stop):
        return list(range(start, stop, block))

    for (lo, b, c, hi, first, end), (lo2, b2, c2, hi2) in zip(rows, out.tolist()):
        loops = [tiles(lo2, b2), tiles(b2, c2), tiles(c2, hi2)]
        visited = [t for loop in loops for t in loop]
        assert len(visited) == len(set(visited)), (lo, b, c, hi, first, end)
        band_tiles = set(tiles(lo, b) + tiles(b, c) + tiles(c, hi))
        assert set(visited) <= band_tiles and set(loops[1]) <= set(tiles(b, c))
        for p in range(max(lo, first), min(hi, end)):
            assert any(t <= p < t + block for t in visited), (p, lo, b, c, hi, first, end)
        for start, loop in ((lo2, loops[0]), (b2, loops[1]), (c2, loops[2])):
            assert not loop or start % block == 0
        if lo == b:
            assert not loops[0]


@pytest.mark.parametrize(("source", "target"), [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16),
                                                (torch.float32, torch.float32)], ids=["bf16", "fp32-to-fp16", "fp32"])
def test_scaled_copies_have_the_bits_of_torch_mul(source, target, monkeypatch):
    """The backward of a call whose gradients were computed ahead: both products in one launch, each with the bits
    ``torch.mul`` by the 0-dim factor gives on CUDA (a bf16 tensor's factor rounded to bf16, the product in fp32,
    rounded once), for tensors longer than a program's block, of different sizes, either the longer; a missing second
    tensor; a factor that overflows fp16; the dispatch's own ``torch.mul`` path (a tensor that is not contiguous)."""
    import streamkl.dispatch as dispatch
    from streamkl._triton.scaling import BLOCK, scaled_copies

    monkeypatch.setattr(dispatch, "SCALE_KERNEL_MIN_ELEMENTS", 1)  # (on a GPU too)
    g = torch.Generator().manual_seed(0)
    long = (torch.randn(3, BLOCK + 37, generator=g) * 1e-3).to(source).to(DEVICE)
    short = torch.randn(2, 5, 7, generator=g).to(source).to(DEVICE)
    small, large = torch.tensor(0.37, device=DEVICE), torch.tensor(-3e4, device=DEVICE)

    def expected(x, factor):
        if DEVICE == "cuda":
            return torch.mul(x, factor, out=torch.zeros_like(x, dtype=target))
        # torch.mul's CUDA bits, emulated (its CPU kernel takes a 0-dim factor as a host scalar)
        return (x.double() * factor.to(source).double()).float().to(target)  # (the fp32 product is exact in fp64)

    for first, first_factor, second, second_factor in ((long, small, short, large), (short, large, long, small)):
        for scale in (scaled_copies, dispatch.scaled_copies):
            a, b = scale(first, first_factor, second, second_factor, target)
            assert a.dtype == b.dtype == target
            assert torch.equal(a, expected(first, first_factor)) and torch.equal(b, expected(second, second_factor))
    alone, missing = scaled_copies(long, large, None, small, target)
    assert missing is None and torch.equal(alone, expected(long, large))
    if DEVICE == "cuda":
        strided, _ = dispatch.scaled_copies(long.t(), small, None, small, target)  # not contiguous: torch.mul
        assert torch.equal(strided, expected(long.t(), small))


@pytest.mark.parametrize("l2_mib", [50, 60])
def test_longest_first_chunks_leave_the_grid_no_long_tail(l2_mib):
    """The longest-first order's chunks, run by a GPU's block scheduler (each of 132 multiprocessors takes the next
    program as it frees: list scheduling, one program at a time), for the causal training call's grids at N = 8192
    (64 row tiles per head, a program's time its tiles plus one for its start), on an H100's L2 (50 MiB) and an
    H200's (60 MiB): from 16 heads (8 waves) up to 96 they end within 2% of the even share of the work, and for every
    head count from 1 they end within 1% of chunks of the most pairs the L2 holds, with what is left in the last
    (which took up to 18% longer: 16 heads on the H200, chunks of 15 and 1)."""
    import heapq

    from streamkl._triton_common.scheduling import L2_SHARE, key_bytes_per_head, longest_first_chunk

    def makespan(pairs, chunk):
        times = [1 + (64 - rank) for first in range(0, pairs, chunk) for rank in range(64)
                 for _ in range(min(chunk, pairs - first))]
        free = [0] * 132
        for t in times:
            heapq.heappush(free, heapq.heappop(free) + t)
        return max(free), sum(times) / 132

    key_bytes = key_bytes_per_head(8192, 1, (64, torch.bfloat16, 1), (64, torch.bfloat16, 1))
    widest = int((l2_mib << 20) * L2_SHARE) // key_bytes
    for pairs in range(1, 97):
        chunk = longest_first_chunk(key_bytes, l2_mib << 20, pairs)
        assert chunk <= widest
        end, even_share = makespan(pairs, chunk)
        assert end <= 1.01 * makespan(pairs, widest)[0], (pairs, chunk)
        if pairs >= 16:
            assert end <= 1.02 * even_share, (pairs, chunk)
