"""nn.MultiheadAttention capture and the manual recorder, against the layers' own attention probabilities."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_streamkl import MultiheadAttentionCapture, RecorderCapture, record
from lightning_streamkl.capture import build_capture
from lightning_streamkl.capture.base import _RECORDING
from streamkl import attention_kl

F64 = torch.float64


def kl_rows(p_t, p_s):
    ratio = torch.where(p_t > 0, torch.log(p_t) - torch.log(p_s.clamp_min(1e-300)), torch.zeros_like(p_t))
    return (p_t * ratio).sum(-1)


def mha_probs(mha, x, **kwargs):
    with torch.no_grad():
        return mha(x, x, x, need_weights=True, average_attn_weights=False, **kwargs)[1]


@pytest.mark.parametrize("batch_first", [True, False])
def test_mha_capture_matches_the_layers_own_probabilities(batch_first):
    torch.manual_seed(0)
    teacher = nn.MultiheadAttention(24, 4, batch_first=batch_first).double()
    student = nn.MultiheadAttention(16, 4, batch_first=batch_first).double()
    nn.init.normal_(teacher.in_proj_weight, std=0.5)
    x_t = torch.randn(2, 9, 24, dtype=F64)
    x_s = torch.randn(2, 9, 16, dtype=F64)
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[1, 6:] = True  # torch convention: True = padding
    causal = torch.ones(9, 9, dtype=torch.bool).triu(1)  # True = masked, like the padding mask
    if not batch_first:
        x_t, x_s = x_t.transpose(0, 1), x_s.transpose(0, 1)

    caps = MultiheadAttentionCapture(teacher), MultiheadAttentionCapture(student)
    for cap, mha, x in zip(caps, (teacher, student), (x_t, x_s)):
        with cap.recording():
            mha(x, x, x, key_padding_mask=pad, attn_mask=causal)
    (t,), (s,) = caps[0].pop().values(), caps[1].pop().values()
    assert t.causal and s.causal and t.exact
    assert torch.equal(t.key_padding_mask, ~pad)

    real = ~pad
    ours = attention_kl(t.q, t.k, s.q, s.k, causal=True, key_padding_mask=t.key_padding_mask, query_mask=real,
                        reduction="none")
    p_t = mha_probs(teacher, x_t, key_padding_mask=pad, attn_mask=causal)
    p_s = mha_probs(student, x_s, key_padding_mask=pad, attn_mask=causal)
    torch.testing.assert_close(ours, kl_rows(p_t, p_s) * real[:, None, :], rtol=1e-9, atol=1e-12)

    # gradients reach the projection weights through the recomputed q/k
    with caps[1].recording():
        student(x_s, x_s, x_s, key_padding_mask=pad, attn_mask=causal)
    s = caps[1].pop()[""]
    attention_kl(t.q, t.k, s.q, s.k, causal=True).backward()
    assert student.in_proj_weight.grad is not None


def test_mha_cross_attention_with_separate_projections():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 2, kdim=12, vdim=12, batch_first=True).double()
    q_in, kv = torch.randn(2, 5, 16, dtype=F64), torch.randn(2, 7, 12, dtype=F64)
    cap = MultiheadAttentionCapture(mha)
    with cap.recording():
        _, p = mha(q_in, kv, kv, need_weights=True, average_attn_weights=False)
    r = cap.pop()[""]
    assert tuple(r.q.shape) == (2, 2, 5, 8) and tuple(r.k.shape) == (2, 2, 7, 8)
    ours = torch.softmax(r.q @ r.k.transpose(-1, -2) / 8**0.5, -1)
    torch.testing.assert_close(ours, p, rtol=1e-9, atol=1e-12)


def test_mha_capture_in_a_transformer_and_flags():
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    cap = MultiheadAttentionCapture(model)
    assert cap.layer_names() == ["layers.0.self_attn", "layers.1.self_attn"]
    cap.select({"layers.1.self_attn"})
    x = torch.randn(2, 5, 16)
    with cap.recording():
        model(x)
    (rec,) = cap.records.values()
    assert list(cap.records) == ["layers.1.self_attn"] and rec.causal is False and rec.exact

    bias = r"'layers.1.self_attn'.*values other than 0 and a masking value.*score bias"
    with pytest.raises(ValueError, match=bias), cap.recording():
        model(x, mask=torch.randn(5, 5))  # an additive mask that is a bias: refused, never approximated
    cap.clear()
    # hooks are removed after recording
    assert all(not m._forward_pre_hooks for m in model.modules())

    biased = MultiheadAttentionCapture(nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(ValueError, match="add_bias_kv/add_zero_attn"), biased.recording():
        pass


class CustomAttention(nn.Module):
    """A hand-written attention that reports its q/k through record()."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.qkv = heads, nn.Linear(dim, 3 * dim)

    def forward(self, x, probs=None):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        record(self, q, k, causal=True)
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        p = torch.softmax((q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5).masked_fill(~mask, -torch.inf), -1)
        if probs is not None:
            probs.append(p)
        return (p @ v).transpose(1, 2).reshape(b, n, d)


def test_recorder_with_module_and_named_records():
    torch.manual_seed(0)
    teacher = nn.Sequential(CustomAttention(16, 2), CustomAttention(16, 2)).double()
    student = nn.Sequential(CustomAttention(8, 2)).double()
    t_cap, s_cap = build_capture(teacher), build_capture(student)
    assert t_cap.kind == s_cap.kind == "recorder"
    x_t, x_s = torch.randn(2, 7, 16, dtype=F64), torch.randn(2, 7, 8, dtype=F64)
    p_t, p_s = [], []
    with t_cap.recording():
        teacher[0](x_t, p_t)
    with s_cap.recording():
        student[0](x_s, p_s)
    t, s = t_cap.records["0"], s_cap.records["0"]
    ours = attention_kl(t.q, t.k, s.q, s.k, causal=bool(t.causal), reduction="none")
    torch.testing.assert_close(ours, kl_rows(p_t[0], p_s[0]), rtol=1e-9, atol=1e-12)

    # a named record goes to every capture that is recording; nothing is kept outside a recording block
    named = RecorderCapture(nn.Identity(), names=["indexer", "main"])
    with named.recording():
        record("indexer", t.q, t.k)
    record("main", t.q, t.k)
    assert list(named.records) == ["indexer"] and not _RECORDING
    assert named.resolve(1) == "main"
    with pytest.raises(ValueError, match=r"Unknown layer: Identity has no attention layer 'mian'.*Closest: \['main'\]"):
        named.resolve("mian")
    with pytest.raises(ValueError, match=r"no attention layers were found in Identity; supported: .*nn.MultiheadAttention"):
        RecorderCapture(nn.Identity()).resolve(0)


def test_recording_is_released_on_error():
    cap = RecorderCapture(nn.Identity(), names=["a"])
    with pytest.raises(RuntimeError, match="boom"), cap.recording():
        record("a", torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))
        raise RuntimeError("boom")
    assert not cap.is_recording and not _RECORDING
