"""Indexer-loss problems shared by the oracle comparisons of every backend (reference, Triton on CPU and GPU)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from streamkl import indexer_kl, naive_indexer_kl
from streamkl.indexer import prepare_indexer_problem
from streamkl.indexer_naive import allowed_pairs
from tests._helpers import assert_close

#: Relative L2 tolerances (forward, gradients) against the float64 oracle, per input dtype.
TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2e-2, 2e-2),
}


@dataclass(frozen=True)
class IndexerCase:
    """One indexer-loss problem: shapes, masks, stage and options."""

    b: int = 2
    h: int = 4
    h_kv: int = 2
    n_q: int = 33
    n_k: int = 33
    d: int = 16
    h_i: int = 3
    d_i: int = 20
    causal: bool = True
    key_mask: str = "none"  # "none" | "random" | "empty_batch" (batch row 0 has no real key)
    topk: int | None = None  # K slots per row (sparse stage), None = dense
    lse: bool = False  # pass the main attention's exact lse instead of letting the op compute it
    layout: str = "bhnd"
    scale: float | None = None
    sharpness: float = 1.0  # multiplies q: large values make peaked targets

    @property
    def id(self) -> str:
        parts = [f"B{self.b}-H{self.h}-HKV{self.h_kv}-NQ{self.n_q}-NK{self.n_k}-D{self.d}-HI{self.h_i}-DI{self.d_i}",
                 "causal" if self.causal else "full"]
        if self.key_mask != "none":
            parts.append(f"kpm-{self.key_mask}")
        if self.topk is not None:
            parts.append(f"topk{self.topk}")
        if self.lse:
            parts.append("lse")
        if self.layout != "bhnd":
            parts.append(self.layout)
        if self.scale is not None:
            parts.append(f"scale{self.scale}")
        if self.sharpness != 1.0:
            parts.append(f"sharp{self.sharpness}")
        return "-".join(parts)

    def kwargs(self) -> dict:
        return dict(causal=self.causal, scale=self.scale, layout=self.layout)


BASE = IndexerCase()
#: Shapes incl. odd N, D != D_I, GQA/MQA/MHA, masks (causal, padding, fully masked rows), dense and sparse stage
#: (with -1 slots and K > usable keys), with/without lse, both layouts.
ORACLE_CASES = [
    BASE,
    replace(BASE, n_q=1, n_k=1, b=1),
    replace(BASE, n_q=7, n_k=7, h=3, h_kv=3, causal=False),
    replace(BASE, n_q=63, n_k=63, h=2, h_kv=1, d=24, d_i=8, key_mask="random"),
    replace(BASE, n_q=17, n_k=45, h_kv=1, key_mask="empty_batch"),
    replace(BASE, n_q=40, n_k=23, causal=True, lse=True, layout="bnhd", scale=0.2),
    replace(BASE, topk=8),
    replace(BASE, n_q=7, n_k=7, topk=12, key_mask="random", h_kv=4),
    replace(BASE, b=1, n_q=63, n_k=63, h=2, h_kv=1, topk=20, lse=True, causal=False, d=40, d_i=12),
    replace(BASE, n_q=20, n_k=31, topk=5, key_mask="empty_batch", layout="bnhd", sharpness=4.0),
]


def params(cases):
    return [pytest.param(c, id=c.id) for c in cases]


def make_topk(case: IndexerCase, device) -> torch.Tensor:
    """``[B, N_q, K]`` int64: distinct random keys (some in the causal future), about 20% of slots ``-1``, and
    ``-1`` padding when ``K > N_k``."""
    k_slots = case.topk
    rows = []
    for _ in range(case.b * case.n_q):
        keys = torch.randperm(case.n_k)[:k_slots]
        keys = torch.where(torch.rand(keys.shape) < 0.2, -1, keys)
        row = torch.full((k_slots,), -1, dtype=torch.long)
        row[: keys.numel()] = keys
        rows.append(row[torch.randperm(k_slots)])
    return torch.stack(rows).view(case.b, case.n_q, k_slots).to(device)


def make_inputs(case: IndexerCase, dtype: torch.dtype, device="cpu") -> dict:
    """Leaf tensors (the indexer's require grad), masks, the selection and, with ``case.lse``, the exact lse."""
    q = torch.randn(case.b, case.h, case.n_q, case.d) * case.sharpness
    k = torch.randn(case.b, case.h_kv, case.n_k, case.d)
    q_idx = torch.randn(case.b, case.h_i, case.n_q, case.d_i) * 0.5
    k_idx = torch.randn(case.b, case.n_k, case.d_i) * 0.5
    w_idx = torch.randn(case.b, case.n_q, case.h_i)
    if case.layout == "bnhd":
        q, k, q_idx = (x.transpose(1, 2).contiguous() for x in (q, k, q_idx))
    out = dict(q=q, k=k, q_idx=q_idx, k_idx=k_idx, w_idx=w_idx)
    out = {n: x.to(device=device, dtype=dtype) for n, x in out.items()}
    for n in ("q_idx", "k_idx", "w_idx"):
        out[n].requires_grad_(True)
    kpm = None
    if case.key_mask != "none":
        kpm = torch.rand(case.b, case.n_k) > 0.3
        if case.key_mask == "empty_batch":
            kpm[0] = False
        kpm = kpm.to(device)
    out["key_padding_mask"] = kpm
    out["topk_indices"] = None if case.topk is None else make_topk(case, device)
    out["lse"] = exact_lse(case, out) if case.lse else None
    return out


def exact_lse(case: IndexerCase, inputs: dict) -> torch.Tensor:
    """The main attention's per-head log-sum-exp ``[B, H, N_q]`` over the usable (and selected) keys, in float64."""
    problem = prepare_indexer_problem(
        *(inputs[n].detach().double() for n in ("q", "k", "q_idx", "k_idx", "w_idx")), lse=None,
        topk_indices=inputs["topk_indices"], key_padding_mask=inputs["key_padding_mask"], reduction="none",
        check_indices=True, **case.kwargs(),
    )
    k = problem.k.repeat_interleave(problem.heads // problem.k.shape[1], dim=1)
    scores = problem.q @ k.transpose(-1, -2) * problem.scale
    return torch.logsumexp(scores.masked_fill(~allowed_pairs(problem)[:, None], float("-inf")), dim=-1)


def oracle(case: IndexerCase, inputs: dict, reduction: str = "none"):
    """float64 oracle on the same (rounded) inputs; the indexer's copies are fresh leaves that require grad."""
    ref = {n: x.detach().double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
           for n, x in inputs.items()}
    for n in ("q_idx", "k_idx", "w_idx"):
        ref[n].requires_grad_(True)
    return naive_indexer_kl(**ref, reduction=reduction, compute_dtype=torch.float64, **case.kwargs()), ref


def counted_rows(case: IndexerCase, inputs: dict) -> torch.Tensor:
    """``[B, N_q]`` bool: rows with at least one usable key."""
    problem = prepare_indexer_problem(
        *(inputs[n].detach() for n in ("q", "k", "q_idx", "k_idx", "w_idx")), lse=None,
        topk_indices=inputs["topk_indices"], key_padding_mask=inputs["key_padding_mask"], reduction="none",
        check_indices=False, **case.kwargs(),
    )
    return allowed_pairs(problem).any(-1)


def check_against_oracle(case: IndexerCase, dtype: torch.dtype, backend: str, device="cpu",
                         reduction_checks: bool = True, tolerances: tuple[float, float] | None = None) -> None:
    """Per-row forward, reductions and the three gradients of ``backend`` vs the float64 oracle; rows without a
    usable key are exactly 0."""
    rtol_fwd, rtol_grad = tolerances or TOLERANCES[dtype]
    inputs = make_inputs(case, dtype, device)
    out = indexer_kl(**inputs, reduction="none", backend=backend, **case.kwargs())
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert out.shape == (case.b, case.n_q)
    grad_out = torch.randn(out.shape, dtype=torch.float64, device=device)
    (out * grad_out.to(out.dtype)).sum().backward()
    ref, ref_inputs = oracle(case, inputs)
    (ref * grad_out).sum().backward()
    assert_close(out, ref, rtol_fwd, "kl")
    empty = ~counted_rows(case, inputs)
    assert torch.all(out.detach()[empty] == 0), "rows without a usable key must be exactly 0"
    for n in ("q_idx", "k_idx", "w_idx"):
        x = inputs[n]
        assert x.grad is not None and x.grad.dtype == x.dtype and x.grad.shape == x.shape, n
        assert_close(x.grad, ref_inputs[n].grad, rtol_grad, f"d{n}")
    for n in ("q", "k"):
        assert inputs[n].grad is None
    if reduction_checks:
        detached = {n: x.detach() if isinstance(x, torch.Tensor) else x for n, x in inputs.items()}
        for reduction in ("sum", "mean"):
            val = indexer_kl(**detached, reduction=reduction, backend=backend, **case.kwargs())
            expect, _ = oracle(case, inputs, reduction)
            assert val.shape == ()
            assert_close(val, expect, rtol_fwd, reduction)
