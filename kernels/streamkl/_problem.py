"""The canonical form of an attention-KL problem, as every backend sees it.

:func:`streamkl._validation.prepare_problem` turns the user's arguments into an :class:`AttentionKLProblem`
(teacher/student terms, canonical ``(B, H, N, D)`` views); :meth:`AttentionKLProblem.kernel_problem` turns that
into the direction-free form the backends compute, ``KL(P_a ‖ P_b)``: :class:`KLInputs` (the tensors) and
:class:`KLSpec` (everything else).

Scores of one side, for a raw product ``r = q·k``:

* without soft-capping: ``s = r · scale`` (``scale`` already includes ``1 / temperature``);
* with soft-capping: ``s = softcap · tanh(r · scale)``, where ``scale = scale_user / cap`` and
  ``softcap = cap / temperature``; ``ds/dr = softcap · scale · (1 − tanh²)``.

Masks are one rule for every layout: query ``i`` of a sequence with ``n_q`` queries and ``n_k`` keys, aligned
bottom-right to key position ``i' = i + n_k − n_q``, may see key ``j`` iff
``i' − window_left ≤ j ≤ i' + window_right`` (−1 = unbounded on that side; ``causal`` is ``window_right = 0``),
the key padding mask keeps it and a general ``attn_mask`` (if any) allows it. Packed sequences (``cu_seqlens``) are
separate problems.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch


class KLInputs(NamedTuple):
    """The tensors of ``KL(P_a ‖ P_b)`` in canonical ``(B, H, N, D)`` views (packed: ``(1, H, total, D)``)."""

    q_a: torch.Tensor
    k_a: torch.Tensor
    q_b: torch.Tensor
    k_b: torch.Tensor
    sink_a: torch.Tensor | None  # [H] sink logits in score units (already divided by the temperature)
    sink_b: torch.Tensor | None
    key_padding_mask: torch.Tensor | None  # [B, N_k] bool, True = real key
    query_mask: torch.Tensor | None  # [B, N_q] bool, False = row excluded
    cu_seqlens_q: torch.Tensor | None  # [S + 1] int32 offsets of packed sequences
    cu_seqlens_k: torch.Tensor | None
    attn_mask: torch.Tensor | None = None  # [B or 1, H or 1, N_q, N_k] bool, True = allowed (any mask)
    # [3, B] int32 on the inputs' device, a masked batch's (streamkl._pieces.padded_lengths): per batch row the query
    # rows and keys the Gluon kernels sweep (a right-padded row: the prefixes its masks keep; else all of them) and
    # whether they read the row's key mask per tile (1: its masks keep no such prefixes); the masks stay with them
    lengths: torch.Tensor | None = None


@dataclass(frozen=True)
class KLSpec:
    """Everything but the tensors of one ``KL(P_a ‖ P_b)`` problem (see the module docstring)."""

    scale_a: float
    scale_b: float
    softcap_a: float = 0.0  # 0 = no soft-capping on that side
    softcap_b: float = 0.0
    window_left: int = -1
    window_right: int = -1
    max_seqlen_q: int = 0  # packed layout: the longest sequence (the kernels' grid); else N_q
    max_seqlen_k: int = 0

    @property
    def banded(self) -> bool:
        """True when some key is outside some query's window (causal counts)."""
        return self.window_left >= 0 or self.window_right >= 0

    def grad_scale(self, side: str) -> float:
        """``ds/dr`` without the ``1 − tanh²`` factor: the multiplier of a side's dQ/dK products."""
        if side == "a":
            return self.scale_a * self.softcap_a if self.softcap_a else self.scale_a
        return self.scale_b * self.softcap_b if self.softcap_b else self.scale_b

    def swapped(self) -> KLSpec:
        """The same problem with the roles of a and b exchanged."""
        return replace(self, scale_a=self.scale_b, scale_b=self.scale_a, softcap_a=self.softcap_b,
                       softcap_b=self.softcap_a)


@dataclass(frozen=True)
class AttentionKLProblem:
    """Validated inputs of :func:`streamkl.attention_kl`, in the canonical ``(B, H, N, D)`` view.

    Strided views of the user's tensors, never copies (masks and offsets given on the CPU for inputs on a GPU are
    copied to the device, and kept on the host as ``host_masks``/``host_offsets``); the packed layout ``"thd"`` is
    viewed as ``(1, H, total, D)`` with ``cu_seqlens_q``/``cu_seqlens_k``. ``scale_*`` are the user's score scales
    (default ``1/sqrt(D)``), not yet divided by the temperature; ``window`` is normalised (causal folded into its
    right bound).
    """

    q_t: torch.Tensor
    k_t: torch.Tensor
    q_s: torch.Tensor
    k_s: torch.Tensor
    sinks_t: torch.Tensor | None
    sinks_s: torch.Tensor | None
    key_padding_mask: torch.Tensor | None
    query_mask: torch.Tensor | None
    cu_seqlens_q: torch.Tensor | None
    cu_seqlens_k: torch.Tensor | None
    attn_mask: torch.Tensor | None
    max_seqlen_q: int
    max_seqlen_k: int
    host_offsets: tuple[list[int], list[int]] | None  # packed offsets given on the CPU: their values (q, k)
    host_masks: dict[str, torch.Tensor] | None  # masks given on the CPU for inputs on a GPU: name -> that CPU copy
    window: tuple[int, int]
    scale_t: float
    scale_s: float
    softcap_t: float | None
    softcap_s: float | None
    temperature: float
    reverse: bool
    reduction: str
    layout: str
    #: A masked batch's query rows and keys per batch row (:attr:`KLInputs.lengths`), set by
    #: :func:`streamkl.dispatch.read_masks` where the Gluon training kernels take the call
    lengths: torch.Tensor | None = None

    @property
    def batch(self) -> int:
        return self.q_t.shape[0]

    @property
    def heads(self) -> int:
        return self.q_t.shape[1]

    @property
    def n_q(self) -> int:
        """Queries per batch row (packed: all tokens)."""
        return self.q_t.shape[2]

    @property
    def n_k(self) -> int:
        return self.k_t.shape[2]

    @property
    def packed(self) -> bool:
        return self.cu_seqlens_q is not None

    def side_scales(self, side: str) -> tuple[float, float]:
        """``(scale, softcap)`` of the teacher ("t") or student ("s") in the form of :class:`KLSpec`."""
        scale, cap = (self.scale_t, self.softcap_t) if side == "t" else (self.scale_s, self.softcap_s)
        if cap is None:
            return scale / self.temperature, 0.0
        return scale / cap, cap / self.temperature

    def kernel_problem(self) -> tuple[KLInputs, KLSpec]:
        """The direction-free problem ``KL(P_a ‖ P_b)``: a = teacher for ``"forward"``, a = student for ``"reverse"``.

        The sinks are divided by the temperature here, with differentiable torch ops, so that their gradients
        flow back to the user's tensors.
        """
        (scale_t, cap_t), (scale_s, cap_s) = self.side_scales("t"), self.side_scales("s")
        sink_t = None if self.sinks_t is None else self.sinks_t / self.temperature
        sink_s = None if self.sinks_s is None else self.sinks_s / self.temperature
        spec = KLSpec(scale_a=scale_t, scale_b=scale_s, softcap_a=cap_t, softcap_b=cap_s,
                      window_left=self.window[0], window_right=self.window[1],
                      max_seqlen_q=self.max_seqlen_q, max_seqlen_k=self.max_seqlen_k)
        teacher = (self.q_t, self.k_t, sink_t)
        student = (self.q_s, self.k_s, sink_s)
        if self.reverse:
            teacher, student, spec = student, teacher, spec.swapped()
        inputs = KLInputs(teacher[0], teacher[1], student[0], student[1], teacher[2], student[2],
                          self.key_padding_mask, self.query_mask, self.cu_seqlens_q, self.cu_seqlens_k, self.attn_mask,
                          self.lengths)
        return inputs, spec

    def every_row_counts(self) -> bool:
        """True when no row can be empty, so ``"mean"`` divides by the number of rows without looking at them."""
        masked = self.key_padding_mask is not None or self.query_mask is not None or self.attn_mask is not None
        if self.packed or masked or self.n_k == 0:
            return False
        left, right = self.window
        offset = self.n_k - self.n_q  # row i is aligned to key i + offset
        if right >= 0 and offset + right < 0:  # the first row's window ends before key 0
            return False
        return not (left >= 0 and self.n_q - 1 + offset - left > self.n_k - 1)  # the last row's starts after the end


def key_head_split(group_a: int, group_b: int) -> int | None:
    """Programs per key head of side b so that each sweeps query heads that share one key head of side a (``group_*``:
    query heads per key head of each side), or None when no whole split does (the Hopper key pass needs one).

    Example:
        >>> key_head_split(4, 2), key_head_split(1, 4), key_head_split(2, 3)  # GQA teacher; MHA teacher; neither
        (1, 4, None)
    """
    if group_a % group_b == 0:
        return 1
    if group_b % group_a == 0:
        return group_b // group_a
    return None
