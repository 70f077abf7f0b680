"""A right-padded batch as one dense call per batch row, and packed sequences as one per sequence
(:mod:`streamkl._pieces`), against the same call with its masks or offsets read by the kernels. On a GPU the masks and
offsets of a large call are read on the host (:func:`streamkl.dispatch.read_masks`,
:func:`streamkl.dispatch.read_offsets`); here the gates are opened for small CPU problems, and the calls run on the
reference backend and, through the interpreter, on the portable Triton kernels."""

from __future__ import annotations

import pytest
import torch

import streamkl.api
from streamkl import attention_kl, dispatch
from tests._helpers import assert_close
from tests.streamkl.oracle import TOLERANCES


@pytest.fixture
def reads_every_mask(monkeypatch):
    """Read the masks of every call (the GPU reads those of large CUDA calls), and count the split calls."""
    monkeypatch.setattr(dispatch, "_reads_masks",
                        lambda problem: problem.key_padding_mask is not None or problem.query_mask is not None)
    monkeypatch.setattr(dispatch, "_pieces_pay", lambda heads, pieces: True)
    return recorded_splits(monkeypatch, lambda p: p.sizes)


def recorded_splits(monkeypatch, describe) -> list:
    """Every split call from now on, as the tuple of ``describe(piece)`` of its pieces (the op itself still runs)."""
    splits = []
    whole = streamkl.api.attention_kl_pieces

    def counted(problem, pieces, *args):
        splits.append(tuple(describe(p) for p in pieces))
        return whole(problem, pieces, *args)

    monkeypatch.setattr(streamkl.api, "attention_kl_pieces", counted)
    return splits


def prefix(lengths, n):
    return torch.arange(n) < torch.tensor(lengths)[:, None]


def call(inputs, grads, **kw):
    """The op's result (and count, with ``return_count``) and the gradients of ``inputs[i]`` for ``i`` in ``grads``,
    under a real upstream gradient (a random one per row for ``reduction="none"``)."""
    out = attention_kl(*inputs, **kw)
    kl = out[0] if kw.get("return_count") else out
    upstream = torch.randn(kl.shape, generator=torch.Generator().manual_seed(1), dtype=kl.dtype)
    got = torch.autograd.grad(kl, [inputs[i] for i in grads], upstream)
    return (*(out if kw.get("return_count") else (out,)), *got)


def make(batch=3, heads=4, key_heads=2, n_q=12, n_k=12, d_t=16, d_s=8, dtype=torch.float64, teacher_grad=False,
         seed=0):
    g = torch.Generator().manual_seed(seed)
    q_t = torch.randn(batch, heads, n_q, d_t, generator=g, dtype=dtype)
    k_t = torch.randn(batch, key_heads, n_k, d_t, generator=g, dtype=dtype)
    q_s = torch.randn(batch, heads, n_q, d_s, generator=g, dtype=dtype)
    k_s = torch.randn(batch, 1, n_k, d_s, generator=g, dtype=dtype)
    for x in (q_s, k_s, *((q_t, k_t) if teacher_grad else ())):
        x.requires_grad_(True)
    return q_t, k_t, q_s, k_s


def compare(monkeypatch, splits, inputs, grads, expect_split: bool, rtol=1e-10, gate="_reads_masks", **kw):
    """The call split where ``splits`` says (one more entry, or none), against the call whose ``gate`` is closed."""
    split = call(inputs, grads, **kw)
    assert len(splits) == int(expect_split)
    monkeypatch.setattr(dispatch, gate, lambda problem: False)
    masked = call(inputs, grads, **kw)
    assert len(splits) == int(expect_split)
    for i, (got, want) in enumerate(zip(split, masked)):
        assert_close(got, want, rtol, f"output {i}")
    return split


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("causal", [True, False])
def test_the_same_prefix_of_queries_and_keys_gives_the_masked_call(reads_every_mask, monkeypatch, reduction, causal):
    """The Hugging Face batch: one mask for queries and keys, a full row, a short one and an empty one; loss,
    gradients of both sides (a teacher that trains too) and the count of rows are the masked call's, and the padded
    rows and keys get exactly zero gradient."""
    inputs = make(teacher_grad=True)
    mask = prefix([12, 5, 0], 12)
    out = compare(monkeypatch, reads_every_mask, inputs, (0, 1, 2, 3), True, causal=causal, reduction=reduction,
                  key_padding_mask=mask, query_mask=mask, return_count=True)
    assert reads_every_mask[0] == ((12, 12), (5, 5))
    assert float(out[1]) == 4 * (12 + 5)
    for grad in out[2:]:
        assert not grad[1, :, 5:].any() and not grad[2].any()


def test_keys_padded_without_a_query_mask_split_only_without_a_causal_mask(reads_every_mask, monkeypatch):
    """Without a query mask the padded rows are rows: with all keys visible they see the real keys, and the call
    splits (every query, the real keys); causal, a padded row sees the real keys before it, and the call keeps its
    mask."""
    inputs = make()
    mask = prefix([12, 7, 3], 12)
    compare(monkeypatch, reads_every_mask, inputs, (2, 3), True, key_padding_mask=mask)
    assert reads_every_mask[0] == ((12, 12), (12, 7), (12, 3))
    reads_every_mask.clear()
    monkeypatch.setattr(dispatch, "_reads_masks", lambda problem: True)
    compare(monkeypatch, reads_every_mask, inputs, (2, 3), False, causal=True, key_padding_mask=mask)


def test_different_prefixes_for_queries_and_keys(reads_every_mask, monkeypatch):
    """Not causal, each side its own prefix (a query mask that keeps fewer rows than the keys it sees)."""
    inputs = make(n_q=10, n_k=14)
    compare(monkeypatch, reads_every_mask, inputs, (2, 3), True, reduction="mean",
            key_padding_mask=prefix([14, 9, 4], 14), query_mask=prefix([10, 3, 6], 10))
    assert reads_every_mask[0] == ((10, 14), (3, 9), (6, 4))


def test_causal_with_more_keys_than_queries_keeps_the_alignment(reads_every_mask, monkeypatch):
    """Queries aligned to the last key (a cache of 4 keys before 8 queries): each piece keeps the keys its rows see,
    and the alignment, so the call is the masked one."""
    inputs = make(n_q=8, n_k=12)
    compare(monkeypatch, reads_every_mask, inputs, (2, 3), True, causal=True, reduction="sum",
            key_padding_mask=prefix([12, 9, 12], 12), query_mask=prefix([8, 5, 2], 8))
    assert reads_every_mask[0] == ((8, 12), (5, 9), (2, 6))


def test_options_that_change_the_distributions(reads_every_mask, monkeypatch):
    """Reverse direction, a temperature, soft-caps, sinks that train and a sliding window: the same as masked."""
    inputs = make()
    sinks_t, sinks_s = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64, requires_grad=True)
    mask = prefix([12, 8, 6], 12)
    compare(monkeypatch, reads_every_mask, inputs, (2, 3), True, causal=True, window=(3, 0),
            direction="reverse", temperature=2.0, softcap_t=5.0, sinks_t=sinks_t, sinks_s=sinks_s,
            key_padding_mask=mask, query_mask=mask)
    split = torch.autograd.grad(attention_kl(*inputs, sinks_t=sinks_t, sinks_s=sinks_s, key_padding_mask=mask,
                                             query_mask=mask), sinks_s)[0]
    monkeypatch.setattr(dispatch, "_reads_masks", lambda problem: False)
    masked = torch.autograd.grad(attention_kl(*inputs, sinks_t=sinks_t, sinks_s=sinks_s, key_padding_mask=mask,
                                              query_mask=mask), sinks_s)[0]
    assert_close(split, masked, 1e-10, "dsinks_s")


@pytest.mark.parametrize("mask", [
    prefix([12, 7, 3], 12).flip(1),                     # left padding
    torch.tensor([[True] * 6 + [False, True] * 3] * 3),  # holes
])
def test_masks_that_keep_no_prefix_are_read_by_the_kernels(reads_every_mask, monkeypatch, mask):
    inputs = make()
    compare(monkeypatch, reads_every_mask, inputs, (2, 3), False, key_padding_mask=mask, query_mask=mask)


def test_masks_that_keep_everything_are_dropped_and_nothing_splits(reads_every_mask, monkeypatch):
    everything = torch.ones(3, 12, dtype=torch.bool)
    problem, pieces = dispatch.read_masks(_problem(make(), key_padding_mask=everything, query_mask=everything))
    assert problem.key_padding_mask is None and problem.query_mask is None and pieces is None


def test_a_batch_with_no_counted_row_keeps_its_masks(reads_every_mask):
    mask = prefix([0, 0, 0], 12)
    problem, pieces = dispatch.read_masks(_problem(make(), key_padding_mask=mask, query_mask=mask))
    assert pieces is None and problem.key_padding_mask is not None


def test_masks_given_on_the_cpu_are_read_on_the_host(reads_every_mask):
    """Masks the host holds (on the CPU for inputs on a GPU) are kept beside their device copies, and the read takes
    those: the lengths, the prefixes and the all-True check (on a GPU: no synchronisation; a test on the device
    checks that)."""
    from dataclasses import replace

    lengths = [12, 7, 3]
    mask = prefix(lengths, 12)
    problem = _problem(make(), key_padding_mask=mask, query_mask=mask)
    assert problem.host_masks is None  # inputs on the CPU: the masks are the inputs' own
    unreadable = replace(problem, key_padding_mask=mask.to("meta"), query_mask=mask.to("meta"),
                         host_masks={"key_padding_mask": mask, "query_mask": mask})
    problem, pieces = dispatch.read_masks(unreadable)
    assert [p.sizes for p in pieces] == [(n, n) for n in lengths]
    assert problem.key_padding_mask is None and problem.host_masks is None
    everything = torch.ones(3, 12, dtype=torch.bool)
    problem, pieces = dispatch.read_masks(replace(unreadable, host_masks={"key_padding_mask": everything,
                                                                          "query_mask": everything}))
    assert pieces is None and problem.key_padding_mask is None and problem.query_mask is None
    # one mask on the host and the other on the device: both are read on the device
    problem, pieces = dispatch.read_masks(replace(unreadable, key_padding_mask=mask, query_mask=mask,
                                                  host_masks={"query_mask": mask.to("meta")}))
    assert [p.sizes for p in pieces] == [(n, n) for n in lengths]


def _problem(inputs, **kw):
    from streamkl._validation import prepare_problem
    from streamkl.options import AttentionKLOptions

    return prepare_problem(*inputs, AttentionKLOptions(**kw))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_on_the_portable_kernels_under_autocast(reads_every_mask, monkeypatch, reduction):
    """The way a mixed-precision training step calls it: fp32 tensors under bf16 autocast, the Triton backend (the
    interpreter here), a real upstream gradient; bf16 gradients, rounded after a different scaling, within the
    suite's bf16 tolerance. The reduced loss computes its gradients ahead, all pieces in one autograd node."""
    inputs = make(dtype=torch.float32, n_q=20, n_k=20)
    mask = prefix([20, 13, 1], 20)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = attention_kl(*inputs, backend="triton", causal=True, reduction=reduction, key_padding_mask=mask,
                            query_mask=mask)
        node = type(loss.grad_fn).__name__
        assert (node == "_PiecesAheadBackward") == (reduction == "mean"), node
        reads_every_mask.clear()
        compare(monkeypatch, reads_every_mask, inputs, (2, 3), True, rtol=TOLERANCES[torch.bfloat16][1],
                backend="triton", causal=True,
                reduction=reduction, key_padding_mask=mask, query_mask=mask)


def test_pieces_split_only_where_they_are_large_on_average(monkeypatch):
    """Each piece is a call with its own host time: a batch of many short rows keeps its masks."""
    monkeypatch.setattr(dispatch, "_reads_masks", lambda problem: True)
    monkeypatch.setattr(dispatch, "GLUON_MIN_SCORES", 4 * 10 * 10)  # heads · rows · keys
    mask = prefix([12, 12, 11], 12)
    assert dispatch.read_masks(_problem(make(), key_padding_mask=mask, query_mask=mask))[1] is not None
    mask = prefix([12, 2, 2], 12)
    assert dispatch.read_masks(_problem(make(), key_padding_mask=mask, query_mask=mask))[1] is None


# ---------------------------------------------------------------------------------------------- packed sequences
@pytest.fixture
def reads_every_offset(monkeypatch):
    """Read the offsets of every packed call (the GPU reads those of large CUDA calls whose largest sequence takes a
    Gluon kernel), and count the split calls."""
    monkeypatch.setattr(dispatch, "_reads_offsets", lambda problem: problem.packed)
    monkeypatch.setattr(dispatch, "_largest_takes_gluon", lambda problem, pieces: True)
    monkeypatch.setattr(dispatch, "_pieces_pay", lambda heads, pieces: True)
    return recorded_splits(monkeypatch, lambda p: (p.q_start, p.n_q, p.k_start, p.n_k))


def make_packed(offsets_q, offsets_k=None, heads=4, key_heads=2, d_t=16, d_s=8, dtype=torch.float64,
                teacher_grad=False, seed=0):
    """Packed inputs ``[total, H, D]`` and the options that describe their sequences."""
    offsets_k = offsets_q if offsets_k is None else offsets_k
    g = torch.Generator().manual_seed(seed)
    q_t = torch.randn(offsets_q[-1], heads, d_t, generator=g, dtype=dtype)
    k_t = torch.randn(offsets_k[-1], key_heads, d_t, generator=g, dtype=dtype)
    q_s = torch.randn(offsets_q[-1], heads, d_s, generator=g, dtype=dtype)
    k_s = torch.randn(offsets_k[-1], 1, d_s, generator=g, dtype=dtype)
    for x in (q_s, k_s, *((q_t, k_t) if teacher_grad else ())):
        x.requires_grad_(True)
    cu = {"cu_seqlens_q": torch.tensor(offsets_q, dtype=torch.int32),
          "cu_seqlens_k": torch.tensor(offsets_k, dtype=torch.int32)}
    return (q_t, k_t, q_s, k_s), {"layout": "thd", **cu}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("causal", [True, False])
def test_packed_sequences_give_the_packed_call(reads_every_offset, monkeypatch, reduction, causal):
    """Four sequences, one of them empty: loss, gradients of both sides (a teacher that trains too) and the count of
    rows are the packed call's; each sequence with rows is a piece on its own tokens."""
    inputs, packing = make_packed([0, 5, 5, 14, 17], teacher_grad=True)
    out = compare(monkeypatch, reads_every_offset, inputs, (0, 1, 2, 3), True, gate="_reads_offsets",
                  causal=causal, reduction=reduction, return_count=True, **packing)
    assert reads_every_offset[0] == ((0, 5, 0, 5), (5, 9, 5, 9), (14, 3, 14, 3))
    assert float(out[1]) == 4 * 17
    if reduction == "none":
        assert out[0].shape == (17, 4)


def test_packed_sequences_with_options_that_change_the_distributions(reads_every_offset, monkeypatch):
    """Reverse direction, a temperature, soft-caps, sinks that train and a sliding window: the same as packed."""
    inputs, packing = make_packed([0, 7, 16, 20])
    sinks = {"sinks_t": torch.randn(4, dtype=torch.float64),
             "sinks_s": torch.randn(4, dtype=torch.float64, requires_grad=True)}
    compare(monkeypatch, reads_every_offset, inputs, (2, 3), True, gate="_reads_offsets", causal=True,
            window=(3, 0), direction="reverse", temperature=2.0, softcap_t=5.0, **sinks, **packing)
    split = torch.autograd.grad(attention_kl(*inputs, **sinks, **packing), sinks["sinks_s"])[0]
    monkeypatch.setattr(dispatch, "_reads_offsets", lambda problem: False)
    packed = torch.autograd.grad(attention_kl(*inputs, **sinks, **packing), sinks["sinks_s"])[0]
    assert_close(split, packed, 1e-10, "dsinks_s")


def test_packed_sequences_with_more_keys_than_queries_keep_the_alignment(reads_every_offset, monkeypatch):
    """Each sequence's queries aligned to its last key (a cache before them): each piece keeps its keys."""
    inputs, packing = make_packed([0, 4, 10], [0, 7, 15])
    compare(monkeypatch, reads_every_offset, inputs, (2, 3), True, gate="_reads_offsets", causal=True,
            reduction="mean", **packing)
    assert reads_every_offset[0] == ((0, 4, 0, 7), (4, 6, 7, 8))


def test_a_sequence_with_rows_and_no_key_keeps_the_packed_layout(reads_every_offset, monkeypatch):
    """Its rows count for nothing, which the count of a mean would need the device for: no split."""
    inputs, packing = make_packed([0, 4, 10], [0, 7, 7])
    compare(monkeypatch, reads_every_offset, inputs, (2, 3), False, gate="_reads_offsets", reduction="mean",
            **packing)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_packed_sequences_on_the_portable_kernels_under_autocast(reads_every_offset, monkeypatch, reduction):
    """A mixed-precision training step: fp32 tensors under bf16 autocast, the Triton backend (the interpreter here),
    a real upstream gradient, within the suite's bf16 tolerance. The reduced loss computes its gradients ahead, all
    pieces in one autograd node."""
    inputs, packing = make_packed([0, 20, 33, 34], dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = attention_kl(*inputs, backend="triton", causal=True, reduction=reduction, **packing)
        node = type(loss.grad_fn).__name__
        assert (node == "_PiecesAheadBackward") == (reduction == "mean"), node
        reads_every_offset.clear()
        compare(monkeypatch, reads_every_offset, inputs, (2, 3), True, rtol=TOLERANCES[torch.bfloat16][1],
                gate="_reads_offsets", backend="triton", causal=True, reduction=reduction, **packing)


def test_packed_sequences_split_only_where_the_largest_takes_a_gluon_kernel(monkeypatch):
    """Packed sequences already run on kernels that skip what no sequence sees: splitting them pays only where the
    dense pieces take the Gluon kernels, which a CPU tensor never does, and the packed call does not."""
    monkeypatch.setattr(dispatch, "_reads_offsets", lambda problem: problem.packed)
    monkeypatch.setattr(dispatch, "_pieces_pay", lambda heads, pieces: True)
    inputs, packing = make_packed([0, 5, 14])
    assert dispatch.read_offsets(_problem(inputs, **packing)) is None
    monkeypatch.setattr(dispatch, "_largest_takes_gluon", lambda problem, pieces: True)
    assert [p.sizes for p in dispatch.read_offsets(_problem(inputs, **packing))] == [(5, 5), (9, 9)]
    # where the packed call itself takes the Gluon training kernels (one launch over every sequence), nothing is read
    monkeypatch.setattr(dispatch, "_forward_takes_gluon", lambda inputs, spec: True)
    assert dispatch.read_offsets(_problem(inputs, **packing)) is None


def test_offsets_given_on_the_cpu_are_read_on_the_host(monkeypatch):
    """Offsets the host holds are kept as values when the problem is made, and the split reads those, not the
    tensors (on a GPU: no synchronisation; a test on the device checks that)."""
    from dataclasses import replace

    monkeypatch.setattr(dispatch, "_reads_offsets", lambda problem: problem.packed)
    monkeypatch.setattr(dispatch, "_pieces_pay", lambda heads, pieces: True)
    monkeypatch.setattr(dispatch, "_largest_takes_gluon", lambda problem, pieces: True)
    inputs, packing = make_packed([0, 5, 14], [0, 6, 16])
    problem = _problem(inputs, **packing)
    assert problem.host_offsets == ([0, 5, 14], [0, 6, 16])
    unreadable = replace(problem, cu_seqlens_q=problem.cu_seqlens_q.to("meta"),
                         cu_seqlens_k=problem.cu_seqlens_k.to("meta"))
    assert [p.sizes for p in dispatch.read_offsets(unreadable)] == [(5, 6), (9, 10)]


def test_offsets_on_the_gpu_are_read_only_where_the_sequences_can_be_large_on_average(monkeypatch):
    """Reading offsets that are on the GPU costs a synchronisation: only where heads x tokens x the longest sequence,
    over the number of sequences (known without reading them), reaches the size at which pieces pay."""
    monkeypatch.setattr(dispatch, "GLUON_MIN_SCORES", 4 * 10 * 10)  # heads · rows · keys
    inputs, packing = make_packed([0, 10, 20])  # 4 heads, 20 tokens, longest 10, 2 sequences: 4·20·10/2 = 400
    assert dispatch._sequences_could_pay(_problem(inputs, **packing, max_seqlen_q=10, max_seqlen_k=10))
    inputs, packing = make_packed([0, 10, 12, 14, 16, 18, 20])  # 4·20·10/6 < 400, whatever the lengths are
    assert not dispatch._sequences_could_pay(_problem(inputs, **packing, max_seqlen_q=10, max_seqlen_k=10))


@pytest.mark.parametrize("causal", [True, False])
def test_a_masked_batch_whose_call_takes_the_gluon_kernels_keeps_its_masks_with_their_lengths(
        reads_every_mask, monkeypatch, causal):
    """Where the masked call's forward takes a Gluon training kernel (which runs a masked batch in one launch,
    reading each row's lengths), the masks are kept, with each batch row's lengths (:func:`padded_lengths`, computed
    where the masks are, without reading them on the host): a right-padded row's prefixes (a causal row's keys cut at
    its rows, as its piece's) and 0, a row whose masks keep no prefixes (left padding, a hole) all its tokens and 1;
    the call is not split. Kernels that read the masks (the portable ones here, on the CPU) give the masked call's
    loss and gradients, bitwise."""
    inputs = make(batch=6, n_q=12, n_k=12)
    rows = prefix([12, 7, 1, 0, 12, 12], 12)
    keys = prefix([12, 9, 3, 0, 12, 12], 12)
    rows[4, :5] = False  # left padding
    keys[4, :5] = False
    keys[5, 3] = False  # a hole
    masks = {"key_padding_mask": keys, "query_mask": rows}
    problem, pieces = dispatch.read_masks(_problem(inputs, causal=causal, **masks))
    assert pieces is None and problem.lengths is None  # a CPU call takes no Gluon kernel, and no prefixes: masked
    expected = [[12, 7, 1, 0, 12, 12], [12, 7, 1, 0, 12, 12] if causal else [12, 9, 3, 0, 12, 12],
                [0, 0, 0, 0, 1, 1]]
    monkeypatch.setattr(dispatch, "_forward_takes_gluon", lambda inputs, spec: inputs.lengths is not None)
    problem, pieces = dispatch.read_masks(_problem(inputs, causal=causal, **masks))
    assert pieces is None
    assert problem.key_padding_mask is keys and problem.query_mask is rows
    assert problem.lengths.dtype == torch.int32 and problem.lengths.tolist() == expected
    assert problem.kernel_problem()[0].lengths is problem.lengths
    with_lengths = call(inputs, (2, 3), causal=causal, reduction="mean", **masks)
    assert reads_every_mask == []
    monkeypatch.setattr(dispatch, "_reads_masks", lambda problem: False)
    masked = call(inputs, (2, 3), causal=causal, reduction="mean", **masks)
    for got, want in zip(with_lengths, masked):
        assert torch.equal(got, want)


def test_the_lengths_of_a_causal_row_that_drops_keys_its_rows_see_read_its_masks():
    """A causal right-padded row whose key mask keeps fewer keys than its kept rows' diagonals reach is no dense
    problem (its last rows would see keys it drops): the kernels read its masks, over all its tokens."""
    from streamkl._pieces import padded_lengths

    inputs = make(batch=2, n_q=8, n_k=8)
    problem = _problem(inputs, causal=True)
    lengths = padded_lengths(problem, prefix([8, 6], 8), prefix([8, 4], 8))
    assert lengths.tolist() == [[8, 8], [8, 8], [0, 1]]
    assert padded_lengths(problem, None, prefix([8, 8], 8)).tolist() == [[8, 8], [8, 8], [0, 0]]


def test_masks_the_gpu_call_keeps_are_not_read_on_the_host(monkeypatch):
    """Masks on the inputs' device reach a Gluon training kernel with lengths computed where they are (no
    synchronisation, so every mask stays, even one that keeps everything); masks given on the CPU are read there,
    and those that keep everything are dropped."""
    from dataclasses import replace

    monkeypatch.setattr(dispatch, "_reads_masks", lambda problem: True)
    monkeypatch.setattr(dispatch, "_forward_takes_gluon", lambda inputs, spec: inputs.lengths is not None)
    inputs = make(batch=2, n_q=8, n_k=8)
    every, padded = torch.ones(2, 8, dtype=torch.bool), prefix([8, 5], 8)
    problem, _ = dispatch.read_masks(_problem(inputs, causal=True, key_padding_mask=every, query_mask=padded))
    assert problem.key_padding_mask is every and problem.lengths.tolist() == [[8, 5], [8, 5], [0, 0]]
    on_host = replace(_problem(inputs, causal=True, key_padding_mask=every, query_mask=padded),
                      host_masks={"key_padding_mask": every, "query_mask": padded})
    problem, _ = dispatch.read_masks(on_host)
    assert problem.key_padding_mask is None and problem.query_mask is padded and problem.host_masks is None
    assert problem.lengths.tolist() == [[8, 5], [8, 5], [0, 0]]
    on_host = replace(_problem(inputs, causal=True, key_padding_mask=every), host_masks={"key_padding_mask": every})
    problem, _ = dispatch.read_masks(on_host)
    assert problem.key_padding_mask is None and problem.lengths is None  # dense
