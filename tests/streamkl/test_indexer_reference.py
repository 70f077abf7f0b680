"""The oracle and the chunked PyTorch reference of the indexer loss: the definition checked against itself written
another way, and the reference (the CPU backend) against the oracle, in float64 and float32, incl. gradcheck."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from streamkl import indexer_kl, indexer_reference, naive_indexer_kl
from streamkl.indexer_naive import megatron_style_indexer_loss
from tests._helpers import assert_close
from tests.streamkl.indexer_cases import BASE, ORACLE_CASES, IndexerCase, check_against_oracle, make_inputs, params


def _per_row_by_loops(case: IndexerCase, inputs: dict) -> torch.Tensor:
    """The definition row by row with Python loops over the usable keys (sparse: the listed slots)."""
    q, k, q_idx, k_idx, w = (inputs[n].detach().double() for n in ("q", "k", "q_idx", "k_idx", "w_idx"))
    kpm, topk = inputs["key_padding_mask"], inputs["topk_indices"]
    scale = case.scale or case.d ** -0.5
    out = torch.zeros(case.b, case.n_q, dtype=torch.float64)
    for b in range(case.b):
        for t in range(case.n_q):
            keys = range(case.n_k) if topk is None else [int(s) for s in topk[b, t] if s >= 0]
            keys = [s for s in keys if (not case.causal or s <= t + case.n_k - case.n_q)
                    and (kpm is None or bool(kpm[b, s]))]
            if not keys:
                continue
            ks = torch.tensor(keys)
            p = sum(torch.softmax(scale * k[b, h // (case.h // case.h_kv), ks] @ q[b, h, t], 0)
                    for h in range(case.h)) / case.h
            logits = (torch.relu(k_idx[b, ks] @ q_idx[b, :, t].T) * w[b, t]).sum(1)
            out[b, t] = (p * (p.log() - torch.log_softmax(logits, 0))).sum()
    return out


@pytest.mark.parametrize("case", params([BASE, replace(BASE, n_q=9, n_k=13, topk=6, key_mask="random", h_kv=1),
                                         replace(BASE, n_q=7, n_k=7, topk=9, causal=False, key_mask="empty_batch")]))
def test_oracle_is_the_definition(case):
    inputs = make_inputs(case, torch.float64)
    got = naive_indexer_kl(**inputs, reduction="none", **case.kwargs())
    assert_close(got, _per_row_by_loops(case, inputs), 1e-12, "kl")


def test_oracle_is_zero_when_the_indexer_matches_the_target():
    """One head, one key head, q_idx·k_idx = the main scores (positive by construction), w = 1, H_I = 1."""
    q = torch.rand(1, 1, 6, 4, dtype=torch.float64)
    k = torch.rand(1, 1, 6, 4, dtype=torch.float64)
    loss = naive_indexer_kl(q, k, q.transpose(1, 1), k[:, 0], torch.ones(1, 6, 1, dtype=torch.float64), scale=1.0,
                            reduction="none")
    assert loss.abs().max() < 1e-15


@pytest.mark.parametrize("topk", [None, 3])
def test_megatron_style_baseline_equals_oracle(topk):
    case = replace(BASE, b=1, n_q=11, n_k=11, topk=topk)
    inputs = make_inputs(case, torch.float64)
    if topk is not None:  # the baseline assumes every row keeps a key: put the diagonal into each selection
        inputs["topk_indices"][..., 0] = torch.arange(11)
        inputs["topk_indices"] = torch.where(
            (inputs["topk_indices"] == torch.arange(11)[:, None]) & (torch.arange(3) > 0), -1, inputs["topk_indices"])
    scale = case.d ** -0.5
    base = megatron_style_indexer_loss(*(inputs[n] for n in ("q", "k", "q_idx", "k_idx", "w_idx")), scale=scale,
                                       topk_indices=inputs["topk_indices"])
    ref = naive_indexer_kl(**inputs, scale=scale)
    assert_close(base, ref, 1e-6, "loss")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("case", params(ORACLE_CASES))
def test_reference_matches_oracle(case, dtype):
    check_against_oracle(case, dtype, "reference")


def test_reference_chunks_give_the_same_result(monkeypatch):
    case = replace(BASE, n_q=29, n_k=29, topk=7, key_mask="random")
    inputs = make_inputs(case, torch.float64)
    full = indexer_kl(**inputs, reduction="none", backend="reference")
    monkeypatch.setattr(indexer_reference, "CHUNK_ELEMENTS", 1)  # one row per chunk
    chunked = indexer_kl(**inputs, reduction="none", backend="reference")
    assert_close(chunked, full, 1e-14, "kl")


@pytest.mark.parametrize("case", params([replace(BASE, b=1, n_q=6, n_k=9, h=2, h_kv=1, d=4, h_i=2, d_i=3),
                                         replace(BASE, b=1, n_q=6, n_k=6, h=2, h_kv=2, d=4, h_i=2, d_i=3, topk=4,
                                                 key_mask="random")]))
def test_reference_gradcheck_float64(case):
    inputs = make_inputs(case, torch.float64)
    names = ("q_idx", "k_idx", "w_idx")
    rest = {n: x for n, x in inputs.items() if n not in names}

    def fn(q_idx, k_idx, w_idx):
        return indexer_kl(q_idx=q_idx, k_idx=k_idx, w_idx=w_idx, **rest, reduction="none", backend="reference",
                          **case.kwargs())

    assert torch.autograd.gradcheck(fn, tuple(inputs[n] for n in names))


def test_relu_zero_region_has_zero_derivative():
    """Logits exactly 0 (q_idx ⟂ k_idx) take torch.relu's derivative 0, in every backend."""
    q, k = torch.randn(1, 2, 4, 8, dtype=torch.float64), torch.randn(1, 2, 4, 8, dtype=torch.float64)
    k_idx = torch.zeros(1, 4, 2, dtype=torch.float64)
    k_idx[..., 0] = 1.0
    q_idx = torch.zeros(1, 1, 4, 2, dtype=torch.float64)
    q_idx[..., 1] = 1.0  # every R = q_idx·k_idx = 0
    q_idx.requires_grad_(True)
    w = torch.ones(1, 4, 1, dtype=torch.float64, requires_grad=True)
    for fn in (lambda *a: naive_indexer_kl(*a), lambda *a: indexer_kl(*a, backend="reference")):
        q_idx.grad = w.grad = None
        fn(q, k, q_idx, k_idx, w).backward()
        assert torch.all(q_idx.grad == 0) and torch.all(w.grad == 0)
