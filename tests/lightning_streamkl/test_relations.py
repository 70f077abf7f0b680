"""MiniLM-v2 self-attention relation distillation (Wang et al., 2021, "MiniLMv2: Multi-Head Self-Attention Relation
Distillation for Compressing Pretrained Transformers"), checked against a float64 implementation written from the
paper's equations, never from our code:

    A_{α,a} = the a-th of A_r relation heads of the concatenated heads A_α ∈ R^{|x| × d_h}, α ∈ {Q, K, V}
    R_{αα,a} = softmax(A_{α,a} A_{α,a}ᵀ / sqrt(d_r)),  d_r = d_h / A_r  (each model with its own d_h)
    L_{αα} = 1 / (A_r |x|) Σ_a Σ_t KL(R^T_{αα,a,t} ‖ R^S_{αα,a,t}),   L = L_QQ + L_KK + L_VV

with the padded tokens out of the softmax and out of the mean (our addition: the paper has no padding)."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from torch import nn

from lightning_streamkl import (
    AttentionDistillationLoss,
    AttentionDistillationMixin,
    AttentionDistiller,
    LayerPair,
    StreamKLDistillation,
    validate_config,
)
from lightning_streamkl.capture import CapturedAttention, MultiheadAttentionCapture, RecorderCapture, record

F64 = torch.float64


# ------------------------------------------------------------------------------------------ the paper, in float64
def paper_relation(x: torch.Tensor, relation_heads: int, mask: torch.Tensor, causal: bool) -> torch.Tensor:
    """R_{αα,a} of one model: x is [B, H, N, D] (one of Q, K, V per head), returns [B, A_r, N, N] probabilities."""
    b, h, n, d = x.shape
    concatenated = torch.cat([x[:, i] for i in range(h)], dim=-1)  # [B, N, d_h]: head 0's dims, then head 1's, ...
    d_r = h * d // relation_heads
    heads = torch.stack([concatenated[..., a * d_r:(a + 1) * d_r] for a in range(relation_heads)], dim=1)
    scores = heads @ heads.transpose(-1, -2) / math.sqrt(d_r)
    allowed = mask[:, None, None, :].expand(b, relation_heads, n, n)
    if causal:
        allowed = allowed & torch.ones(n, n, dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1)


def paper_loss(teacher: dict, student: dict, relation_heads: int, mask: torch.Tensor, relations=("q", "k", "v"),
               causal: bool = False) -> dict[str, torch.Tensor]:
    """L_{αα} per relation (mean over relation heads and real tokens), and their sum under "total"."""
    out = {}
    for alpha in relations:
        r_t = paper_relation(teacher[alpha], relation_heads, mask, causal)
        r_s = paper_relation(student[alpha], relation_heads, mask, causal)
        kl = torch.where(r_t > 0, r_t * (r_t.log() - r_s.log()), torch.zeros_like(r_t)).sum(-1)  # [B, A_r, N]
        out[alpha] = kl[mask[:, None, :].expand_as(kl)].mean()
    out["total"] = sum(out[a] for a in relations)
    return out


def qkv(b=2, h=4, h_kv=4, n=7, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"q": torch.randn(b, h, n, d, generator=g, dtype=F64), "k": torch.randn(b, h_kv, n, d, generator=g, dtype=F64),
            "v": torch.randn(b, h_kv, n, d, generator=g, dtype=F64)}


def as_record(x: dict, causal: bool = False) -> CapturedAttention:
    return CapturedAttention(x["q"], x["k"], causal=causal, v=x["v"])


PADDED = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])


@pytest.mark.parametrize(("teacher_shape", "student_shape", "relation_heads"), [
    ((12, 12, 32), (12, 12, 32), 12),  # all-MiniLM-L6-v2's layer shape to itself
    ((4, 4, 8), (2, 2, 12), 4),        # different head counts and head dims: d_h 32 vs 24, d_r 8 vs 6
    ((4, 2, 8), (3, 3, 4), 2),         # GQA teacher (K, V: 2 heads of 8 → 2 relation heads of 8), student d_h 12
    ((4, 4, 8), (2, 2, 12), 8),        # more relation heads than either model has heads
])
@pytest.mark.parametrize("causal", [False, True])
def test_relations_equal_the_paper_in_float64(teacher_shape, student_shape, relation_heads, causal):
    t = qkv(h=teacher_shape[0], h_kv=teacher_shape[1], d=teacher_shape[2], seed=1)
    s = qkv(h=student_shape[0], h_kv=student_shape[1], d=student_shape[2], seed=2)
    loss = AttentionDistillationLoss({"pairs": [LayerPair("t", "s", name="last")], "relations": ["qq", "kk", "vv"],
                                      "relation_heads": relation_heads, "causal": causal})
    out = loss({"t": as_record(t, causal)}, {"s": as_record(s, causal)}, key_padding_mask=PADDED, query_mask=PADDED)
    ref = paper_loss(t, s, relation_heads, PADDED, causal=causal)
    assert loss.pair_names == ["last/qq", "last/kk", "last/vv"]
    for alpha in "qkv":
        assert out.per_pair[f"last/{alpha}{alpha}"].dtype == F64
        torch.testing.assert_close(out.per_pair[f"last/{alpha}{alpha}"], ref[alpha], rtol=1e-10, atol=1e-12)
        assert ref[alpha] > 0.01  # independent random tensors: a non-trivial comparison
    torch.testing.assert_close(out.total, ref["total"], rtol=1e-10, atol=1e-12)
    assert out.rows.tolist() == [relation_heads * 11.0] * 3  # 7 + 4 real tokens per relation head


def test_the_default_relation_heads_are_the_students_query_heads():
    t, s = qkv(h=4, h_kv=4, d=8, seed=3), qkv(h=2, h_kv=2, d=12, seed=4)
    loss = AttentionDistillationLoss({"pairs": [["t", "s"]], "relations": ["qq"], "causal": False})
    out = loss({"t": as_record(t)}, {"s": as_record(s)}, key_padding_mask=PADDED, query_mask=PADDED)
    torch.testing.assert_close(out.total, paper_loss(t, s, 2, PADDED, relations="q")["total"], rtol=1e-10, atol=0)


def test_relations_per_pair_weights_and_names_next_to_attention_maps():
    t, s = qkv(seed=5), qkv(seed=6)
    loss = AttentionDistillationLoss({"pairs": [
        LayerPair("t", "s", name="map"),  # the config's relations: the attention distributions
        LayerPair("t", "s", name="rel", weight=0.5, relations=["kk", "qq"], relation_heads=2)],
        "causal": False})
    assert loss.pair_names == ["map", "rel/kk", "rel/qq"] and loss.weights == [1.0, 0.5, 0.5]
    out = loss({"t": as_record(t)}, {"s": as_record(s)})
    full = torch.ones(2, 7, dtype=torch.bool)
    ref = paper_loss(t, s, 2, full, relations="kq")
    torch.testing.assert_close(out.per_pair["rel/kk"], ref["k"], rtol=1e-10, atol=0)
    torch.testing.assert_close(out.per_pair["rel/qq"], ref["q"], rtol=1e-10, atol=0)
    torch.testing.assert_close(out.total, out.per_pair["map"] + 0.5 * ref["total"], rtol=1e-10, atol=0)


def test_relations_are_differentiable_for_the_student_only():
    t, s = qkv(seed=7), qkv(h=2, h_kv=2, d=16, seed=8)
    s = {k: v.requires_grad_() for k, v in s.items()}
    loss = AttentionDistillationLoss({"pairs": [["t", "s"]], "relations": ["qq", "kk", "vv"], "relation_heads": 4,
                                      "causal": False})
    loss({"t": as_record(t)}, {"s": as_record(s)}).total.backward()
    ref = {k: v.detach().clone().requires_grad_() for k, v in s.items()}
    paper_loss(t, ref, 4, torch.ones(2, 7, dtype=torch.bool))["total"].backward()
    for k in "qkv":
        torch.testing.assert_close(s[k].grad, ref[k].grad, rtol=1e-9, atol=1e-12)


def test_relations_follow_the_calls_masks_packed_documents_and_causal():
    """A record whose masks come from its call (packed documents, layout='thd'): each relation is computed within
    each document, over the keys the layer allows, as the paper's relations of the documents one by one."""
    from lightning_streamkl.capture import PackedSequences

    t, s = qkv(b=1, h=4, n=7, d=8, seed=1), qkv(b=1, h=2, h_kv=2, n=7, d=8, seed=2)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    packed = PackedSequences(cu, cu, 4, 4)

    def rec(x):
        return CapturedAttention(x["q"], x["k"], causal=True, v=x["v"], packed=packed, masks_from_call=True)

    loss = AttentionDistillationLoss({"pairs": [LayerPair("t", "s", name="p")], "relations": ["qq", "kk", "vv"],
                                      "relation_heads": 4})
    out = loss({"t": rec(t)}, {"s": rec(s)})
    for relation, alpha in (("qq", "q"), ("kk", "k"), ("vv", "v")):
        per_doc = []
        for lo, hi in ((0, 3), (3, 7)):
            doc_t = {a: x[:, :, lo:hi] for a, x in t.items()}
            doc_s = {a: x[:, :, lo:hi] for a, x in s.items()}
            m = paper_loss(doc_t, doc_s, 4, torch.ones(1, hi - lo, dtype=torch.bool), relations=(alpha,),
                           causal=True)[alpha]
            per_doc.append(m * (hi - lo))
        torch.testing.assert_close(out.per_pair[f"p/{relation}"], sum(per_doc) / 7, rtol=1e-10, atol=1e-12)
    assert out.rows.tolist() == [28.0, 28.0, 28.0]  # 7 tokens x 4 relation heads


def test_a_relation_with_a_per_head_mask_is_refused():
    t = qkv(b=1, h=4, n=5, d=8, seed=1)
    allowed = torch.ones(1, 4, 5, 5, dtype=torch.bool)
    allowed[:, 1, :, 0] = False  # head 1 may not see key 0: a mask per attention head

    def rec(x):
        return CapturedAttention(x["q"], x["k"], causal=False, v=x["v"], attn_mask=allowed, masks_from_call=True)

    loss = AttentionDistillationLoss({"pairs": [["t", "s"]], "relations": ["kk"], "relation_heads": 2})
    with pytest.raises(ValueError, match=r"relation 'kk': the layers' attention mask differs per head"):
        loss({"t": rec(t)}, {"s": rec(t)})


# ------------------------------------------------------------------------------------------ errors
def test_a_value_relation_without_captured_values_fails_clearly():
    t, s = qkv(seed=1), qkv(seed=2)
    loss = AttentionDistillationLoss({"pairs": [LayerPair("t", "s", name="last")], "relations": ["vv"],
                                      "causal": False})
    without = CapturedAttention(s["q"], s["k"], causal=False)  # what a capture without capture_values records
    with pytest.raises(ValueError, match=r"pair 'last' .*'vv' needs the student layer's values, but its record holds "
                                         r"none\. A capture keeps them only when made with capture_values=True"):
        loss({"t": as_record(t)}, {"s": without})


def test_relation_heads_that_do_not_split_a_side_fail_naming_it():
    t, s = qkv(h=4, d=8, seed=1), qkv(h=3, h_kv=3, d=4, seed=2)  # d_h 32 and 12: 8 relation heads split 32 only
    loss = AttentionDistillationLoss({"pairs": [LayerPair("t", "s", name="p")], "relations": ["qq"],
                                      "relation_heads": 8, "causal": False})
    with pytest.raises(ValueError, match=r"pair 'p'.*relation 'qq': Expected the number of relation heads to divide "
                                         r"the student queries' concatenated heads \(3 heads × 4 = 12\), but got 8\."):
        loss({"t": as_record(t)}, {"s": as_record(s)})


def test_relations_need_self_attention():
    t = {"q": torch.randn(1, 2, 3, 4, dtype=F64), "k": torch.randn(1, 2, 5, 4, dtype=F64),
         "v": torch.randn(1, 2, 5, 4, dtype=F64)}
    loss = AttentionDistillationLoss({"pairs": [["t", "s"]], "relations": ["kk"], "causal": False})
    with pytest.raises(ValueError, match=r"needs self-attention \(as many queries as keys\).*N_q=3 and N_k=5"):
        loss({"t": as_record(t)}, {"s": as_record(t)})


@pytest.mark.parametrize(("value", "message"), [
    (["qq", "qq"], "Expected `relations` to be a non-empty list of distinct relations from ('qk', 'qq', 'kk', 'vv'), "
                   "but got ['qq', 'qq']."),
    (["q"], "Expected `relations[0]` to be one of ('qk', 'qq', 'kk', 'vv'), but got 'q'."),
    ([], "Expected `relations` to be a non-empty list of distinct relations"),
])
def test_bad_relations_are_rejected_naming_the_option(value, message):
    with pytest.raises(ValueError) as info:
        validate_config({"pairs": [[0, 0]], "relations": value})
    assert message in str(info.value)
    with pytest.raises(ValueError, match=r"`pairs\[0\]\.relation_heads` to be an int >= 1"):
        validate_config({"pairs": [{"teacher": 0, "student": 0, "relation_heads": 0}]})


# ------------------------------------------------------------------------------------------ through the captures
class RecordingAttention(nn.Module):
    """A bidirectional attention that hands q, k and v to the captures with record()."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, dim = x.shape
        q, k, v = (t.view(b, n, self.heads, dim // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        record(self, q, k, v=v, causal=False)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(dim // self.heads), -1) @ v
        return self.out(att.transpose(1, 2).reshape(b, n, dim))


def test_the_engine_distils_relations_of_recorded_layers():
    torch.manual_seed(0)
    teacher = nn.Sequential(RecordingAttention(24, 6), RecordingAttention(24, 6)).to(F64)
    student = nn.Sequential(RecordingAttention(16, 2)).to(F64)
    distiller = AttentionDistiller(teacher, {"pairs": [{"teacher": "1", "student": "0", "name": "last"}],
                                             "relations": ["qq", "kk", "vv"], "relation_heads": 4,
                                             "teacher_capture": "recorder", "student_capture": "recorder"},
                                   student=student, teacher_forward=lambda m, x: m(x @ torch.ones(16, 24, dtype=F64)))
    x = torch.randn(3, 5, 16, dtype=F64)
    with distiller.distilling(x) as kd:
        student(x)
    seen = {}
    assert distiller.teacher_capture.capture_values and distiller.student_capture.capture_values
    capture_t, capture_s = RecorderCapture(teacher, capture_values=True), RecorderCapture(student, capture_values=True)
    with capture_t.recording(), torch.no_grad():
        teacher(x @ torch.ones(16, 24, dtype=F64))
    with capture_s.recording():
        student(x)
    for name, capture in (("t", capture_t.records["1"]), ("s", capture_s.records["0"])):
        seen[name] = {"q": capture.q, "k": capture.k, "v": capture.v}
    ref = paper_loss(seen["t"], seen["s"], 4, torch.ones(3, 5, dtype=torch.bool))
    torch.testing.assert_close(kd.loss, ref["total"], rtol=1e-10, atol=1e-12)
    kd.loss.backward()
    assert student[0].qkv.weight.grad is not None and not any(p.requires_grad for p in teacher.parameters())


def test_the_mha_capture_projects_values_when_a_pair_needs_them():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(12, 3, batch_first=True).to(F64)
    capture = MultiheadAttentionCapture(mha, capture_values=True)
    x = torch.randn(2, 5, 12, dtype=F64)
    with capture.recording():
        mha(x, x, x)
    v = capture.pop()[""].v
    w_v, b_v = mha.in_proj_weight.chunk(3)[2], mha.in_proj_bias.chunk(3)[2]
    torch.testing.assert_close(v, (x @ w_v.T + b_v).view(2, 5, 3, 4).transpose(1, 2))
    assert MultiheadAttentionCapture(mha).capture_values is False  # values cost a projection: only when asked

    def encoder(dim, heads):
        return nn.TransformerEncoder(nn.TransformerEncoderLayer(dim, heads, 2 * dim, batch_first=True, dropout=0.0),
                                     1, enable_nested_tensor=False).to(F64)

    teacher, student = encoder(12, 3), encoder(12, 2)
    distiller = AttentionDistiller(teacher, {"pairs": [[0, 0]], "relations": ["vv"], "relation_heads": 4,
                                             "causal": False}, student=student)
    assert distiller.teacher_capture.capture_values and distiller.student_capture.capture_values
    kd = distiller(x)
    assert kd.requires_grad and float(kd.detach()) > 0


def test_record_v_is_kept_only_by_captures_asked_for_values():
    """record(v=) feeds the same field as the other captures' values, under the same rule: only when asked."""
    layer = RecordingAttention(8, 2).to(F64)
    x = torch.randn(1, 3, 8, dtype=F64)
    for values in (False, True):
        capture = RecorderCapture(layer, capture_values=values)
        with capture.recording():
            layer(x)
        assert (capture.pop()[""].v is not None) is values


def test_the_hf_capture_records_values_for_the_value_relation():
    """A Hugging Face model's values come from its capture (the engine asks for them because a pair compares 'vv'):
    the three relations equal the paper's on the layers' own projections (a hook on BERT's self-attention), with
    padding; a capture made without values fails at the first step with the message."""
    pytest.importorskip("transformers")
    from lightning_streamkl.capture import HFAttentionCapture

    from ._models import tiny_bert, token_batch

    teacher, student = tiny_bert(seed=1, dtype=F64), tiny_bert(heads=2, seed=2, dtype=F64)
    seen = {}

    def keep(side):
        def hook(module, args, kwargs, output):
            hidden = args[0] if args else kwargs["hidden_states"]
            shape = (*hidden.shape[:-1], -1, module.attention_head_size)
            seen[side] = {a: proj(hidden).view(shape).transpose(1, 2).detach()
                          for a, proj in (("q", module.query), ("k", module.key), ("v", module.value))}
        return hook

    for side, model in (("t", teacher), ("s", student)):
        model.encoder.layer[-1].attention.self.register_forward_hook(keep(side), with_kwargs=True)
    distiller = AttentionDistiller(teacher, {"pairs": [[-1, -1]], "relations": ["qq", "kk", "vv"],
                                             "relation_heads": 4}, student=student)
    assert isinstance(distiller.teacher_capture, HFAttentionCapture) and distiller.teacher_capture.capture_values
    batch = token_batch()
    mask = batch["attention_mask"].bool()
    assert not mask.all()
    kd = distiller(batch)
    ref = paper_loss(seen["t"], seen["s"], 4, mask)
    torch.testing.assert_close(kd, ref["total"], rtol=1e-10, atol=1e-12)
    kd.backward()
    assert student.encoder.layer[-1].attention.self.value.weight.grad is not None

    loss = AttentionDistillationLoss({"pairs": [[-1, -1]], "relations": ["vv"], "relation_heads": 4})
    t_cap, s_cap = HFAttentionCapture(teacher), HFAttentionCapture(student)  # no capture_values
    loss.resolve(t_cap, s_cap)
    with torch.no_grad(), t_cap.recording():
        teacher(**batch)
    with torch.no_grad(), s_cap.recording():
        student(**batch)
    with pytest.raises(ValueError, match="'vv' needs the teacher layer's values, but its record holds none"):
        loss(t_cap.pop(), s_cap.pop())
    qk_only = AttentionDistiller(teacher, {"pairs": [[-1, -1]], "relations": ["qq", "kk"], "relation_heads": 4},
                                 student=student)
    assert not qk_only.teacher_capture.capture_values  # values only when a pair compares them


def test_relations_in_the_callback_and_the_mixin():
    def encoder(dim, heads):
        return nn.TransformerEncoder(nn.TransformerEncoderLayer(dim, heads, 2 * dim, batch_first=True, dropout=0.0),
                                     1, enable_nested_tensor=False)

    callback = StreamKLDistillation(encoder(16, 4), pairs=[LayerPair(0, 0, name="last", relations=["qq", "vv"])],
                                    relation_heads=2)
    assert callback.distiller.loss.pair_names == ["last/qq", "last/vv"]
    assert callback.state_key == "StreamKLDistillation{'name': 'attn_kl', 'pairs': ('last/qq', 'last/vv')}"

    class Student(AttentionDistillationMixin, L.LightningModule):
        def __init__(self):
            super().__init__()
            self.encoder = encoder(16, 2)
            self.configure_attention_distillation(encoder(16, 4), pairs=[[0, 0]], relations=["kk", "vv"],
                                                  causal=False)

    student = Student()
    x = torch.randn(2, 5, 16)
    with student.capture_student_attention():
        student.encoder(x)
    loss = student.attention_distillation_loss(x)
    assert loss.requires_grad and sorted(student.train_attention_kl.pair_names) == ["t0_s0/kk", "t0_s0/vv"]
