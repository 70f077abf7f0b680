"""Masks come from the attention call, never from the batch: packed documents (restarting ``position_ids``,
``cu_seq_lens_*``, a block-diagonal 4D mask), left and right padding, custom 4D masks (prefix-LM, random) and
encoder-decoder cross-attention. Every logged KL equals the KL from the models' own eager probabilities (float64);
a packed row's equals the per-document KLs computed separately."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("transformers")

import lightning as L

from lightning_streamkl import StreamKLDistillation
from lightning_streamkl.capture import CapturedAttention, RecorderCapture
from lightning_streamkl.capture.masks import (
    KeyRows,
    Masking,
    PackedSequences,
    allowed_map,
    band,
    canonical_window,
    dense_allowed,
    describe_allowed,
    flash_masking,
    same_keys_on_host,
    same_mask,
)
from lightning_streamkl.loss import AttentionDistillationLoss
from lightning_streamkl.terms import count_rows
from streamkl import attention_kl

from ._hf import (
    F64,
    cpu_flash,
    distil,
    eager_outputs,
    float64_softmax,
    implementation,
    kl_rows,
    mean_kl,
    packed_row,
    tiny,
    tiny_bart,
)
from ._models import token_batch, trainer

LENGTHS = [4, 3, 5]  # one packed row of three documents


def _per_document_kl(teacher, student, docs, layer=-1):
    """The mean KL over every row of every document, each document run alone through both models (eager, float64)."""
    rows = [kl_rows(eager_outputs(teacher, input_ids=d).attentions[layer], eager_outputs(student, input_ids=d)
                    .attentions[layer]) for d in docs]
    return torch.cat([r.flatten() for r in rows]).mean()


class PackedLM(L.LightningModule):
    """Trains a causal LM on packed rows, as padding-free training does: ``use_cache=False``, no attention mask."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(**batch, labels=batch["input_ids"], use_cache=False).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class Logged(L.Callback):
    def __init__(self, key):
        self.key, self.values = key, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(trainer.callback_metrics[self.key].double())


@pytest.mark.parametrize("impl", ["sdpa", "eager", "flash_attention_2"])
def test_a_packed_row_logs_the_per_document_kl(impl):
    """The issue's case: one packed row of three documents under the callback; the logged KL is the per-document KL,
    not the KL of one causal sequence over all three (what a mask taken from the batch gave)."""
    teacher = tiny("llama", seed=0, hidden=64, kv_heads=2, impl=impl)
    student = tiny("llama", seed=1, hidden=32, kv_heads=1, impl=impl)
    batch, docs = packed_row(LENGTHS)
    logged = Logged("train/attn_kl/last_step")
    loader = torch.utils.data.DataLoader([{k: v[0] for k, v in batch.items()}], batch_size=1)
    with cpu_flash(), float64_softmax():
        trainer(max_steps=1, callbacks=[StreamKLDistillation(teacher, pairs=[{"teacher": -1, "student": -1,
                                                                              "name": "last"}]), logged],
                log_every_n_steps=1).fit(PackedLM(student), loader)
    expected = _per_document_kl(teacher, student, docs)
    ids = batch["input_ids"]  # the row as one causal sequence
    one_sequence = mean_kl(eager_outputs(teacher, input_ids=ids).attentions[-1],
                           eager_outputs(student, input_ids=ids).attentions[-1])
    torch.testing.assert_close(logged.values[0], expected, rtol=1e-6, atol=0)  # (the logged value is float32)
    assert abs(float(one_sequence) - float(expected)) > 0.01  # ignoring the documents would be visibly wrong


@pytest.mark.parametrize("kwargs", ["position_ids", "cu_seq_lens"])
def test_flash_attention_packed_forms_equal_the_per_document_kl(kwargs):
    teacher = tiny("llama", seed=0, hidden=64, kv_heads=2, impl="flash_attention_2")
    student = tiny("llama", seed=1, hidden=32, kv_heads=1, impl="sdpa")  # reads the same documents from its mask
    batch, docs = packed_row(LENGTHS)
    if kwargs == "cu_seq_lens":  # what DataCollatorWithFlattening(return_flash_attn_kwargs=True) adds
        cu = torch.tensor([0, 4, 7, 12], dtype=torch.int32)
        batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=5, max_length_k=5)
    with cpu_flash():
        out, t_rec, s_rec, _ = distil(teacher, student, batch, [[-1, -1]])
    t, s = t_rec["model.layers.1.self_attn"], s_rec["model.layers.1.self_attn"]
    assert t.packed.cu_seqlens_q.tolist() == [0, 4, 7, 12] and t.packed.same_as(s.packed)
    # the offsets were read once when the mask was read; their values stay on the host for the op (no second read)
    assert t.packed.host_cu_seqlens_q.tolist() == [0, 4, 7, 12] and t.packed.host_cu_seqlens_q.device.type == "cpu"
    assert (t.packed.max_seqlen_q, t.packed.max_seqlen_k) == (5, 5)
    assert out.rows.item() == 12 * 4
    torch.testing.assert_close(out.per_pair["t-1_s-1"], _per_document_kl(teacher, student, docs), rtol=1e-9, atol=0)


def test_a_student_with_a_cache_attends_across_documents_and_is_refused():
    """transformers builds sdpa's packed-document mask only without a cache: a student run with its default cache
    attends across documents while the teacher (use_cache=False) does not. The pair is refused, with the fix."""
    teacher = tiny("llama", seed=0)
    student = tiny("llama", seed=1)
    batch, _ = packed_row(LENGTHS)
    from lightning_streamkl.engine import AttentionDistiller

    distiller = AttentionDistiller(teacher, {"pairs": [[-1, -1]]})
    distiller.setup(student)
    distiller.begin_step(batch)
    with distiller.student_recording():
        student(**batch)  # use_cache defaults to True
    with pytest.raises(ValueError, match=r"attend to different keys \(teacher: causal, 3 packed sequences; student: "
                                         r"causal\).*use_cache=False"):
        distiller.end_step(batch)


@pytest.mark.parametrize(("impl", "mask_queries"), [("sdpa", True), ("eager", True), ("flash_attention_2", True),
                                                    ("sdpa", False), ("eager", False)])
def test_padding_from_the_call(impl, mask_queries):
    """Left padding in one row, right padding in another; padded positions' rows are dropped only with
    ``mask_queries`` (then every real row counts, else every row with an allowed key). (flash-attention never
    computes the padded positions, so their later layers' states differ from eager's: no reference for them.)"""
    teacher = tiny("llama", seed=0, hidden=64, kv_heads=2, impl=impl)
    student = tiny("llama", seed=1, hidden=32, kv_heads=1, impl=impl)
    batch = token_batch(3, 10, pad="left")
    batch["attention_mask"][0, 7:] = 0
    with cpu_flash(), float64_softmax():
        out, *_ = distil(teacher, student, batch, [[-1, -1]], mask_queries=mask_queries)
    real = batch["attention_mask"].bool()
    with implementation(teacher, "sdpa"), implementation(student, "sdpa"):
        p_t, p_s = eager_outputs(teacher, **batch).attentions[-1], eager_outputs(student, **batch).attentions[-1]
    # rows with no real key (left padding before the first real token) have no distribution
    rows = real if mask_queries else real.cumsum(-1) > 0
    torch.testing.assert_close(out.per_pair["t-1_s-1"], mean_kl(p_t, p_s, rows), rtol=1e-9, atol=0)
    assert out.rows.item() == 4 * rows.sum()


@pytest.mark.parametrize("impl", ["sdpa", "eager", "flash_attention_2"])
def test_the_two_models_key_padding_is_compared_on_the_host(monkeypatch, impl):
    """Each capture reads its mask's real keys per batch row on the host with the rest of the mask's description,
    so the loss compares the teacher's and the student's key padding there when every row's real keys are one run
    (left or right padding): neither mask is read again (on a GPU that read waited for the device, once a step).
    The KL is the one the test above checks. A row with a gap in its real keys is compared on the device still."""
    import lightning_streamkl.loss as loss_module

    compared = []
    monkeypatch.setattr(loss_module, "same_mask", lambda a, b: compared.append((a, b)) or same_mask(a, b))
    teacher = tiny("llama", seed=0, hidden=64, kv_heads=2, impl=impl)
    student = tiny("llama", seed=1, hidden=32, kv_heads=1, impl=impl)
    batch = token_batch(3, 10, pad="left")
    batch["attention_mask"][0, 7:] = 0
    with cpu_flash():
        out, t_rec, s_rec, _ = distil(teacher, student, batch, [[-1, -1], [0, 0]])
    rows = t_rec["model.layers.1.self_attn"].key_rows
    assert compared == [] and rows.runs == ((0, 7), (0, 10), (4, 10)), rows  # right-padded, full, left-padded
    assert t_rec["model.layers.1.self_attn"].key_padding_mask is not s_rec["model.layers.1.self_attn"].key_padding_mask
    assert torch.isfinite(out.total)
    if impl == "flash_attention_2":
        return  # (flash-attention packs a row with a gap: the packed sequences are compared instead)
    batch["attention_mask"][1, 5] = 0  # a gap: not one run
    with cpu_flash():
        distil(teacher, student, batch, [[-1, -1], [0, 0]])
    assert len(compared) == 1  # once for the step, not per pair


def test_key_rows_decide_equal_key_padding_on_the_host(monkeypatch):
    """Equal runs are equal masks, different runs different ones (and the loss then compares the keys each row sees,
    refusing a pair whose rows see different keys); a gap, rows not read or shapes that differ leave it to the
    masks. A windowed pair's window is made canonical from the rows read, without reading its mask again."""
    right, left = torch.tensor([[True, True, False]] * 2), torch.tensor([[True, True, False], [False, True, True]])
    gap = torch.tensor([[True, False, True]] * 2)

    def masking(m):
        return Masking(key_padding_mask=m, key_rows=KeyRows.read(m))

    assert same_keys_on_host(masking(right), masking(right.clone())) is True
    assert same_keys_on_host(masking(right), masking(left)) is False
    assert same_keys_on_host(Masking(), masking(right)) is False
    assert same_keys_on_host(Masking(), Masking()) is True
    assert same_keys_on_host(masking(gap), masking(gap.clone())) is None
    assert same_keys_on_host(Masking(key_padding_mask=right), masking(right)) is None
    assert same_keys_on_host(masking(right[:1]), masking(right)) is None
    empty = KeyRows.read(torch.tensor([[False, False, False], [True, True, True]]))
    assert (empty.runs, empty.span, empty.keeps_all) == (((0, 0), (0, 3)), (0, 2), False)
    none = KeyRows.read(torch.zeros(2, 3, dtype=torch.bool))
    assert none.span == (3, -1) and canonical_window((1, 0), True, 3, 3, torch.zeros(2, 3, dtype=torch.bool)) \
        == canonical_window((1, 0), True, 3, 3, torch.zeros(2, 3, dtype=torch.bool), key_span=none.span)

    q = torch.randn(2, 2, 3, 8)

    def record(m, window=None):
        return CapturedAttention(q, q, causal=True, key_padding_mask=m, key_rows=KeyRows.read(m), window=window,
                                 masks_from_call=True)

    teacher, student = RecorderCapture(torch.nn.Identity(), names=["a"]), RecorderCapture(torch.nn.Identity(), names=["b"])
    loss = AttentionDistillationLoss({"pairs": [{"teacher": "a", "student": "b"}]})
    loss.resolve(teacher, student)
    with pytest.raises(ValueError, match="attend to different keys"):
        loss({"a": record(right)}, {"b": record(left)})
    windowed = {"a": record(right, (1, 0))}, {"b": record(right.clone(), (1, 0))}
    reads, read = [], KeyRows.read
    monkeypatch.setattr(KeyRows, "read", staticmethod(lambda real: reads.append(real) or read(real)))
    out = loss(*windowed)
    assert reads == [] and out.rows.item() == 2 * 2 * 3  # batch rows x heads x query rows (no query mask)


def test_packed_sequences_read_on_the_host_are_compared_there():
    """Two models' reads of one packed batch (offsets read on the host, every token kept) are compared without reading
    the device: the offsets on a device no value can be read from (meta) are never touched. Different offsets, or
    different kept tokens, are still found, and the sdpa capture of a packed row without padding keeps every token."""
    host = torch.tensor([0, 3, 5], dtype=torch.int32)
    on_meta = host.to("meta")

    def read(offsets, index=None):
        return PackedSequences(on_meta.clone(), on_meta.clone(), 3, 3, index, index, offsets, offsets.clone())

    assert read(host).same_as(read(host.clone()))
    assert not read(host).same_as(read(torch.tensor([0, 2, 5], dtype=torch.int32)))
    kept = PackedSequences.from_offsets(host, host, torch.tensor([0, 1, 2, 4, 5]), torch.tensor([0, 1, 2, 4, 5]))
    assert not kept.same_as(PackedSequences.from_offsets(host, host)) and kept.same_as(
        PackedSequences.from_offsets(host, host, kept.index_q.clone(), kept.index_k.clone()))
    batch, _ = packed_row(LENGTHS)
    teacher = tiny("llama", seed=0, hidden=64, kv_heads=2, impl="sdpa")
    _, t_rec, _, _ = distil(teacher, tiny("llama", seed=1, hidden=32, kv_heads=1, impl="sdpa"), batch, [[-1, -1]])
    packed = t_rec["model.layers.1.self_attn"].packed
    assert (packed.index_q, packed.index_k, packed.host_cu_seqlens_q.tolist()) == (None, None, [0, 4, 7, 12])


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_masks_made_under_inference_mode(impl):
    """Lightning runs validation under ``torch.inference_mode()``, whose tensors have no version counter: the 4D mask
    is still read (and its reading reused by the next layer), and the KL is the one computed under ``no_grad``."""
    teacher = tiny("llama", seed=0, hidden=64, kv_heads=2, impl=impl)
    student = tiny("llama", seed=1, hidden=32, kv_heads=1, impl=impl)
    batch = token_batch(3, 10, pad="left")
    batch["attention_mask"][0, 7:] = 0
    pairs = [[0, 0], [-1, -1]]
    with torch.no_grad():
        expected, *_ = distil(teacher, student, batch, pairs)
    with torch.inference_mode():
        got, t_rec, s_rec, _ = distil(teacher, student, batch, pairs)
    for rec in (*t_rec.values(), *s_rec.values()):
        assert rec.masking().summary() == "causal, key padding"
        assert torch.equal(rec.key_padding_mask, batch["attention_mask"].bool())
    for name, value in expected.per_pair.items():
        torch.testing.assert_close(got.per_pair[name], value, rtol=0, atol=0)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["prefix_lm", "block_diagonal", "random"])
def test_custom_4d_masks(impl, kind):
    """A 4D mask the user gives the model: bool for sdpa, additive for eager. Structured when it equals a structure
    (block-diagonal: packed documents), else passed whole as attn_mask; exact either way."""
    n = 10
    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    if kind == "prefix_lm":
        allowed = (j < torch.tensor([3, 6])[:, None, None, None]) | (j <= i)
    elif kind == "block_diagonal":
        allowed = (torch.block_diag(torch.ones(4, 4), torch.ones(6, 6)).bool() & (j <= i)).expand(2, 1, n, n)
    else:
        allowed = (torch.rand(2, 1, n, n, generator=torch.Generator().manual_seed(3)) < 0.5) | torch.eye(n).bool()
    additive = torch.zeros(allowed.shape, dtype=F64).masked_fill(~allowed, torch.finfo(F64).min)
    teacher = tiny("llama", seed=0, hidden=64, kv_heads=2, impl=impl)
    student = tiny("llama", seed=1, hidden=32, kv_heads=1, impl=impl)
    ids = torch.randint(1, 50, (2, n), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": allowed if impl == "sdpa" else additive}
    with float64_softmax():
        out, t_rec, _, _ = distil(teacher, student, batch, [[-1, -1]])
    summary = t_rec["model.layers.1.self_attn"].masking().summary()
    assert summary == {"prefix_lm": "bidirectional, a general attention mask", "random": "bidirectional, a general "
                       "attention mask", "block_diagonal": "causal, 4 packed sequences"}[kind]
    p_t = eager_outputs(teacher, input_ids=ids, attention_mask=additive).attentions[-1]
    p_s = eager_outputs(student, input_ids=ids, attention_mask=additive).attentions[-1]
    torch.testing.assert_close(out.per_pair["t-1_s-1"], mean_kl(p_t, p_s), rtol=1e-9, atol=0)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("decoder_length", [5, 7])
def test_encoder_decoder_cross_attention(impl, decoder_length):
    """Bart: encoder self-attention with padding, causal decoder self-attention, and cross-attention (N_q = decoder
    length, N_k = encoder length, encoder padding; with equal lengths too, where only the call tells it is cross)."""
    teacher, student = tiny_bart(seed=0, d_model=32, impl=impl), tiny_bart(seed=1, d_model=16, impl=impl)
    batch = {"input_ids": torch.randint(1, 50, (2, 7)), "attention_mask": torch.tensor([[1] * 7, [1] * 5 + [0] * 2]),
             "decoder_input_ids": torch.randint(1, 50, (2, decoder_length))}
    pairs = [[name, name] for name in ("encoder.layers.0.self_attn", "decoder.layers.1.self_attn",
                                       "decoder.layers.1.encoder_attn")]
    with float64_softmax():
        out, t_rec, _, _ = distil(teacher, student, batch, pairs)
    cross = t_rec["decoder.layers.1.encoder_attn"]
    assert cross.causal is False and cross.query_mask is None and torch.equal(cross.key_padding_mask,
                                                                               batch["attention_mask"].bool())
    o_t, o_s = eager_outputs(teacher, **batch), eager_outputs(student, **batch)
    real = batch["attention_mask"].bool()
    expected = [mean_kl(o_t.encoder_attentions[0], o_s.encoder_attentions[0], real),
                mean_kl(o_t.decoder_attentions[1], o_s.decoder_attentions[1]),
                mean_kl(o_t.cross_attentions[1], o_s.cross_attentions[1])]
    for got, ref in zip(out.per_pair.values(), expected):
        torch.testing.assert_close(got, ref, rtol=1e-9, atol=0)


# ---------------------------------------------------------------------------------------------- the mask reading
def _causal(n):
    return band(n, n, True, None, torch.device("cpu"))


def test_describe_allowed_finds_each_structure():
    real = torch.tensor([[True] * 8, [False, False] + [True] * 6])
    padded = _causal(8)[None, None] & real[:, None, None, :]
    d = describe_allowed(padded, 2, self_attention=True)
    assert (d.causal, d.window, d.attn_mask, d.packed) == (True, None, None, None)
    assert torch.equal(d.key_padding_mask, real) and torch.equal(d.query_mask, real)

    windowed = padded & band(8, 8, True, (2, 0), torch.device("cpu"))
    assert describe_allowed(windowed, 2, self_attention=True).window == (2, 0)
    both_sides = band(8, 8, False, (1, 2), torch.device("cpu"))[None, None]
    d = describe_allowed(both_sides, 1, self_attention=True)
    assert (d.causal, d.window) == (False, (1, 2))

    docs = torch.block_diag(torch.ones(3, 3), torch.ones(5, 5)).bool() & _causal(8) & band(8, 8, True, (1, 0),
                                                                                             torch.device("cpu"))
    d = describe_allowed(docs[None, None], 1, self_attention=True)
    assert (d.causal, d.window, d.packed.cu_seqlens_q.tolist()) == (True, (1, 0), [0, 3, 8])

    holes = _causal(6).clone()
    holes[4, 1] = False  # no structure describes it
    d = describe_allowed(holes[None, None], 1, self_attention=True)
    assert d.attn_mask is not None and d.causal is False and d.summary() == "bidirectional, a general attention mask"
    cross = describe_allowed(torch.ones(1, 1, 3, 5, dtype=torch.bool), 1, self_attention=False)
    assert (cross.causal, cross.key_padding_mask, cross.query_mask) == (False, None, None)


class _HostReads(TorchDispatchMode):
    """The reads of one value at a time (``bool``, ``int``, ``item``, ``torch.equal``) made under it."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default):
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("block", [None, 7], ids=["whole map", "7-element row blocks"])
def test_describe_allowed_reads_a_map_in_one_transfer(monkeypatch, block):
    """A padded, a windowed and a two-sided banded map are described without reading one value at a time (on a GPU,
    each such read waits for the device: the whole description is one transfer), the same whether the map is
    compared whole or by row blocks, and a difference in the last row block alone is still found."""
    import lightning_streamkl.capture.masks as masks

    if block is not None:
        monkeypatch.setattr(masks, "COMPARE_BLOCK_ELEMENTS", block)
    real = torch.tensor([[True] * 8, [True] * 5 + [False] * 3])
    padded = _causal(8)[None, None] & real[:, None, None, :]
    maps = {"causal, key padding": padded,
            "causal, window (2, 0), key padding": padded & band(8, 8, True, (2, 0), torch.device("cpu")),
            "bidirectional, window (1, 2)": band(8, 8, False, (1, 2), torch.device("cpu"))[None, None]}
    for summary, allowed in maps.items():
        with _HostReads() as mode:
            d = describe_allowed(allowed, allowed.shape[0], self_attention=True)
        assert (d.summary(), mode.reads) == (summary, [])
    hole = padded.clone()
    hole[0, 0, 7, 3] = False
    assert describe_allowed(hole, 2, self_attention=True).attn_mask is not None


def _packed_map(lengths: list[list[int]], pads: list[tuple[int, int]], causal: bool, window: tuple[int, int] | None,
                heads: int) -> torch.Tensor:
    """``[B, heads, N, N]``: each batch row its documents (``lengths``) between ``pads`` (left, right) padding tokens,
    each document a band (``causal``, ``window``), padding seeing nothing and seen by nothing."""
    n = sum(lengths[0]) + sum(pads[0])
    rows = []
    for docs, (before, after) in zip(lengths, pads):
        blocks = [band(d, d, causal, window, torch.device("cpu")) for d in docs]
        rows.append(torch.nn.functional.pad(torch.block_diag(*blocks), (before, after, before, after)))
    assert all(r.shape == (n, n) for r in rows)
    return torch.stack(rows)[:, None].expand(-1, heads, -1, -1)


@pytest.mark.parametrize("seed", range(12))
def test_a_packed_map_is_described_exactly(seed):
    """Random packed maps (one or two batch rows, padding on either side or none, causal or not, a window that bites
    or none, a mask over one or two heads): the description's own map (``dense_allowed``) equals the map on every
    real row, and so does that of the same map with one entry of a real row flipped (then no packed description
    holds it)."""
    g = torch.Generator().manual_seed(seed)

    def draw(high: int) -> int:
        return int(torch.randint(high, (), generator=g))

    causal, heads, batch = bool(draw(2)), 1 + draw(2), 1 + draw(2)
    window = None if draw(2) else (1 + draw(3), 0 if causal else 1 + draw(3))
    pads = [(draw(3), draw(3)) if draw(2) else (0, 0) for _ in range(batch)]
    total = 9 + draw(6)
    lengths = []
    for before, after in pads:
        room, docs = total - before - after, []
        while room:
            docs.append(min(room, 1 + draw(5)))
            room -= docs[-1]
        lengths.append(docs)
    allowed = _packed_map(lengths, pads, causal, window, heads)
    real = allowed.any(2).any(1)
    keep = real[:, None, :, None]
    d = describe_allowed(allowed, batch, self_attention=True)
    assert d.packed is not None or (len(lengths[0]) == 1 and batch == 1), (lengths, pads, d.summary())
    assert torch.equal(dense_allowed(d, batch, total, total, torch.device("cpu")).expand_as(allowed) & keep,
                       allowed & keep), (lengths, pads, causal, window, d.summary())
    if d.packed is not None and all(before == after == 0 for before, after in pads):
        assert d.packed.index_q is None and d.packed.host_cu_seqlens_q.tolist()[-1] == batch * total
    flipped = allowed.clone()
    row = int(real[0].nonzero()[draw(int(real[0].sum()))])
    flipped[0, :, row, draw(total)] ^= True
    f = describe_allowed(flipped, batch, self_attention=True)
    f_real = flipped.any(2).any(1)[:, None, :, None] & keep
    assert torch.equal(dense_allowed(f, batch, total, total, torch.device("cpu")).expand_as(flipped) & f_real,
                       flipped & f_real), (lengths, pads, causal, window, f.summary())


def test_allowed_map_conversions():
    additive = torch.tensor([[0.0, -torch.inf, torch.finfo(torch.float32).min, -1e4]])
    assert allowed_map(additive, 1, 4).flatten().tolist() == [True, False, False, False]
    assert allowed_map(torch.tensor([[False, True]]), 1, 2, blocked=True).flatten().tolist() == [True, False]
    assert allowed_map(torch.zeros(1, 1, 2, 6), 2, 4).shape == (1, 1, 2, 4)  # a longer mask is cut to N_k
    with pytest.raises(ValueError, match="score bias"):
        allowed_map(torch.tensor([[0.0, -5.0]]), 1, 2)
    with pytest.raises(ValueError, match=r"shape \(1, 1, 3, 4\), which does not fit N_q=2"):
        allowed_map(torch.zeros(1, 1, 3, 4, dtype=torch.bool), 2, 4)


def test_flash_masking_follows_transformers():
    real = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])
    m = flash_masking(real, 2, 4, 4, {"sliding_window": 2}, True, self_attention=True)
    assert (m.window, m.packed) == ((1, 0), None) and torch.equal(m.key_padding_mask, real.bool())
    holes = torch.tensor([[1, 0, 1, 1]])  # flash-attention compresses the real tokens: one packed sequence
    m = flash_masking(holes, 1, 4, 4, {}, True, self_attention=True)
    assert m.packed.index_q.tolist() == [0, 2, 3] and m.packed.cu_seqlens_q.tolist() == [0, 3]
    assert flash_masking(None, 1, 4, 4, {"sliding_window": 4}, True, self_attention=True).window is None  # N <= w
    pos = torch.tensor([[0, 1, 0, 1]])
    assert flash_masking(None, 2, 4, 4, {"position_ids": pos.expand(2, 4)}, True, self_attention=True).packed is None
    m = flash_masking(None, 1, 4, 4, {"position_ids": pos}, False, self_attention=True)
    assert (m.causal, m.packed.cu_seqlens_q.tolist()) == (False, [0, 2, 4])


def test_canonical_window_and_dense_maps():
    assert canonical_window((5, 0), True, 8, 8, torch.tensor([[True] * 6 + [False] * 2])) == (5, 0)
    assert canonical_window((5, 0), True, 8, 8, torch.tensor([[False] * 3 + [True] * 5])) is None
    assert canonical_window((2, 7), False, 8, 8) == (2, -1)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    packed = PackedSequences(cu, cu, 3, 3)
    dense = dense_allowed(Masking(causal=True, packed=packed), 1, 5, 5, torch.device("cpu"))[0, 0]
    assert torch.equal(dense, torch.block_diag(torch.ones(2, 2), torch.ones(3, 3)).bool() & _causal(5))


@pytest.mark.parametrize("window", [None, (0, 0), (2, 1), (-1, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_row_counts_are_the_ops_mean_denominator(window, causal):
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 6, 4), torch.randn(2, 3, 6, 4)
    pad = torch.tensor([[True] * 6, [True, True, False, False, False, True]])
    attn = torch.rand(2, 1, 6, 6) < 0.7
    for kw in ({"key_padding_mask": pad}, {"attn_mask": attn}, {"key_padding_mask": pad, "attn_mask": attn}):
        total = attention_kl(q, k, k, q, causal=causal, window=window, reduction="sum", **kw)
        mean = attention_kl(q, k, k, q, causal=causal, window=window, reduction="mean", **kw)
        rows = count_rows(2, 3, 6, 6, causal=causal, window=window, device=torch.device("cpu"), **kw)
        torch.testing.assert_close(total / rows, mean)
    cu = torch.tensor([0, 2, 2, 7], dtype=torch.int32)
    packed = PackedSequences(cu, torch.tensor([0, 3, 4, 7], dtype=torch.int32), 5, 3)
    qt, kt = torch.randn(7, 3, 4), torch.randn(7, 3, 4)
    options = dict(causal=causal, window=window, layout="thd", cu_seqlens_q=packed.cu_seqlens_q,
                   cu_seqlens_k=packed.cu_seqlens_k)
    total, rows = attention_kl(qt, kt, kt, qt, reduction="sum", return_count=True, **options)
    mean = attention_kl(qt, kt, kt, qt, reduction="mean", **options)
    torch.testing.assert_close(total / rows, mean)


@pytest.mark.parametrize(("n_q", "n_k"), [(300, 300), (256, 256), (200, 300)])
def test_a_block_mask_reads_as_flex_attention_applies_it(n_q, n_k):
    """The mask_mod is evaluated on the partial blocks only; full blocks are allowed whole, others never: the map
    equals flex attention's own dense ``create_mask`` for causal, padded, windowed and packed masks, odd lengths and
    N_q != N_k included."""
    from torch.nn.attention.flex_attention import create_block_mask, create_mask

    from lightning_streamkl.capture.masks import allowed_map

    pad = torch.ones(2, n_k, dtype=torch.bool)
    pad[1, :37] = False
    docs = (torch.arange(n_k) >= 120).long()
    shift = n_k - n_q
    mods = {
        "causal": (lambda b, h, q, kv: q + shift >= kv, 1, 1),
        "padded": (lambda b, h, q, kv: (q + shift >= kv) & pad[b, kv], 2, 1),
        "window": (lambda b, h, q, kv: (q + shift >= kv) & (q + shift - kv <= 50), 1, 2),
        "packed": (lambda b, h, q, kv: (docs[q + shift] == docs[kv]) & (q + shift >= kv), 1, 1),
    }
    for name, (mod, batch, heads) in mods.items():
        block_mask = create_block_mask(mod, batch, heads, n_q, n_k, device="cpu", BLOCK_SIZE=64)
        expected = create_mask(mod, batch, heads, n_q, n_k, device="cpu")
        assert torch.equal(allowed_map(block_mask, n_q, n_k), expected), name


@pytest.mark.parametrize(("n_q", "n_k"), [(256, 256), (300, 300), (200, 256)])
def test_a_causal_block_mask_is_read_without_the_dense_map(monkeypatch, n_q, n_k):
    """``describe_mask`` reads a causal ``BlockMask`` (one batch and head, or several) from its block lists and its
    diagonal blocks, without building the ``N_q × N_k`` map; every other mask (padded, windowed, packed,
    bidirectional, causal with one diagonal score removed, blocks that do not tile the call, a mask without full
    blocks) gets the dense map, and each gets exactly what ``describe_allowed`` finds on the dense map."""
    from torch.nn.attention.flex_attention import create_block_mask

    from lightning_streamkl.capture import masks

    pad = torch.ones(2, n_k, dtype=torch.bool)
    pad[1, :37] = False
    docs = (torch.arange(n_k) >= 120).long()
    shift = n_k - n_q
    causal = lambda b, h, q, kv: q + shift >= kv
    mods = {
        "causal": (causal, 1, 1, True),
        "causal, two batches and heads": (causal, 2, 2, True),
        "padded": (lambda b, h, q, kv: (q + shift >= kv) & pad[b, kv], 2, 1, False),
        "window": (lambda b, h, q, kv: (q + shift >= kv) & (q + shift - kv <= 50), 1, 2, False),
        "packed": (lambda b, h, q, kv: (docs[q + shift] == docs[kv]) & (q + shift >= kv), 1, 1, False),
        "bidirectional": (lambda b, h, q, kv: q >= 0, 1, 1, False),
        "one diagonal score off": (lambda b, h, q, kv: (q + shift >= kv) & ~((q == 70) & (kv == 70)), 1, 1, False),
    }
    dense_maps = []
    original = masks.allowed_map
    monkeypatch.setattr(masks, "allowed_map", lambda *a, **k: dense_maps.append(1) or original(*a, **k))
    for name, (mod, batch, heads, shortcut) in mods.items():
        for block in (64, (64, 32)):
            block_mask = create_block_mask(mod, batch, heads, n_q, n_k, device="cpu", BLOCK_SIZE=block)
            dense_maps.clear()
            got = masks.describe_mask(block_mask, n_q, n_k, batch, self_attention=True)
            expected = describe_allowed(original(block_mask, n_q, n_k), batch, self_attention=True)
            square = n_q == n_k and n_q % 64 == 0 and block == 64
            assert (not dense_maps) == (shortcut and square), (name, block)
            assert got.summary() == expected.summary() and got.causal == expected.causal, (name, block)
            for field in ("key_padding_mask", "query_mask", "attn_mask"):
                a, b = getattr(got, field), getattr(expected, field)
                assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), (name, block, field)
    causal_mask = create_block_mask(causal, 1, 1, n_q, n_k, device="cpu", BLOCK_SIZE=64)
    causal_mask.full_kv_num_blocks = causal_mask.full_kv_indices = None  # every block partial: not read as causal
    dense_maps.clear()
    masks.describe_mask(causal_mask, n_q, n_k, 1, self_attention=True)
    assert dense_maps
