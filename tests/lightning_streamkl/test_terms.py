"""Running the loss's terms (lightning_streamkl.terms): launch-bound terms that share every option run as one
attention_kl call on their heads concatenated, and give the values, row counts and gradients of one call per term;
terms that differ in anything, or are too large, run alone. Checked the way users call it: the loss's total,
backpropagated."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

import lightning_streamkl.terms as terms
from lightning_streamkl import AttentionDistillationLoss, AttentionDistiller, uniform_pairs
from lightning_streamkl.capture import CapturedAttention
from lightning_streamkl.capture.masks import Masking, PackedSequences
from lightning_streamkl.terms import count_rows


@pytest.fixture
def op_calls(monkeypatch):
    """The number of attention_kl calls the loss makes (the op itself still runs)."""
    calls = []
    real = terms.attention_kl

    def counting(*args, **kwargs):
        calls.append(kwargs.get("reduction"))
        return real(*args, **kwargs)

    monkeypatch.setattr(terms, "attention_kl", counting)
    return calls


def _records(layers, *, b=2, h=4, h_k=2, n=9, d=8, dtype=torch.float32, seed=0, grad=False, **fields):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(layers):
        q = torch.randn(b, h, n, d, generator=g).to(dtype).requires_grad_(grad)
        k = torch.randn(b, h_k, n, d, generator=g).to(dtype).requires_grad_(grad)
        out[f"l{i}"] = CapturedAttention(q, k, **fields)
    return out


def _run(config, teacher, student, **kw):
    """The loss's output and the gradients of its total w.r.t. every student tensor."""
    student = {k: copy.copy(v) for k, v in student.items()}
    out = AttentionDistillationLoss(config)(teacher, student, **kw)
    leaves = [x for v in student.values() for x in (v.q, v.k) if x.requires_grad]
    grads = torch.autograd.grad(out.total, leaves)
    return out, grads


def _assert_same(fused, alone):
    (out_f, grads_f), (out_a, grads_a) = fused, alone
    torch.testing.assert_close(out_f.total, out_a.total)
    assert list(out_f.per_pair) == list(out_a.per_pair)
    for name in out_a.per_pair:
        torch.testing.assert_close(out_f.per_pair[name], out_a.per_pair[name])
    torch.testing.assert_close(out_f.kl_sums, out_a.kl_sums)
    torch.testing.assert_close(out_f.rows, out_a.rows)
    for gf, ga in zip(grads_f, grads_a, strict=True):
        torch.testing.assert_close(gf, ga)


CASES = {
    "plain": (dict(causal=False), {}),
    "gqa-causal-window-softcap": (dict(causal=True, window=(3, 0), softcap=20.0, scale=0.2), {}),
    "sinks": (dict(causal=True), {"sinks": True}),
    "key-padding": (dict(causal=False), {"padding": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fused_terms_equal_one_call_per_term(case, op_calls):
    fields, extra = CASES[case]
    layers, h = 3, 4
    teacher, student = _records(layers, seed=1, **fields), _records(layers, seed=2, grad=True, **fields)
    if extra.get("sinks"):
        g = torch.Generator().manual_seed(3)
        for rec in teacher.values():
            rec.sinks = torch.randn(h, generator=g)
        for rec in student.values():
            rec.sinks = torch.randn(h, generator=g).requires_grad_(True)
    kw = {}
    if extra.get("padding"):  # the batch's mask: one tensor for every layer (records without their call's masks)
        for rec in (*teacher.values(), *student.values()):
            rec.masks_from_call = False
        mask = torch.ones(2, 9, dtype=torch.bool)
        mask[1, 6:] = False
        kw = {"key_padding_mask": mask, "query_mask": mask}
    pairs = [{"teacher": f"l{i}", "student": f"l{(i + 1) % layers}", "weight": 0.5 + i} for i in range(layers)]
    fused = _run({"pairs": pairs}, teacher, student, **kw)
    assert len(op_calls) == 1 and op_calls[0] == "none"
    alone = _run({"pairs": pairs, "fuse_pairs": False}, teacher, student, **kw)
    assert len(op_calls) == 1 + layers and set(op_calls[1:]) == {"sum"}
    _assert_same(fused, alone)
    if extra.get("sinks"):  # the sinks' gradients arrive through the concatenation too
        sinks = [rec.sinks for rec in student.values()]
        grads = [torch.autograd.grad(AttentionDistillationLoss(config)(teacher, student).total, sinks)
                 for config in ({"pairs": pairs}, {"pairs": pairs, "fuse_pairs": False})]
        for fused_grad, alone_grad in zip(*grads, strict=True):
            assert fused_grad.abs().max() > 0
            torch.testing.assert_close(fused_grad, alone_grad)


def test_packed_sequences_and_relations_fuse(op_calls):
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    packed = PackedSequences(cu, cu, 5, 5)  # one object: every layer of the batch shares its offsets
    teacher = _records(2, b=1, h_k=4, seed=4, causal=True, packed=packed)
    student = _records(2, b=1, h_k=4, seed=5, grad=True, causal=True, packed=packed)
    config = {"pairs": [["l0", "l0"], ["l1", "l1"]], "relations": ["qk", "qq", "kk"], "relation_heads": 2}
    fused = _run(config, teacher, student)
    # "qk" (4 heads of 8) for both pairs is one call; "qq" and "kk" (2 relation heads of 16) share shapes and options,
    # so the four relation terms are another: two calls for six terms
    assert len(op_calls) == 2
    alone = _run({**config, "fuse_pairs": False}, teacher, student)
    assert len(op_calls) == 2 + 6
    _assert_same(fused, alone)


def test_packed_offsets_read_on_the_host_reach_the_op_there(monkeypatch):
    """Offsets the capture read (PackedSequences.from_offsets) go to the op as the CPU copies of their values, which
    it reads without a device synchronisation; the loss is the same as with the offsets on the inputs' device."""
    offsets = []
    real = terms.attention_kl

    def recording(*args, **kwargs):
        offsets.append((kwargs["cu_seqlens_q"], kwargs["cu_seqlens_k"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(terms, "attention_kl", recording)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    read = PackedSequences.from_offsets(cu, cu.clone())
    given = PackedSequences(cu, cu, 5, 5)
    losses = []
    for packed in (read, given):
        teacher = _records(1, b=1, h_k=4, seed=4, causal=True, packed=packed)
        student = _records(1, b=1, h_k=4, seed=5, grad=True, causal=True, packed=packed)
        losses.append(AttentionDistillationLoss({"pairs": [["l0", "l0"]]})(teacher, student).total)
    assert offsets[0][0] is read.host_cu_seqlens_q and offsets[0][1] is read.host_cu_seqlens_k
    assert offsets[1][0] is cu
    assert read.max_seqlen_q == 5 and torch.equal(losses[0], losses[1])


def test_terms_that_differ_run_alone(op_calls, monkeypatch):
    teacher, student = _records(4, seed=1, causal=True), _records(4, seed=2, grad=True, causal=True)
    student["l3"] = CapturedAttention(student["l3"].q[..., :4].detach().requires_grad_(True),
                                      student["l3"].k[..., :4].detach().requires_grad_(True), causal=True)
    pairs = [{"teacher": f"l{i}", "student": f"l{i}"} for i in range(4)]
    pairs[1]["temperature"] = 2.0
    pairs[2]["causal"] = False
    out = AttentionDistillationLoss({"pairs": pairs})(teacher, student)
    assert len(op_calls) == 4  # a temperature, the causality and a head dim differ: nothing shared
    pairs = [{"teacher": f"l{i}", "student": f"l{i}"} for i in range(3)]
    op_calls.clear()
    AttentionDistillationLoss({"pairs": pairs})(teacher, student)
    assert len(op_calls) == 1
    monkeypatch.setattr(terms, "FUSE_MAX_SCORES", 2 * 4 * 9 * 9 - 1)  # each term now counts as large
    op_calls.clear()
    AttentionDistillationLoss({"pairs": pairs})(teacher, student)
    assert len(op_calls) == 3
    assert torch.isfinite(out.total)


def test_fused_terms_on_the_triton_kernels_bf16(op_calls):
    """The Triton path of a fused call (per-row KL, a non-scalar upstream gradient) in bf16, under the interpreter on
    CPU, against one call per term."""
    pytest.importorskip("triton")
    from streamkl.dispatch import triton_interpreter_enabled

    if not (torch.cuda.is_available() or triton_interpreter_enabled()):
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    teacher = _records(2, b=1, h=2, h_k=1, n=20, d=16, dtype=torch.bfloat16, seed=6, causal=True)
    student = _records(2, b=1, h=2, h_k=1, n=20, d=16, dtype=torch.bfloat16, seed=7, grad=True, causal=True)
    for rec in (*teacher.values(), *student.values()):
        rec.q, rec.k = (x.detach().to(device).requires_grad_(x.requires_grad) for x in (rec.q, rec.k))
    pairs = [["l0", "l1"], ["l1", "l0"]]
    fused = _run({"pairs": pairs, "backend": "triton"}, teacher, student)
    assert op_calls == ["none"]
    alone = _run({"pairs": pairs, "backend": "triton", "fuse_pairs": False}, teacher, student)
    out_f, grads_f = fused
    out_a, grads_a = alone
    torch.testing.assert_close(out_f.total, out_a.total, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out_f.kl_sums, out_a.kl_sums, rtol=1e-5, atol=1e-5)
    for gf, ga in zip(grads_f, grads_a, strict=True):  # bf16 gradients: the same up to one rounding
        assert gf.abs().max() > 0
        torch.testing.assert_close(gf.float(), ga.float(), rtol=2e-2, atol=1e-3)


def test_a_padded_hugging_face_batch_fuses_every_pair(op_calls):
    """End to end with the callback's engine: a 4-layer BERT teacher and a 4-layer student on a padded batch read
    their masks from each layer's call; the four pairs still run as one call, with the per-pair values."""
    pytest.importorskip("transformers")
    from ._models import tiny_bert, token_batch

    teacher, student = tiny_bert(layers=4, seed=0, init=0.3), tiny_bert(layers=4, seed=1, init=0.3)
    batch = token_batch(2, 12, pad="right")
    values = {}
    for fuse in (True, False):
        op_calls.clear()
        distiller = AttentionDistiller(teacher, {"pairs": uniform_pairs(4, 4), "fuse_pairs": fuse})
        distiller.setup(student)
        student.zero_grad()
        distiller.begin_step(batch)
        with distiller.student_recording():
            student(**batch)
        out = distiller.end_step(batch)
        out.total.backward()
        values[fuse] = (out, [p.grad.clone() for p in student.parameters() if p.grad is not None], len(op_calls))
    (fused, grads_f, calls_f), (alone, grads_a, calls_a) = values[True], values[False]
    assert (calls_f, calls_a) == (1, 4)
    torch.testing.assert_close(fused.total, alone.total)
    torch.testing.assert_close(fused.rows, alone.rows)
    assert fused.rows[0] == 4 * (12 + 8)  # heads × real tokens: the padded queries are not counted
    for gf, ga in zip(grads_f, grads_a, strict=True):
        torch.testing.assert_close(gf, ga)


@pytest.mark.parametrize(("n_q", "n_k", "causal", "window"), list(itertools.product(
    [1, 5, 9], [1, 4, 9], [False, True], [None, (2, 0), (0, 3), (3, 1), (-1, 2)])))
def test_rows_counted_on_the_host_equal_the_device_count(n_q, n_k, causal, window):
    """Without padding or query masks the count is closed-form on the host; an all-True padding mask takes the
    device path, which must agree (and both must be the op's "mean" denominator)."""
    kw = dict(causal=causal, device=torch.device("cpu"), window=window)
    host = count_rows(2, 3, n_q, n_k, **kw)
    device = count_rows(2, 3, n_q, n_k, key_padding_mask=torch.ones(2, n_k, dtype=torch.bool), **kw)
    assert host.dtype == torch.float32 and host.shape == ()
    assert float(host) == float(device)
    call = terms.TermCall(*(torch.randn(2, 3, n, 4) for n in (n_q, n_k, n_q, n_k)), Masking(causal, window))
    total, rows = call.run("sum")
    assert float(rows) == float(host)  # the op counts the same rows on the host
    mean = terms.attention_kl(call.q_t, call.k_t, call.q_s, call.k_s, causal=causal, window=window)
    torch.testing.assert_close(total / host.clamp_min(1), mean)


def test_a_group_over_the_byte_budget_runs_as_several_calls(op_calls, monkeypatch):
    """The concatenated copies are kept for the backward: a group whose tensors exceed FUSE_MAX_BYTES is split into
    calls under it, in order, with the same values and gradients."""
    teacher, student = _records(5, seed=1, causal=True), _records(5, seed=2, grad=True, causal=True)
    one = terms.TermCall(teacher["l0"].q, teacher["l0"].k, student["l0"].q, student["l0"].k, Masking(True)).bytes
    monkeypatch.setattr(terms, "FUSE_MAX_BYTES", 2 * one)
    pairs = [{"teacher": f"l{i}", "student": f"l{i}", "weight": 1.0 + i} for i in range(5)]
    fused = _run({"pairs": pairs}, teacher, student)
    assert op_calls == ["none", "none", "sum"]  # 2 + 2 + 1 terms
    _assert_same(fused, _run({"pairs": pairs, "fuse_pairs": False}, teacher, student))


# ------------------------------------------------------------------------------------------ the op's row count
def _count_packed_rows(cu_q: torch.Tensor, cu_k: torch.Tensor, heads: int, *, causal: bool,
                       window: tuple[int, int] | None) -> torch.Tensor:
    """The loss's packed row count before the op returned its own (``count_packed_rows``, kept here as the
    reference): query tokens with at least one allowed key in their own sequence, times ``heads``."""
    cu_q, cu_k = cu_q.long(), cu_k.long()
    n_q, n_k = torch.diff(cu_q), torch.diff(cu_k)
    seq = torch.repeat_interleave(torch.arange(len(n_q)), n_q)
    aligned = torch.arange(int(cu_q[-1])) - cu_q[seq] + (n_k - n_q)[seq]
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    lo = (aligned - left).clamp_min(0) if left >= 0 else torch.zeros_like(aligned)
    last = n_k[seq] - 1
    hi = torch.minimum(aligned + right, last) if right >= 0 else last
    return (hi >= lo).sum().to(torch.float32) * heads


WINDOWS = [None, (2, 0), (0, 3), (3, 1), (-1, 2), (0, 0)]


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("seed", range(8))
def test_the_ops_row_count_is_count_rows_on_random_masks(seed, backend):
    """``return_count=True`` gives the rows ``count_rows`` counts from the masks (and the oracle from its
    materialised mask), exactly, for every reduction: random lengths, causality, windows, key padding, query masks
    and general masks, per head or shared."""
    if backend == "triton":
        pytest.importorskip("triton")
        from streamkl.dispatch import triton_interpreter_enabled

        if not (torch.cuda.is_available() or triton_interpreter_enabled()):
            pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(seed)
    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=g))]
    b, h, n_q, n_k = 2, 3, pick([1, 4, 7, 9]), pick([1, 5, 9])
    causal, window = pick([False, True]), pick(WINDOWS)
    kpm = pick([None, torch.rand(b, n_k, generator=g) < 0.6])
    qm = pick([None, torch.rand(b, n_q, generator=g) < 0.7])
    attn = pick([None, torch.rand(b, h, n_q, n_k, generator=g) < 0.5, torch.rand(1, 1, n_q, n_k, generator=g) < 0.5])
    q_t, q_s = (torch.randn(b, h, n_q, 8, generator=g) for _ in range(2))
    k_t, k_s = (torch.randn(b, 1, n_k, 8, generator=g) for _ in range(2))
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    q_t, q_s, k_t, k_s = (x.to(device) for x in (q_t, q_s, k_t, k_s))
    kpm, qm, attn = (None if m is None else m.to(device) for m in (kpm, qm, attn))
    masks = dict(causal=causal, window=window, key_padding_mask=kpm, query_mask=qm, attn_mask=attn)
    expected = count_rows(b, h, n_q, n_k, device=torch.device(device), **masks)
    op = terms.attention_kl  # the op, as the loss calls it
    for reduction in ("none", "sum", "mean"):
        out = op(q_t, k_t, q_s, k_s, reduction=reduction, backend=backend, return_count=True, **masks)
        assert out.rows.dtype == torch.float32 and out.rows.shape == () and out.rows.device == q_t.device
        assert float(out.rows) == float(expected), (reduction, float(out.rows), float(expected))
    from streamkl import naive_attention_kl

    naive = naive_attention_kl(q_t.double(), k_t.double(), q_s.double(), k_s.double(), reduction="sum",
                               return_count=True, **masks)
    assert float(naive.rows) == float(expected)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("seed", range(6))
def test_the_ops_row_count_is_the_packed_count(seed, backend):
    """Packed sequences (some without queries or without keys, queries longer or shorter than keys): the op's count
    is the loss's former ``count_packed_rows``, exactly, with and without causality and windows."""
    if backend == "triton":
        pytest.importorskip("triton")
        from streamkl.dispatch import triton_interpreter_enabled

        if not (torch.cuda.is_available() or triton_interpreter_enabled()):
            pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(100 + seed)
    lengths_q = torch.randint(0, 6, (3,), generator=g)
    lengths_k = torch.randint(0, 6, (3,), generator=g)
    cu_q = torch.nn.functional.pad(lengths_q.cumsum(0), (1, 0)).to(torch.int32)
    cu_k = torch.nn.functional.pad(lengths_k.cumsum(0), (1, 0)).to(torch.int32)
    total_q, total_k, heads = int(cu_q[-1]), int(cu_k[-1]), 2
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    q_t, q_s = (torch.randn(total_q, heads, 8, generator=g).to(device) for _ in range(2))
    k_t, k_s = (torch.randn(total_k, heads, 8, generator=g).to(device) for _ in range(2))
    for causal, window in itertools.product([False, True], WINDOWS):
        expected = _count_packed_rows(cu_q, cu_k, heads, causal=causal, window=window)
        out = terms.attention_kl(q_t, k_t, q_s, k_s, layout="thd", cu_seqlens_q=cu_q.to(device),
                                 cu_seqlens_k=cu_k.to(device), causal=causal, window=window, reduction="sum",
                                 backend=backend, return_count=True)
        assert float(out.rows) == float(expected), (causal, window, float(out.rows), float(expected))


def test_fused_terms_count_each_terms_rows():
    """A fused call counts the rows of all its terms; each term gets its own share, the rows one call per term
    counts."""
    teacher = _records(3, seed=1, causal=True)
    student = _records(3, seed=2, grad=True, causal=True)
    pad = torch.tensor([[True] * 9, [True] * 6 + [False] * 3])
    pairs = [{"teacher": f"l{i}", "student": f"l{i}"} for i in range(3)]
    fused, _ = _run({"pairs": pairs}, teacher, student, key_padding_mask=pad)
    alone, _ = _run({"pairs": pairs, "fuse_pairs": False}, teacher, student, key_padding_mask=pad)
    expected = count_rows(2, 4, 9, 9, causal=True, device=torch.device("cpu"), key_padding_mask=pad)
    assert fused.rows.tolist() == alone.rows.tolist() == [float(expected)] * 3
