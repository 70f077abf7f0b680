"""The module interface computes exactly what the functional op computes."""

import torch

from streamkl import AttentionKLLoss, attention_kl


def test_module_equals_functional():
    q_t, k_t = torch.randn(2, 4, 10, 16), torch.randn(2, 2, 10, 16)
    q_s, k_s = torch.randn(2, 10, 4, 8), torch.randn(2, 10, 1, 8)  # student given in bnhd
    kpm = torch.rand(2, 10) > 0.2
    loss_fn = AttentionKLLoss(causal=True, temperature=2.0, direction="reverse", reduction="sum")
    got = loss_fn(q_t, k_t, q_s.transpose(1, 2), k_s.transpose(1, 2), key_padding_mask=kpm)
    want = attention_kl(q_t, k_t, q_s.transpose(1, 2), k_s.transpose(1, 2), causal=True, temperature=2.0,
                        direction="reverse", reduction="sum", key_padding_mask=kpm)
    assert torch.equal(got, want)
    assert "direction='reverse'" in repr(loss_fn)
