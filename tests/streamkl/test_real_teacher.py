"""The options real teachers use, checked beyond the oracle grid: packed sequences equal separate problems,
windows equal explicit masks, non-finite values a row never sees never reach it, and every input error names
its argument. Both backends (Triton through the CPU interpreter without a GPU)."""

from __future__ import annotations

import pytest
import torch

from streamkl import AttentionKLLoss, attention_kl, naive_attention_kl
from tests._helpers import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["reference", "triton"]
NON_FINITE_WARNINGS = pytest.mark.filterwarnings(  # the interpreter's numpy warns where NaN is the point
    "ignore:invalid value encountered:RuntimeWarning", "ignore:All-NaN slice encountered:RuntimeWarning")


def _rand(*shape, dtype=torch.float32, grad=False):
    return torch.randn(*shape, dtype=torch.float64).to(DEVICE, dtype).requires_grad_(grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_rows_equal_separate_problems_and_mean_counts_all_rows(backend):
    """Each packed document is its own problem (causal bottom-right inside it): per-row KL and gradients equal
    separate dense calls, and "mean" averages over every counted row of every document."""
    lens_q, lens_k = [7, 0, 19, 12], [9, 0, 19, 15]
    h, d = 2, 16
    q_t, q_s = _rand(sum(lens_q), h, d), _rand(sum(lens_q), h, d, grad=True)
    k_t, k_s = _rand(sum(lens_k), 1, d), _rand(sum(lens_k), h, d, grad=True)
    cu_q = torch.tensor([0, 7, 7, 26, 38], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 9, 9, 28, 43], dtype=torch.int32, device=DEVICE)
    packed = attention_kl(q_t, k_t, q_s, k_s, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True,
                          window=(5, -1), reduction="none", backend=backend)
    assert packed.shape == (38, h)
    packed.sum().backward()
    grads = (q_s.grad.clone(), k_s.grad.clone())
    q_s.grad = k_s.grad = None
    rows, total = [], 0.0
    for s in range(4):
        a, b, c, e = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        parts = [x[a:b] if i % 2 == 0 else x[c:e] for i, x in enumerate((q_t, k_t, q_s, k_s))]
        one = attention_kl(*parts, layout="thd", cu_seqlens_q=cu_q.new_tensor([0, b - a]),
                           cu_seqlens_k=cu_q.new_tensor([0, e - c]), causal=True, window=(5, -1), reduction="none",
                           backend=backend)
        rows.append(one)
        total = total + one.sum()
    total.backward()
    assert_close(packed, torch.cat(rows), 1e-5, "per-row")
    assert_close(grads[0], q_s.grad, 1e-5, "dq_s")
    assert_close(grads[1], k_s.grad, 1e-5, "dk_s")
    mean = attention_kl(q_t, k_t, q_s, k_s, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True,
                        window=(5, -1), backend=backend)
    counted = sum(max(0, n) for n in lens_q) * h  # causal with N_k >= N_q: every row sees a key
    assert_close(mean, packed.sum() / counted, 1e-6, "mean")


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_sequences_with_trusted_maxima_need_no_host_read(backend):
    """With max_seqlen_q/k given the offsets are not read on the host (as flash-attn); results are identical."""
    cu = torch.tensor([0, 5, 21, 30], dtype=torch.int32, device=DEVICE)
    x = [_rand(30, 2, 8) for _ in range(4)]
    read = attention_kl(*x, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, reduction="none",
                        backend=backend)
    trusted = attention_kl(*x, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=16, max_seqlen_k=16,
                           causal=True, reduction="none", backend=backend)
    torch.testing.assert_close(read, trusted)


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_equals_explicit_key_mask_for_every_row(backend):
    """A window is a per-row key set: row by row it equals the plain op with that row's keys as padding mask."""
    n, left, right = 21, 4, 2
    x = [_rand(1, 2, n, 8, dtype=torch.float64 if backend == "reference" else torch.float32) for _ in range(4)]
    windowed = attention_kl(*x, window=(left, right), reduction="none", backend=backend)
    for i in (0, 3, 10, 20):
        kpm = torch.zeros(1, n, dtype=torch.bool, device=DEVICE)
        kpm[0, max(0, i - left): i + right + 1] = True
        row = attention_kl(*x, key_padding_mask=kpm, reduction="none", backend=backend)[..., i]
        assert_close(windowed[..., i], row, 1e-6, f"row {i}")


def test_sinks_equal_an_extra_key_column():
    """A sink is one more outcome: the same as a key whose score is the sink logit for every row (built with an
    extra key dimension that only that key and every query share)."""
    b, h, n, d = 1, 2, 9, 6
    q_t, k_t, q_s, k_s = (torch.randn(b, h, n, d, dtype=torch.float64) for _ in range(4))
    sinks_t, sinks_s = torch.randn(h, dtype=torch.float64), torch.randn(h, dtype=torch.float64)
    got = attention_kl(q_t, k_t, q_s, k_s, sinks_t=sinks_t, sinks_s=sinks_s, scale_t=1.0, scale_s=1.0,
                       reduction="none")

    def with_sink_key(q, k, sinks):
        q = torch.cat([q, torch.ones(b, h, n, 1, dtype=q.dtype)], -1)
        k = torch.cat([k, torch.zeros(b, h, n, 1, dtype=k.dtype)], -1)
        sink_key = torch.zeros(b, h, 1, d + 1, dtype=k.dtype)
        sink_key[..., -1] = sinks[None, :, None]
        return q, torch.cat([k, sink_key], 2)

    qt, kt = with_sink_key(q_t, k_t, sinks_t)
    qs, ks = with_sink_key(q_s, k_s, sinks_s)
    want = naive_attention_kl(qt, kt, qs, ks, scale_t=1.0, scale_s=1.0, reduction="none")
    assert_close(got, want, 1e-12, "kl with sinks")


def _unseen_poison_cases():
    """(name, build, seeing) triples: build(poison) returns attention_kl kwargs; ``poison`` writes NaN/inf into entries
    that no counted row may look at except those selected by ``seeing`` (a slice of the per-row output, which must
    then be non-finite); the clean run has finite values there. Every other row, and every gradient of a finite
    entry, must not change. (A row that sees a NaN has NaN gradients even where its upstream gradient is 0, as in
    IEEE arithmetic and torch's own ops: exclude such rows with ``query_mask``, as these cases do.)"""
    n, h, d = 40, 2, 16

    def dense(kwargs_fn):
        def build(poison: bool):
            g = torch.Generator().manual_seed(1)
            q_t, k_t, q_s, k_s = (torch.randn(2, h, n, d, generator=g) for _ in range(4))
            extra = kwargs_fn(q_t, k_t, q_s, k_s, poison)
            return dict(q_t=q_t, k_t=k_t, q_s=q_s, k_s=k_s, **extra)
        return build

    def padding(q_t, k_t, q_s, k_s, poison):
        kpm = torch.ones(2, n, dtype=torch.bool)
        kpm[:, 30:] = False
        kpm[1, 3] = False
        if poison:
            k_t[:, :, 30:] = float("nan")
            k_s[1, :, 3] = float("inf")
        return dict(key_padding_mask=kpm)

    def future_keys(q_t, k_t, q_s, k_s, poison):  # causal: rows < 25 never see key 25; the rest are excluded
        if poison:
            k_s[:, :, 25] = float("nan")
            k_t[:, :, 25] = float("-inf")
        qm = torch.ones(2, n, dtype=torch.bool)
        qm[:, 25:] = False
        return dict(causal=True, query_mask=qm)

    def outside_window(q_t, k_t, q_s, k_s, poison):  # window (3, 0): rows >= 4 never see key 0; rows < 4 excluded
        if poison:
            k_t[:, :, 0] = float("nan")
            k_s[:, :, 0] = float("inf")
        qm = torch.ones(2, n, dtype=torch.bool)
        qm[:, :4] = False
        return dict(causal=True, window=(3, 0), query_mask=qm)

    def excluded_rows(q_t, k_t, q_s, k_s, poison):
        qm = torch.ones(2, n, dtype=torch.bool)
        qm[0, 7] = qm[1, 30] = False
        if poison:
            q_s[0, :, 7] = float("nan")
            q_t[1, :, 30] = float("inf")
        return dict(query_mask=qm)

    def other_document(poison: bool):
        g = torch.Generator().manual_seed(2)
        q_t, k_t, q_s, k_s = (torch.randn(n, h, d, generator=g) for _ in range(4))
        if poison:  # the third document is all NaN keys/queries; the first two must not notice
            for x in (q_t, k_t, q_s, k_s):
                x[31:] = float("nan")
        cu = torch.tensor([0, 12, 31, 40], dtype=torch.int32)
        return dict(q_t=q_t, k_t=k_t, q_s=q_s, k_s=k_s, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)

    nothing = (slice(0, 0),)
    return [("padding", dense(padding), nothing), ("future_keys", dense(future_keys), nothing),
            ("outside_window", dense(outside_window), nothing),
            ("excluded_rows", dense(excluded_rows), nothing), ("other_document", other_document, (slice(31, None),))]


@NON_FINITE_WARNINGS
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("name", "build", "seeing"), _unseen_poison_cases(), ids=[c[0] for c in _unseen_poison_cases()])
def test_non_finite_values_a_row_never_sees_do_not_leak(backend, name, build, seeing):
    results = []
    for poison in (False, True):
        kw = build(poison)
        tensors = {k: kw.pop(k).to(DEVICE).requires_grad_(True) for k in ("q_t", "k_t", "q_s", "k_s")}
        kw = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        out = attention_kl(**tensors, **kw, reduction="none", backend=backend)
        poisoned_rows = ~torch.isfinite(out.detach())  # the poisoned document's own rows may be NaN
        out.masked_fill(poisoned_rows, 0.0).sum().backward()
        results.append((out.detach(), {k: v.grad for k, v in tensors.items()}, tensors))
    (clean, clean_grads, _clean_inputs), (dirty, dirty_grads, dirty_inputs) = results
    keep_rows = torch.ones_like(clean, dtype=torch.bool)
    keep_rows[seeing] = False
    assert not torch.isfinite(dirty[~keep_rows]).any(), "rows that see a non-finite entry show it"
    torch.testing.assert_close(dirty[keep_rows], clean[keep_rows])
    for key in clean_grads:
        finite_input = torch.isfinite(dirty_inputs[key].detach())
        torch.testing.assert_close(dirty_grads[key][finite_input], clean_grads[key][finite_input],
                                   msg=f"d{key} of an allowed entry changed ({name})")


@NON_FINITE_WARNINGS
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_an_allowed_key_reaches_the_rows_that_see_it_and_their_gradients(backend):
    q_t, k_t, q_s, k_s = (_rand(1, 1, 20, 16) for _ in range(4))
    q_s.requires_grad_(True)
    with torch.no_grad():
        k_s[0, 0, 12] = float("nan")
    out = attention_kl(q_t, k_t, q_s, k_s, causal=True, reduction="none", backend=backend)
    assert torch.isnan(out[0, 0, 12:]).all() and torch.isfinite(out[0, 0, :12]).all()
    out.sum().backward()
    assert torch.isnan(q_s.grad[0, 0, 12:]).all(), "a NaN loss must not come with finite gradients"
    assert torch.isfinite(q_s.grad[0, 0, :12]).all()


def _thd(n=12, h=2, d=8):
    return [torch.randn(n, h, d) for _ in range(4)]


CU = torch.tensor([0, 5, 12], dtype=torch.int32)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(window=(3,)), TypeError, r"`window` to be None or a pair of ints \(left, right\).*but got \(3,\)"),
        (dict(window=(2.0, 1)), TypeError, r"`window` to be None or a pair of ints"),
        (dict(window=(True, 1)), TypeError, r"`window` to be None or a pair of ints"),
        (dict(window=(-2, 0)), ValueError, r"`window` to be a pair of ints \(left, right\), each >= -1 .* but got \(-2, 0\)"),
        (dict(softcap_t=0.0), ValueError, r"`softcap_t` to be None \(no capping\) or a finite float > 0, but got 0.0"),
        (dict(softcap_s=-3), ValueError, r"`softcap_s` to be None \(no capping\) or a finite float > 0, but got -3"),
        (dict(softcap_s=float("inf")), ValueError, r"`softcap_s` .* but got inf"),
        (dict(softcap_t="30"), TypeError, r"`softcap_t` to be None or a Python float, but got str"),
        (dict(sinks_t=torch.zeros(4)), ValueError, r"Got `sinks_t` but `sinks_s` is None: a sink is an extra outcome"),
        (dict(sinks_s=torch.zeros(4)), ValueError, r"Got `sinks_s` but `sinks_t` is None"),
        (dict(sinks_t=torch.zeros(3), sinks_s=torch.zeros(4)), ValueError, r"`sinks_t` to have shape \(H,\) = \(4,\).* but got \(3,\)"),
        (dict(sinks_t=torch.zeros(4), sinks_s=torch.zeros(1, 4)), ValueError, r"`sinks_s` to have shape \(H,\) = \(4,\)"),
        (dict(sinks_t=torch.zeros(4, dtype=torch.long), sinks_s=torch.zeros(4)), TypeError, r"`sinks_t` to have a floating dtype"),
        (dict(sinks_t=[0.0] * 4, sinks_s=torch.zeros(4)), TypeError, r"`sinks_t` to be None or a torch.Tensor, but got list"),
        (dict(cu_seqlens_q=CU), ValueError, r"Got `cu_seqlens_q` with layout='bhnd'"),
        (dict(attn_mask=torch.ones(2, 4, 8, 8)), TypeError, r"`attn_mask` to have dtype torch.bool .* but got torch.float32"),
        (dict(attn_mask=torch.ones(2, 3, 8, 8, dtype=torch.bool)), ValueError, r"`attn_mask` to have shape \(B or 1, H or 1, N_q, N_k\) = \(2 or 1, 4 or 1, 8, 8\), but got \(2, 3, 8, 8\)"),
        (dict(attn_mask=torch.ones(8, 8, dtype=torch.bool)), ValueError, r"`attn_mask` to have shape"),
        (dict(max_seqlen_k=4), ValueError, r"Got `max_seqlen_k` with layout='bhnd'"),
    ],
    ids=lambda v: str(v)[:40] if isinstance(v, dict) else "",
)
def test_option_errors_name_the_argument(kwargs, error, match):
    x = [torch.randn(2, 4, 8, 16) for _ in range(4)]
    with pytest.raises(error, match=match):
        attention_kl(*x, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(), ValueError, r"Expected `cu_seqlens_q` and `cu_seqlens_k` .* with layout='thd', but got cu_seqlens_q=NoneType"),
        (dict(cu_seqlens_q=CU.long(), cu_seqlens_k=CU), TypeError, r"`cu_seqlens_q` to have dtype torch.int32, but got torch.int64"),
        (dict(cu_seqlens_q=CU, cu_seqlens_k=CU.tolist()), TypeError, r"`cu_seqlens_k` to be a torch.Tensor .* but got list"),
        (dict(cu_seqlens_q=CU[:1], cu_seqlens_k=CU), ValueError, r"`cu_seqlens_q` to be a 1-D tensor \[num_seqs \+ 1\] with num_seqs >= 1, but got shape \(1,\)"),
        (dict(cu_seqlens_q=torch.tensor([0, 7, 5, 12], dtype=torch.int32), cu_seqlens_k=torch.tensor([0, 7, 5, 12], dtype=torch.int32)),
         ValueError, r"`cu_seqlens_q` to be non-decreasing offsets starting at 0 and ending at the total number of tokens \(12\), but got \[0, 7, 5, 12\]"),
        (dict(cu_seqlens_q=torch.tensor([0, 5, 11], dtype=torch.int32), cu_seqlens_k=CU), ValueError, r"ending at the total number of tokens \(12\), but got \[0, 5, 11\]"),
        (dict(cu_seqlens_q=torch.tensor([1, 5, 12], dtype=torch.int32), cu_seqlens_k=CU), ValueError, r"starting at 0"),
        (dict(cu_seqlens_q=CU, cu_seqlens_k=torch.tensor([0, 12], dtype=torch.int32)), ValueError, r"the same number of sequences, but got 2 and 1"),
        (dict(cu_seqlens_q=CU, cu_seqlens_k=CU, max_seqlen_q=4), ValueError, r"`max_seqlen_q` to be at least the longest sequence \(7\), but got 4"),
        (dict(cu_seqlens_q=CU, cu_seqlens_k=CU, max_seqlen_q=-1, max_seqlen_k=7), TypeError, r"`max_seqlen_q` to be None or an int >= 0, but got -1"),
        (dict(cu_seqlens_q=CU, cu_seqlens_k=CU.to("meta")), ValueError, r"`cu_seqlens_k` to be on cpu like q_t, or on the CPU, but got meta"),
        (dict(cu_seqlens_q=CU, cu_seqlens_k=CU, key_padding_mask=torch.ones(1, 12, dtype=torch.bool)), ValueError,
         r"Got `key_padding_mask` with layout='thd': packed sequences carry no padding"),
        (dict(cu_seqlens_q=CU, cu_seqlens_k=CU, query_mask=torch.ones(1, 12, dtype=torch.bool)), ValueError, r"Got `query_mask` with layout='thd'"),
        (dict(cu_seqlens_q=CU, cu_seqlens_k=CU, attn_mask=torch.ones(1, 1, 12, 12, dtype=torch.bool)), ValueError, r"Got `attn_mask` with layout='thd'"),
    ],
    ids=["missing", "int64", "list", "short", "decreasing", "last", "first", "count", "max-too-small", "max-negative",
         "device", "kpm", "qmask", "attn-mask"],
)
def test_packed_errors_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        attention_kl(*_thd(), layout="thd", **kwargs)


def test_packed_inputs_must_be_3d():
    x = [torch.randn(1, 12, 2, 8)] + _thd()[1:]
    with pytest.raises(ValueError, match=r"`q_t` to be a 3-D tensor \(layout 'thd'\), but got shape \(1, 12, 2, 8\)"):
        attention_kl(*x, layout="thd", cu_seqlens_q=CU, cu_seqlens_k=CU)


def test_module_takes_the_new_options_and_per_batch_tensors():
    loss_fn = AttentionKLLoss(causal=True, window=(3, 0), softcap_t=20.0, layout="thd")
    assert "window=(3, 0)" in repr(loss_fn) and "softcap_t=20.0" in repr(loss_fn)
    x = _thd()
    got = loss_fn(*x, cu_seqlens_q=CU, cu_seqlens_k=CU, sinks_t=torch.zeros(2), sinks_s=torch.ones(2))
    want = attention_kl(*x, causal=True, window=(3, 0), softcap_t=20.0, layout="thd", cu_seqlens_q=CU,
                        cu_seqlens_k=CU, sinks_t=torch.zeros(2), sinks_s=torch.ones(2))
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="`window`"):
        AttentionKLLoss(window=(-5, 0))


def test_the_guide_examples_run():
    """docs/guides/real-teachers.md: its code blocks, run in order, on the CPU."""
    import re
    from pathlib import Path

    guide = Path(__file__).resolve().parents[2] / "docs" / "guides" / "real-teachers.md"
    blocks = re.findall(r"```python\n(.*?)```", guide.read_text(), flags=re.S)
    assert len(blocks) >= 2
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(guide), "exec"), namespace)
    assert namespace["student_sinks"].grad is not None and namespace["q_s"].grad is not None
