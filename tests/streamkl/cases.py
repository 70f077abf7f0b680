"""Problem configurations shared by the oracle tests of every backend (reference, Triton)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch


@dataclass(frozen=True)
class Case:
    """One attention-KL problem: shapes, masks and options."""

    b: int = 2
    h: int = 4
    h_kt: int = 4
    h_ks: int = 4
    n_q: int = 33
    n_k: int = 33
    d_t: int = 16
    d_s: int = 16
    causal: bool = False
    key_mask: str = "none"  # "none" | "random" | "empty_batch" (batch row 0 has no real key)
    query_mask: bool = False
    direction: str = "forward"
    temperature: float = 1.0
    sharpness: float = 1.0  # multiplies the queries: x30 gives near one-hot rows
    layout: str = "bhnd"
    teacher_grad: bool = False
    custom_scale: bool = False

    @property
    def id(self) -> str:
        parts = [
            f"B{self.b}-H{self.h}-HKT{self.h_kt}-HKS{self.h_ks}-NQ{self.n_q}-NK{self.n_k}-DT{self.d_t}-DS{self.d_s}",
            "causal" if self.causal else "full",
            self.direction,
        ]
        if self.key_mask != "none":
            parts.append(f"kpm-{self.key_mask}")
        if self.query_mask:
            parts.append("qmask")
        if self.temperature != 1.0:
            parts.append(f"T{self.temperature}")
        if self.sharpness != 1.0:
            parts.append(f"sharp{self.sharpness:g}")
        if self.layout != "bhnd":
            parts.append(self.layout)
        if self.teacher_grad:
            parts.append("tgrad")
        if self.custom_scale:
            parts.append("scale")
        return "-".join(parts)

    def kwargs(self) -> dict:
        kw = dict(causal=self.causal, direction=self.direction, temperature=self.temperature, layout=self.layout)
        if self.custom_scale:
            kw.update(scale_t=0.21, scale_s=0.37)
        return kw


def make_inputs(case: Case, dtype: torch.dtype, device: str = "cpu", generator: torch.Generator | None = None):
    """Random inputs for ``case``: (q_t, k_t, q_s, k_s, key_padding_mask, query_mask) in ``case.layout``."""
    g = generator

    def rand(*shape):
        x = torch.randn(*shape, generator=g, dtype=torch.float64)
        return x

    def arrange(b, h, n, d):
        x = rand(b, h, n, d)
        return x if case.layout == "bhnd" else x.transpose(1, 2).contiguous()

    q_t = arrange(case.b, case.h, case.n_q, case.d_t) * case.sharpness
    k_t = arrange(case.b, case.h_kt, case.n_k, case.d_t)
    q_s = arrange(case.b, case.h, case.n_q, case.d_s) * case.sharpness
    k_s = arrange(case.b, case.h_ks, case.n_k, case.d_s)
    q_t, k_t, q_s, k_s = (x.to(device=device, dtype=dtype) for x in (q_t, k_t, q_s, k_s))
    q_s.requires_grad_(True)
    k_s.requires_grad_(True)
    if case.teacher_grad:
        q_t.requires_grad_(True)
        k_t.requires_grad_(True)
    kpm = None
    if case.key_mask != "none":
        kpm = torch.rand(case.b, case.n_k, generator=g) > 0.3
        if case.key_mask == "empty_batch":
            kpm[0] = False
        kpm = kpm.to(device)
    qm = (torch.rand(case.b, case.n_q, generator=g) > 0.25).to(device) if case.query_mask else None
    return q_t, k_t, q_s, k_s, kpm, qm


def params(cases: list[Case]) -> list:
    """pytest params with readable ids."""
    return [pytest.param(c, id=c.id) for c in cases]


BASE = Case()

#: Dense grid over the contract: odd sizes, D_t != D_s, GQA on either side, masks, directions,
#: temperatures, sharp logits, both layouts, teacher gradients.
ORACLE_CASES: list[Case] = [
    BASE,
    replace(BASE, n_q=1, n_k=1, d_t=8, d_s=8),
    replace(BASE, n_q=7, n_k=7, causal=True),
    replace(BASE, n_q=63, n_k=63, d_t=40, d_s=72, causal=True),
    replace(BASE, n_q=111, n_k=111, d_t=160, d_s=24),
    replace(BASE, n_q=17, n_k=45, causal=True),  # N_q < N_k, bottom-right aligned
    replace(BASE, n_q=45, n_k=17, causal=True),  # N_q > N_k: the first rows have no key
    replace(BASE, h=6, h_kt=2, h_ks=3, d_t=24, d_s=12),  # GQA on both sides, different groupings
    replace(BASE, h=4, h_kt=1, h_ks=4, causal=True, direction="reverse"),  # MQA teacher
    replace(BASE, key_mask="random", query_mask=True),
    replace(BASE, key_mask="empty_batch", causal=True, n_q=29, n_k=31),
    replace(BASE, direction="reverse", key_mask="random", teacher_grad=True),
    replace(BASE, temperature=2.5, custom_scale=True, teacher_grad=True),
    replace(BASE, temperature=0.5, causal=True),
    replace(BASE, sharpness=30.0, causal=True, teacher_grad=True),
    replace(BASE, sharpness=30.0, direction="reverse", key_mask="random"),
    replace(BASE, layout="bnhd", h_kt=2, causal=True, teacher_grad=True),
    replace(BASE, layout="bnhd", direction="reverse", query_mask=True, d_s=40),
    replace(BASE, b=1, h=1, h_kt=1, h_ks=1, n_q=130, n_k=257, d_t=8, d_s=8, causal=True),
]
