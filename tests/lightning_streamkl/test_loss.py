"""Layer-pair loss assembly: row counting, per-pair options, masks, dtypes and errors."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from lightning_streamkl import AttentionDistillationLoss, LayerPair, RecorderCapture
from lightning_streamkl.capture import CapturedAttention
from lightning_streamkl.terms import count_rows
from streamkl import attention_kl


def qk(b=2, h=4, h_k=2, n_q=6, n_k=6, d=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, n_q, d, generator=g).to(dtype), torch.randn(b, h_k, n_k, d, generator=g).to(dtype))


@pytest.mark.parametrize(("causal", "n_q", "n_k", "masks"), list(itertools.product(
    [False, True], [1, 5, 8], [3, 8], ["none", "keys", "both"])))
def test_count_rows_is_the_ops_mean_denominator(causal, n_q, n_k, masks):
    q_t, k_t = qk(n_q=n_q, n_k=n_k, seed=1)
    q_s, k_s = qk(n_q=n_q, n_k=n_k, seed=2)
    kpm = torch.rand(2, n_k) > 0.4 if masks != "none" else None
    qm = torch.rand(2, n_q) > 0.3 if masks == "both" else None
    kw = dict(causal=causal, key_padding_mask=kpm, query_mask=qm)
    total = attention_kl(q_t, k_t, q_s, k_s, reduction="sum", **kw)
    mean = attention_kl(q_t, k_t, q_s, k_s, reduction="mean", **kw)
    rows = count_rows(2, 4, n_q, n_k, device=torch.device("cpu"), **kw)
    torch.testing.assert_close(total / rows.clamp_min(1), mean)


def records(**named):
    return {k: CapturedAttention(*v[:2], causal=v[2] if len(v) > 2 else True) for k, v in named.items()}


def test_per_pair_options_and_weights():
    t = records(a=(*qk(seed=1), True), b=(*qk(seed=2), True))
    s = records(x=(*qk(seed=3), True), y=(*qk(seed=4), True))
    loss = AttentionDistillationLoss({
        "pairs": [LayerPair("a", "x", weight=2.0, temperature=3.0, name="p"),
                  LayerPair("b", "y", direction="reverse", causal=False, name="q")],
        "temperature": 1.5,
    })
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    out = loss(t, s, key_padding_mask=mask, query_mask=mask)
    p = attention_kl(t["a"].q, t["a"].k, s["x"].q, s["x"].k, causal=True, temperature=3.0,
                     key_padding_mask=mask, query_mask=mask)
    q = attention_kl(t["b"].q, t["b"].k, s["y"].q, s["y"].k, causal=False, temperature=1.5, direction="reverse",
                     key_padding_mask=mask, query_mask=mask)
    torch.testing.assert_close(out.per_pair["p"], p)
    torch.testing.assert_close(out.per_pair["q"], q)
    torch.testing.assert_close(out.total, 2.0 * p + q)
    assert out.rows.tolist() == [40.0, 40.0]


def test_layer_masks_combine_with_each_other():
    q, k = qk(b=1, h=2, h_k=2, n_q=4, n_k=4)
    pad_t = torch.tensor([[True, True, True, False]])
    pad_s = torch.tensor([[False, True, True, True]])
    t = {"a": CapturedAttention(q, k, causal=False, key_padding_mask=pad_t)}
    s = {"b": CapturedAttention(q.flip(-1), k, causal=False, key_padding_mask=pad_s)}
    out = AttentionDistillationLoss({"pairs": [["a", "b"]]})(t, s, key_padding_mask=torch.ones(1, 4, dtype=torch.bool))
    expected = attention_kl(q, k, q.flip(-1), k, key_padding_mask=pad_t & pad_s)
    torch.testing.assert_close(out.per_pair["ta_sb"], expected)


def test_mixed_dtypes_under_autocast():
    q_t, k_t = qk(dtype=torch.bfloat16)
    q_s, k_s = qk(seed=3)
    q_s.requires_grad_(True)
    loss = AttentionDistillationLoss({"pairs": [["a", "b"]]})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = loss(records(a=(q_t, k_t.float())), records(b=(q_s, k_s)))  # teacher k in another dtype than q
    out.total.backward()
    assert out.total.dtype == torch.float32 and q_s.grad is not None
    torch.testing.assert_close(out.total, attention_kl(q_t, k_t, q_s, k_s, causal=True))


def test_errors_name_the_pair_and_what_is_wrong():
    loss = AttentionDistillationLoss({"pairs": [{"teacher": "a", "student": "b", "name": "p"}]})
    q, k = qk()
    with pytest.raises(RuntimeError, match=r"the student layer 'b' was not recorded .*recorded: \['bb'\]\).*Closest"):
        loss(records(a=(q, k)), records(bb=(q, k)))
    with pytest.raises(ValueError, match="the teacher layer is causal but the student layer is bidirectional"):
        loss(records(a=(q, k, True)), records(b=(q, k, False)))
    with pytest.raises(ValueError, match="neither capture knows whether the layers are causal"):
        loss(records(a=(q, k, None)), records(b=(q, k, None)))
    q3, k3 = qk(h=3, h_k=3)
    with pytest.raises(ValueError, match="teacher layer has 4 query heads and the student layer 3"):
        loss(records(a=(q, k)), records(b=(q3, k3)))
    grouped = AttentionDistillationLoss({"pairs": [["a", "b"]], "head_map": "group"})
    with pytest.raises(ValueError, match="head_map='group' needs one head count to be a multiple of the other"):
        grouped(records(a=(q, k)), records(b=(q3, k3)))
    with pytest.raises(ValueError, match=r"padding mask has shape \(2, 5\), but the layers have B=2 and N_k=6"):
        loss(records(a=(q, k)), records(b=(q, k)), key_padding_mask=torch.ones(2, 5, dtype=torch.bool))


def test_inexact_records_are_refused():
    """A record its adapter marked inexact would give a KL that is not the layers' own: the pair is refused."""
    q, k = qk()
    t = {"a": CapturedAttention(q, k, causal=True, exact=False, note="a relative position bias")}
    loss = AttentionDistillationLoss({"pairs": [["a", "b"]]})
    with pytest.raises(ValueError, match=r"teacher layer was recorded as inexact \(a relative position bias\)"):
        loss(t, records(b=(q, k)))


def test_resolve_selects_only_paired_layers():
    teacher = RecorderCapture(nn.Identity(), names=["l0", "l1", "l2"])
    student = RecorderCapture(nn.Identity(), names=["s0", "s1"])
    loss = AttentionDistillationLoss({"pairs": [[-1, -1], [0, 0]]})
    assert loss.resolve(teacher, student) == [("l2", "s1"), ("l0", "s0")]
    assert teacher.selected == {"l0", "l2"} and student.selected == {"s0", "s1"}
