"""Problem configurations shared by the oracle tests of every backend (reference, Triton)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
import torch


@dataclass(frozen=True)
class Case:
    """One attention-KL problem: shapes, masks and options.

    ``seqlens`` makes it a packed problem (layout "thd"): one sequence per entry, ``b`` and ``n_q``/``n_k`` are
    then unused (``seqlens_k`` defaults to ``seqlens``).
    """

    b: int = 2
    h: int = 4
    h_kt: int = 4
    h_ks: int = 4
    n_q: int = 33
    n_k: int = 33
    d_t: int = 16
    d_s: int = 16
    causal: bool = False
    key_mask: str = "none"  # "none" | "random" | "empty_batch" (batch row 0 has no real key) | "padded" (see spans)
    query_mask: bool = False
    direction: str = "forward"
    temperature: float = 1.0
    sharpness: float = 1.0  # multiplies the queries: x30 gives near one-hot rows
    layout: str = "bhnd"
    teacher_grad: bool = False
    custom_scale: bool = False
    window: tuple[int, int] | None = None
    softcap_t: float | None = None
    softcap_s: float | None = None
    sinks: bool = False
    seqlens: tuple[int, ...] | None = None
    seqlens_k: tuple[int, ...] | None = None
    attn_mask: str = "none"  # "none" | "prefix" (prefix-LM, per batch row) | "random" (per batch row and head)

    @property
    def packed(self) -> bool:
        return self.seqlens is not None

    @property
    def id(self) -> str:
        if self.packed:
            lens = "_".join(map(str, self.seqlens))
            if self.seqlens_k is not None:
                lens += "-K" + "_".join(map(str, self.seqlens_k))
            shape = f"packed{lens}-H{self.h}-HKT{self.h_kt}-HKS{self.h_ks}-DT{self.d_t}-DS{self.d_s}"
        else:
            shape = f"B{self.b}-H{self.h}-HKT{self.h_kt}-HKS{self.h_ks}-NQ{self.n_q}-NK{self.n_k}-DT{self.d_t}-DS{self.d_s}"
        parts = [shape, "causal" if self.causal else "full", self.direction]
        if self.key_mask != "none":
            parts.append(f"kpm-{self.key_mask}")
        if self.query_mask:
            parts.append("qmask")
        if self.temperature != 1.0:
            parts.append(f"T{self.temperature}")
        if self.sharpness != 1.0:
            parts.append(f"sharp{self.sharpness:g}")
        if self.layout not in ("bhnd", "thd"):
            parts.append(self.layout)
        if self.teacher_grad:
            parts.append("tgrad")
        if self.custom_scale:
            parts.append("scale")
        if self.window is not None:
            parts.append(f"win{self.window[0]}_{self.window[1]}")
        if self.softcap_t is not None or self.softcap_s is not None:
            parts.append(f"cap{self.softcap_t}_{self.softcap_s}")
        if self.sinks:
            parts.append("sinks")
        if self.attn_mask != "none":
            parts.append(f"mask-{self.attn_mask}")
        return "-".join(parts)

    def kwargs(self) -> dict:
        """The options of the call (everything but the tensors)."""
        kw = dict(causal=self.causal, direction=self.direction, temperature=self.temperature,
                  layout="thd" if self.packed else self.layout)
        if self.custom_scale:
            kw.update(scale_t=0.21, scale_s=0.37)
        if self.window is not None:
            kw["window"] = self.window
        if self.softcap_t is not None:
            kw["softcap_t"] = self.softcap_t
        if self.softcap_s is not None:
            kw["softcap_s"] = self.softcap_s
        return kw


@dataclass
class Inputs:
    """Tensors of one call: the differentiable ones (``tensors``) and the masks/offsets (``extras``)."""

    tensors: dict[str, torch.Tensor]
    extras: dict = field(default_factory=dict)

    def __iter__(self):  # q_t, k_t, q_s, k_s, key_padding_mask, query_mask (the dense tests' unpacking)
        t, e = self.tensors, self.extras
        return iter((t["q_t"], t["k_t"], t["q_s"], t["k_s"], e.get("key_padding_mask"), e.get("query_mask")))

    def call(self, fn, **kwargs):
        return fn(**self.tensors, **self.extras, **kwargs)

    def float64_copies(self) -> dict[str, torch.Tensor]:
        """The same (rounded) tensors upcast to float64, as new leaves that require grad where these do."""
        return {n: x.detach().double().requires_grad_(x.requires_grad) for n, x in self.tensors.items()}


def make_inputs(case: Case, dtype: torch.dtype, device: str = "cpu", generator: torch.Generator | None = None
                ) -> Inputs:
    """Random inputs for ``case`` in its layout (drawn in float64, then rounded to ``dtype``)."""
    g = generator

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    def arrange(h, n, d):
        if case.packed:
            return rand(n, h, d)
        x = rand(case.b, h, n, d)
        return x if case.layout == "bhnd" else x.transpose(1, 2).contiguous()

    n_q = sum(case.seqlens) if case.packed else case.n_q
    n_k = sum(case.seqlens_k or case.seqlens) if case.packed else case.n_k
    tensors = {
        "q_t": arrange(case.h, n_q, case.d_t) * case.sharpness,
        "k_t": arrange(case.h_kt, n_k, case.d_t),
        "q_s": arrange(case.h, n_q, case.d_s) * case.sharpness,
        "k_s": arrange(case.h_ks, n_k, case.d_s),
    }
    if case.sinks:
        tensors["sinks_t"] = rand(case.h) * 2
        tensors["sinks_s"] = rand(case.h) * 2
    tensors = {n: x.to(device=device, dtype=dtype if not n.startswith("sinks") else torch.float32 if dtype !=
                        torch.float64 else torch.float64) for n, x in tensors.items()}
    for name in ("q_s", "k_s", "sinks_s"):
        if name in tensors:
            tensors[name].requires_grad_(True)
    if case.teacher_grad:
        for name in ("q_t", "k_t", "sinks_t"):
            if name in tensors:
                tensors[name].requires_grad_(True)
    extras = {}
    if case.packed:
        def offsets(lens):
            return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)

        extras["cu_seqlens_q"] = offsets(case.seqlens)
        extras["cu_seqlens_k"] = offsets(case.seqlens_k or case.seqlens)
    if case.key_mask == "padded":  # whole tiles of padding: row 0 right-padded to 30%, row 1 left-padded to 40%
        extras["key_padding_mask"] = padded_spans(case.b, case.n_k, ((0.0, 0.3), (0.6, 1.0))).to(device)
    elif case.key_mask != "none":
        kpm = torch.rand(case.b, case.n_k, generator=g) > 0.3
        if case.key_mask == "empty_batch":
            kpm[0] = False
        extras["key_padding_mask"] = kpm.to(device)
    if case.query_mask and case.key_mask == "padded":  # real queries: row 0's first half, row 1 from 55% on
        extras["query_mask"] = padded_spans(case.b, case.n_q, ((0.0, 0.5), (0.55, 1.0))).to(device)
    elif case.query_mask:
        extras["query_mask"] = (torch.rand(case.b, case.n_q, generator=g) > 0.25).to(device)
    if case.attn_mask == "prefix":  # prefix-LM: bidirectional over a per-row prefix, causal after it
        prefix = torch.randint(0, case.n_k + 1, (case.b, 1, 1, 1), generator=g)
        rows = torch.arange(case.n_q)[:, None] + (case.n_k - case.n_q)
        cols = torch.arange(case.n_k)[None, :]
        extras["attn_mask"] = ((cols < prefix) | (cols <= rows)).to(device)
    elif case.attn_mask == "random":
        extras["attn_mask"] = (torch.rand(case.b, case.h, case.n_q, case.n_k, generator=g) > 0.4).to(device)
    return Inputs(tensors, extras)


def padded_spans(batch: int, n: int, spans: tuple[tuple[float, float], ...]) -> torch.Tensor:
    """``[batch, n]`` bool: row ``r`` keeps the positions of ``spans[r % len(spans)]`` (fractions of ``n``)."""
    idx = torch.arange(n)
    rows = [(idx >= int(a * n)) & (idx < int(b * n)) for a, b in (spans[r % len(spans)] for r in range(batch))]
    return torch.stack(rows)


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
    # padded batches whose padding fills whole tiles, which the kernels skip
    replace(BASE, n_q=96, n_k=96, key_mask="padded", query_mask=True, causal=True),
    replace(BASE, n_q=96, n_k=96, key_mask="padded", h_ks=2, window=(20, 8)),
    replace(BASE, n_q=96, n_k=96, key_mask="padded", query_mask=True, direction="reverse", teacher_grad=True),
]

#: The options real teachers use (issue "real-teacher options"): sliding windows, soft-capping, sinks, packed
#: sequences, alone and together, with every other option of the contract mixed in.
REAL_TEACHER_CASES: list[Case] = [
    replace(BASE, window=(5, 3)),  # band on both sides, no causal
    replace(BASE, n_q=45, n_k=45, causal=True, window=(7, -1)),  # Mistral-style: causal + left window
    replace(BASE, n_q=20, n_k=37, causal=True, window=(4, 2), direction="reverse"),  # N_q < N_k; causal wins
    replace(BASE, n_q=37, n_k=20, window=(-1, 3)),  # right bound only, N_q > N_k: early rows see few keys
    replace(BASE, n_q=40, n_k=40, window=(0, 0), key_mask="random"),  # each row sees one key (or none)
    replace(BASE, causal=True, softcap_t=3.0, teacher_grad=True, sharpness=4.0),  # Gemma-2-style teacher
    replace(BASE, softcap_t=2.0, softcap_s=1.5, direction="reverse", temperature=2.0, teacher_grad=True),
    replace(BASE, causal=True, sinks=True),  # gpt-oss-style sinks
    replace(BASE, sinks=True, teacher_grad=True, direction="reverse", key_mask="empty_batch", temperature=0.7),
    replace(BASE, h=6, h_kt=2, h_ks=3, sinks=True, softcap_s=2.5, window=(6, 6), query_mask=True),
    replace(BASE, seqlens=(13, 0, 29, 1, 17), causal=True),  # packed, with an empty and a 1-token document
    replace(BASE, seqlens=(9, 21), seqlens_k=(15, 30), causal=True, h_kt=2, teacher_grad=True),  # N_q != N_k
    replace(BASE, seqlens=(25, 18, 31), causal=True, window=(6, -1), softcap_t=2.0, sinks=True,
            teacher_grad=True, d_t=24, d_s=12, h=4, h_kt=1, h_ks=2),  # everything together
    replace(BASE, seqlens=(40,), direction="reverse", window=(3, 3), softcap_s=1.0, sinks=True),
    replace(BASE, n_q=37, n_k=37, attn_mask="prefix", teacher_grad=True),  # a prefix-LM mask (general attn_mask)
    replace(BASE, n_q=29, n_k=35, attn_mask="random", key_mask="random", window=(9, 4), sinks=True,
            direction="reverse", teacher_grad=True),  # a general per-head mask with everything else
]
