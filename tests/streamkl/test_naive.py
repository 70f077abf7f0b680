"""The oracle itself, checked against a scalar row-by-row transcription of the definition."""

from __future__ import annotations

import math

import pytest
import torch

from streamkl import naive_attention_kl


def _loop_kl(q_t, k_t, q_s, k_s, causal, kpm, qm, scale_t, scale_s, reverse):
    """KL per row with Python loops over the allowed keys (no masking tricks, no broadcasting)."""
    b_, h_, n_q, _ = q_t.shape
    n_k = k_t.shape[2]
    out = torch.zeros(b_, h_, n_q, dtype=torch.float64)
    for b in range(b_):
        for h in range(h_):
            kt = k_t[b, h // (h_ // k_t.shape[1])]
            ks = k_s[b, h // (h_ // k_s.shape[1])]
            for i in range(n_q):
                keys = [j for j in range(n_k)
                        if (not causal or j <= i + n_k - n_q) and (kpm is None or kpm[b, j])]
                if not keys or (qm is not None and not qm[b, i]):
                    continue
                a = [float(q_t[b, h, i] @ kt[j]) * scale_t for j in keys]
                s = [float(q_s[b, h, i] @ ks[j]) * scale_s for j in keys]
                if reverse:
                    a, s = s, a
                za, zs = sum(math.exp(x) for x in a), sum(math.exp(y) for y in s)
                out[b, h, i] = sum(math.exp(x) / za * (x - math.log(za) - y + math.log(zs)) for x, y in zip(a, s))
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("reverse", [False, True])
def test_naive_matches_the_definition(causal, reverse):
    q_t, q_s = torch.randn(2, 4, 6, 5, dtype=torch.float64), torch.randn(2, 4, 6, 3, dtype=torch.float64)
    k_t, k_s = torch.randn(2, 2, 9, 5, dtype=torch.float64), torch.randn(2, 1, 9, 3, dtype=torch.float64)
    kpm = torch.rand(2, 9) > 0.4
    kpm[1, :] = False
    kpm[1, 8] = True  # batch 1 has a single real key: causal rows before it are empty
    qm = torch.rand(2, 6) > 0.3
    got = naive_attention_kl(q_t, k_t, q_s, k_s, causal=causal, key_padding_mask=kpm, query_mask=qm,
                             temperature=1.3, direction="reverse" if reverse else "forward", reduction="none")
    want = _loop_kl(q_t, k_t, q_s, k_s, causal, kpm, qm, 1 / math.sqrt(5) / 1.3, 1 / math.sqrt(3) / 1.3, reverse)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_naive_gradients_are_finite_on_empty_rows():
    q = torch.randn(2, 1, 4, 8, dtype=torch.float64, requires_grad=True)
    kpm = torch.tensor([[True, True, False, False], [False, False, False, False]])
    naive_attention_kl(q, q.detach() * 2, q, q.detach(), key_padding_mask=kpm, causal=True).backward()
    assert torch.isfinite(q.grad).all()
    assert torch.all(q.grad[1] == 0)
