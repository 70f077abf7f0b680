"""
Running the loss's terms
^^^^^^^^^^^^^^^^^^^^^^^^

Each attention-KL term of :class:`~lightning_streamkl.AttentionDistillationLoss` (a layer pair, or one relation of
it) becomes a :class:`TermCall`: the four tensors, their mask and the term's
:class:`~streamkl.options.AttentionKLOptions`. :func:`run_terms` runs them; every call returns the KL and the rows it
counted (``return_count=True``), so the mean's denominator comes from the op. Terms that are launch-bound (at most
:data:`FUSE_MAX_SCORES` score elements, BERT-sized layers) and share every option, shape and mask run as **one** call
on their heads concatenated (``torch.cat`` along the head dimension; the op treats every head as its own problem): a
student with twelve paired layers at ``N = 512`` pays the op's host overhead once per step instead of twelve times.
Larger terms run one by one: there the GPU work dominates and the concatenated copies would cost memory; for the same
reason a group concatenates at most :data:`FUSE_MAX_BYTES` of queries and keys per call. :func:`count_rows` counts
the same rows from the masks alone (the indexer loss's denominator).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from streamkl import attention_kl
from streamkl.dispatch import select_backend
from streamkl.options import AttentionKLOptions
from streamkl.precision import product_precision

from .capture.masks import Masking, PackedSequences, dense_allowed

__all__ = ["FUSE_MAX_BYTES", "FUSE_MAX_SCORES", "TermCall", "TermResult", "count_rows", "run_terms"]

#: Terms with at most this many score elements (``B · H · N_q · N_k``) are fused with terms like them. Below it one
#: call's GPU time (about 1 ms forward+backward at 2^27 scores on an H100, D = 64) is comparable with its host time,
#: so calls are launch-bound.
FUSE_MAX_SCORES = 1 << 27
#: At most this many bytes of queries and keys (both sides) are concatenated into one call; a larger group runs as
#: several calls. The copies are kept for the backward (the student's next to its own), so this bounds the extra
#: memory at large batch sizes and many pairs (twelve BERT-base pairs at B = 8, N = 512 hold 288 MiB in bf16: one
#: call).
FUSE_MAX_BYTES = 1 << 30


def count_rows(batch: int, heads: int, n_q: int, n_k: int, *, causal: bool, device: torch.device,
               key_padding_mask: torch.Tensor | None = None, query_mask: torch.Tensor | None = None,
               window: tuple[int, int] | None = None, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The number of query rows :func:`streamkl.attention_kl` averages over with ``reduction="mean"``, from the masks
    alone (the op returns the rows it counted with ``return_count=True``; the indexer loss, which is no call of it,
    counts its rows here).

    A row counts when it has at least one allowed key (causal: key ``j <= i + N_k - N_q``; inside the ``window``; real
    per ``key_padding_mask``; allowed by ``attn_mask``) and ``query_mask`` keeps it; every head counts it (a per-head
    ``attn_mask`` counts per head). Returns a float32 scalar tensor.

    Example:
        >>> pad = torch.tensor([[True, True, False]])
        >>> count_rows(1, 2, 3, 3, causal=True, device=torch.device("cpu"), key_padding_mask=pad)
        tensor(6.)
        >>> count_rows(1, 2, 2, 3, causal=True, device=torch.device("cpu"), query_mask=torch.tensor([[False, True]]))
        tensor(2.)
        >>> count_rows(1, 1, 3, 3, causal=True, device=torch.device("cpu"), window=(0, 0),
        ...            key_padding_mask=torch.tensor([[True, False, True]]))
        tensor(2.)
    """
    if attn_mask is not None:
        masking = Masking(causal, window, key_padding_mask, query_mask, None, attn_mask.to(device))
        rows = dense_allowed(masking, batch, n_q, n_k, device).any(-1)  # [B, H or 1, N_q]
        return rows.sum().to(torch.float32) * (heads if rows.shape[1] == 1 else 1)
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    if key_padding_mask is None and query_mask is None:
        # every key in [max(a - left, 0), min(a + right, N_k - 1)] is real for the aligned position a = i + N_k - N_q,
        # so a row counts iff that range is not empty: N_k > 0 and a >= -right (a <= N_k - 1 + left always holds).
        # Counted on the host: one fill instead of a dozen small kernels.
        first = n_k - n_q if right < 0 else max(n_k - n_q, -right)
        rows_per_head = max(n_k - first, 0) if n_k > 0 else 0
        return torch.full((), float(batch * heads * min(rows_per_head, n_q)), dtype=torch.float32, device=device)
    aligned = torch.arange(n_q, device=device) + (n_k - n_q)
    lo = (aligned - left).clamp_min(0) if left >= 0 else torch.zeros_like(aligned)
    hi = (aligned + right).clamp_max(n_k - 1) if right >= 0 else torch.full_like(aligned, n_k - 1)
    if key_padding_mask is None:
        real = (hi - lo + 1).expand(batch, n_q)
    else:
        cum = torch.nn.functional.pad(key_padding_mask.to(device=device, dtype=torch.long).cumsum(-1), (1, 0))
        real = torch.gather(cum, 1, (hi + 1).clamp(0, n_k).expand(batch, n_q)) - \
            torch.gather(cum, 1, lo.clamp(0, n_k).expand(batch, n_q))
    valid = (real > 0) & (hi >= lo)
    if query_mask is not None:
        valid = valid & query_mask.to(device=device, dtype=torch.bool)
    return valid.sum().to(torch.float32) * heads


@dataclass
class TermCall:
    """One attention-KL term, ready to run: ``attention_kl(q_t, k_t, q_s, k_s, ...)`` under ``masking``.

    Attributes:
        q_t, k_t, q_s, k_s: ``[B, H, N_q, D_t]``, ``[B, H_kt, N_k, D_t]`` and the student's analogues (heads
            already mapped, dtypes matched per side).
        masking: the pair's one mask (causal, window, padding, query mask, packed sequences, general mask).
        sinks_t, sinks_s: ``[H]`` sink logits per side, or None.
        options: the term's :class:`~streamkl.options.AttentionKLOptions`: ``scale_t``, ``scale_s``, ``softcap_t``,
            ``softcap_s``, ``temperature``, ``direction``, ``backend`` (the mask, the sinks and the reduction are
            the call's own). Default: every default.

    Example:
        >>> q, k = torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16)
        >>> call = TermCall(q, k, q, k, Masking(causal=True), options=AttentionKLOptions(temperature=1.0))
        >>> kl_sum, rows = call.run("sum")
        >>> float(kl_sum), float(rows)   # equal distributions; 2 · 4 · 8 counted rows
        (0.0, 64.0)
    """

    q_t: torch.Tensor
    k_t: torch.Tensor
    q_s: torch.Tensor
    k_s: torch.Tensor
    masking: Masking
    sinks_t: torch.Tensor | None = None
    sinks_s: torch.Tensor | None = None
    options: AttentionKLOptions = dataclasses.field(default_factory=AttentionKLOptions)

    @property
    def scores(self) -> int:
        """``B · H · N_q · N_k``: the score elements one side computes."""
        b, h, n_q, _ = self.q_t.shape
        return b * h * n_q * self.k_t.shape[2]

    @property
    def bytes(self) -> int:
        """The bytes of the four tensors (what a fused call copies)."""
        return sum(x.numel() * x.element_size() for x in (self.q_t, self.k_t, self.q_s, self.k_s))

    def precision(self) -> str:
        """The precision of the term's products (:func:`streamkl.precision.product_precision`): one name when both
        sides compute alike, else ``"teacher <t>, student <s>"``.

        Example:
            >>> q = torch.randn(1, 2, 4, 8)
            >>> TermCall(q.bfloat16(), q.bfloat16(), q, q, Masking(causal=True)).precision()
            'teacher bf16, student fp32 (IEEE)'
        """
        backend = select_backend(self.options.backend, self.q_s.device, (self.q_t.dtype, self.q_s.dtype))
        t, s = (product_precision(x.dtype, backend=backend) for x in (self.q_t, self.q_s))
        return t if t == s else f"teacher {t}, student {s}"

    def run(self, reduction: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``attention_kl`` of the term and the rows it counted (``reduction`` "sum", or "none": per row
        ``[B, H, N_q]``, ``[T, H]`` when packed; the rows: a float32 scalar), outside autocast: the captures recorded
        each layer's tensors in the dtype its attention computed in (cast to the autocast dtype under autocast), and
        the op takes them as they are."""
        m = self.masking
        kw = dict(causal=bool(m.causal), window=m.window, sinks_t=self.sinks_t, sinks_s=self.sinks_s,
                  reduction=reduction, return_count=True)
        with torch.autocast(device_type=self.q_s.device.type, enabled=False):
            if m.packed is not None:
                p = m.packed
                return attention_kl(
                    p.gather(self.q_t, "q"), p.gather(self.k_t, "k"), p.gather(self.q_s, "q"), p.gather(self.k_s, "k"),
                    options=self.options, layout="thd", **p.op_offsets(), **kw)
            return attention_kl(self.q_t, self.k_t, self.q_s, self.k_s, options=self.options,
                                key_padding_mask=m.key_padding_mask, query_mask=m.query_mask, attn_mask=m.attn_mask,
                                **kw)

    def fuse_key(self) -> tuple | None:
        """What terms must share to run as one call (shapes, dtypes, devices, options, the same mask tensors), or
        None when this term runs alone (more than :data:`FUSE_MAX_SCORES` scores, or a per-head general mask)."""
        m = self.masking
        if self.scores > FUSE_MAX_SCORES or (m.attn_mask is not None and m.attn_mask.shape[1] != 1):
            return None
        tensors = tuple((x.shape, x.dtype, x.device) for x in (self.q_t, self.k_t, self.q_s, self.k_s))
        sinks = tuple(None if x is None else x.dtype for x in (self.sinks_t, self.sinks_s))
        masks = tuple(_same_storage(x) for x in (m.key_padding_mask, m.query_mask, m.attn_mask))
        return (tensors, sinks, bool(m.causal), m.window, masks, _packed_identity(m.packed), self.options)


@dataclass
class TermResult:
    """The outcome of one call: the KL summed over counted rows of each term it ran (``kl_sums [G]``, in the order
    of ``indices`` into the list given to :func:`run_terms`) and their common row count (a float32 scalar)."""

    indices: list[int]
    kl_sums: torch.Tensor
    rows: torch.Tensor


def run_terms(calls: list[TermCall], *, fuse: bool = True) -> list[TermResult]:
    """Run every term: with ``fuse``, terms with equal :meth:`TermCall.fuse_key` as one call on their heads
    concatenated (several calls when their tensors exceed :data:`FUSE_MAX_BYTES`), the rest one call each.

    The fused call computes the per-row KL of all heads (``reduction="none"``) and sums it per term, so each term's
    value and gradients are those of its own call up to float32 summation order.

    Example:
        >>> q = torch.randn(2, 4, 8, 16)
        >>> calls = [TermCall(q, q, q + i, q, Masking(causal=False)) for i in range(3)]
        >>> [(r.indices, tuple(r.kl_sums.shape)) for r in run_terms(calls)]   # one call for the three terms
        [([0, 1, 2], (3,))]
        >>> len(run_terms(calls, fuse=False))
        3
    """
    groups: dict[object, list[list[int]]] = {}
    filled: dict[object, int] = {}  # the bytes of each group's last chunk
    for i, call in enumerate(calls):
        key = call.fuse_key() if fuse else None
        key = ("alone", i) if key is None else key
        chunks = groups.setdefault(key, [[]])
        size = call.bytes
        if chunks[-1] and filled[key] + size > FUSE_MAX_BYTES:
            chunks.append([])  # this group's concatenated copies would exceed FUSE_MAX_BYTES: start another call
            filled[key] = 0
        chunks[-1].append(i)
        filled[key] = filled.get(key, 0) + size
    results = []
    for indices in (chunk for chunks in groups.values() for chunk in chunks):
        first = calls[indices[0]]
        if len(indices) == 1:
            kl_sum, rows = first.run("sum")
            results.append(TermResult(indices, kl_sum.reshape(1), rows))
            continue
        members = [calls[i] for i in indices]
        fused = TermCall(_cat(members, "q_t", 1), _cat(members, "k_t", 1), _cat(members, "q_s", 1),
                         _cat(members, "k_s", 1), first.masking,
                         None if first.sinks_t is None else _cat(members, "sinks_t", 0),
                         None if first.sinks_s is None else _cat(members, "sinks_s", 0), first.options)
        per_row, rows = fused.run("none")  # [B, G·H, N_q], or [T, G·H] when packed; the rows of all G terms
        per_term = per_row.unflatten(1, (len(members), first.q_t.shape[1]))  # [B, G, H, N_q] or [T, G, H]
        kl_sums = per_term.sum((0, 2, 3) if per_term.dim() == 4 else (0, 2))
        results.append(TermResult(indices, kl_sums, rows / len(members)))  # one mask: each term counts as many
    return results


def _cat(calls: list[TermCall], name: str, dim: int) -> torch.Tensor:
    return torch.cat([getattr(c, name) for c in calls], dim)


def _same_storage(x: torch.Tensor | None) -> tuple | None:
    """A key equal for two tensors only when they are the same view of the same memory (so hold the same values)."""
    return None if x is None else (x.data_ptr(), tuple(x.shape), x.stride(), x.dtype, x.device)


def _packed_identity(p: PackedSequences | None) -> tuple | None:
    if p is None:
        return None
    return (*(_same_storage(x) for x in (p.cu_seqlens_q, p.cu_seqlens_k, p.index_q, p.index_k)), p.max_seqlen_q,
            p.max_seqlen_k)
