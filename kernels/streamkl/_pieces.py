"""A right-padded batch, or packed sequences, as dense problems: one per batch row or per sequence.

The Gluon forward of a metric call (:mod:`streamkl.dispatch`) takes no mask and no sequence offsets (the Gluon
training kernels take both batches below in one launch). Two kinds of batch are nevertheless a set of dense problems
on strided views of their inputs, with no copy:

* a Hugging Face batch of unequal sequences, padded at the end of each row: when every mask of a call keeps a prefix
  of each batch row (its real tokens), row ``b`` is exactly the dense problem on its first ``n_q[b]`` queries and
  ``n_k[b]`` keys (:func:`padded_pieces`);
* packed sequences (``layout="thd"``): sequence ``i`` is exactly the dense problem on its tokens
  ``cu_seqlens[i]:cu_seqlens[i + 1]``, since the masks are one rule for every layout (:func:`packed_pieces`).

:func:`piece_problems` makes each piece's problem, and :func:`streamkl.autograd.attention_kl_pieces` runs them and puts
the results together as the masked or packed call returns them (rows outside every piece 0; the sum and the mean over
the counted rows). The lengths and offsets are read on the host by :func:`streamkl.dispatch.read_masks` and
:func:`streamkl.dispatch.read_offsets`.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise
from typing import NamedTuple

import torch

from ._problem import AttentionKLProblem, KLInputs, KLSpec

__all__ = ["Piece", "packed_pieces", "padded_lengths", "padded_pieces", "per_row_result", "piece_problems"]


class Piece(NamedTuple):
    """One dense problem of a batch: queries ``q_start:q_start + n_q`` and keys ``k_start:k_start + n_k`` of batch
    row ``batch`` (packed: row 0 of the ``(1, H, total, D)`` view)."""

    batch: int
    q_start: int
    n_q: int
    k_start: int
    n_k: int

    @property
    def sizes(self) -> tuple[int, int]:
        """``(n_q, n_k)``."""
        return self.n_q, self.n_k


def padded_lengths(problem: AttentionKLProblem, query_mask: torch.Tensor | None,
                   key_padding_mask: torch.Tensor | None) -> torch.Tensor:
    """:attr:`streamkl._problem.KLInputs.lengths` of ``problem`` (no ``attn_mask``, not packed) given its masks (the
    problem's own, or their copies on the CPU; None: that mask keeps everything), computed where they are, without
    reading them on the host: ``[3, B]`` int32, per batch row the query rows and keys of its dense problem and 0
    (:func:`padded_pieces`' rule: the masks keep a prefix of the row, and a causal row's keys are cut at its rows),
    or, for a row whose masks keep no such prefixes (left padding, a key mask with holes), all ``N_q`` rows and
    ``N_k`` keys and 1: the Gluon training kernels then read that row's masks.

    Example:
        >>> from streamkl._validation import prepare_problem
        >>> from streamkl.options import AttentionKLOptions
        >>> q = torch.randn(3, 2, 8, 16)
        >>> keys = torch.tensor([[True] * 8, [True] * 5 + [False] * 3, [False] * 3 + [True] * 5])
        >>> problem = prepare_problem(q, q, q, q, AttentionKLOptions(causal=True))
        >>> padded_lengths(problem, keys, keys).tolist()  # rows, keys, and whether the kernels read the masks
        [[8, 5, 8], [8, 5, 8], [0, 0, 1]]
    """
    def kept(mask: torch.Tensor | None, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Entries kept per batch row, and whether they are the row's first (no kept entry after a dropped one;
        None: every row's are)."""
        if mask is None:
            return torch.full((problem.batch,), n, dtype=torch.int32, device=device), None
        return mask.sum(1, dtype=torch.int32), ~(mask[:, 1:] > mask[:, :-1]).any(1)

    device = (query_mask if query_mask is not None else key_padding_mask).device
    rows, rows_first = kept(query_mask, problem.n_q)
    # (one mask for both, as a padded batch passes it: read once)
    keys, keys_first = (rows, rows_first) if key_padding_mask is query_mask else kept(key_padding_mask, problem.n_k)
    rows, keys, prefixes = _piece_sizes(problem, rows, keys)
    for first in (rows_first, None if keys_first is rows_first else keys_first):
        if first is not None:
            prefixes = first if prefixes is None else prefixes & first
    if prefixes is None:
        return torch.stack([rows, keys, torch.zeros_like(rows)])
    return torch.stack([torch.where(prefixes, rows, problem.n_q), torch.where(prefixes, keys, problem.n_k),
                        (~prefixes).int()])


def _piece_sizes(problem: AttentionKLProblem, rows: torch.Tensor, keys: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(rows, keys, fits)`` per batch row whose masks keep its first ``rows`` query rows and ``keys`` keys: the
    sizes of the dense problem the row is, and whether it is one (None: every row is). Queries are aligned to the last
    key (a causal row ``i`` sees keys up to ``i + n_k - n_q``): a causal row's keys are cut at its rows' last diagonal
    (it must keep them all), and any other window needs as many keys past the rows as the batch has."""
    offset = problem.n_k - problem.n_q
    left, right = problem.window
    if right == 0:
        cut = rows + offset
        return rows, cut, keys >= cut
    if left >= 0 or right > 0:
        return rows, keys, keys - rows == offset
    return rows, keys, None


def padded_pieces(problem: AttentionKLProblem, query_lengths: list[int] | None,
                  key_lengths: list[int] | None) -> tuple[Piece, ...] | None:
    """The dense problem of each batch row of ``problem`` that has rows, given that its ``query_mask`` keeps the first
    ``query_lengths[b]`` rows of batch row ``b`` and its ``key_padding_mask`` the first ``key_lengths[b]`` keys (None:
    no such mask, every row or key). None where the batch is not one such set of problems: a general ``attn_mask`` or
    packed sequences, or a window whose alignment the cut would move (:func:`_piece_sizes`), or a piece with a row
    that sees no key (the count of a mean would then need the device), or no row at all.

    Example:
        >>> from streamkl._validation import prepare_problem
        >>> from streamkl.options import AttentionKLOptions
        >>> q = torch.randn(3, 2, 8, 16)
        >>> problem = prepare_problem(q, q, q, q, AttentionKLOptions(causal=True))
        >>> [p.sizes for p in padded_pieces(problem, [8, 5, 0], [8, 5, 0])]  # the same prefix for queries and keys
        [(8, 8), (5, 5)]
        >>> padded_pieces(problem, None, [8, 5, 2]) is None  # causal: padded queries still see the real keys
        True
    """
    if problem.attn_mask is not None or problem.packed:
        return None
    rows, keys, fits = _piece_sizes(problem, torch.tensor(query_lengths or [problem.n_q] * problem.batch),
                                    torch.tensor(key_lengths or [problem.n_k] * problem.batch))
    if fits is not None and not bool(fits.all()):
        return None
    pieces = [Piece(b, 0, n_q, 0, n_k) for b, (n_q, n_k) in enumerate(zip(rows.tolist(), keys.tolist()))
              if n_q > 0 and n_k > 0]
    return _every_row_counts(problem, pieces)


def packed_pieces(problem: AttentionKLProblem, offsets_q: list[int], offsets_k: list[int]
                  ) -> tuple[Piece, ...] | None:
    """The dense problem of each packed sequence of ``problem`` that has rows, given its offsets ``cu_seqlens_q`` and
    ``cu_seqlens_k`` as lists; None where some sequence has rows but no key, or a row that sees no key (a window
    that ends before the first key), or where no sequence has rows.

    Example:
        >>> from streamkl._validation import prepare_problem
        >>> from streamkl.options import AttentionKLOptions
        >>> q, cu = torch.randn(10, 2, 16), torch.tensor([0, 6, 6, 10], dtype=torch.int32)
        >>> opts = AttentionKLOptions(causal=True, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu)
        >>> packed_pieces(prepare_problem(q, q, q, q, opts), [0, 6, 6, 10], [0, 6, 6, 10])
        (Piece(batch=0, q_start=0, n_q=6, k_start=0, n_k=6), Piece(batch=0, q_start=6, n_q=4, k_start=6, n_k=4))
    """
    pieces = [Piece(0, q0, q1 - q0, k0, k1 - k0)
              for (q0, q1), (k0, k1) in zip(pairwise(offsets_q), pairwise(offsets_k)) if q1 > q0]
    if any(p.n_k == 0 for p in pieces):
        return None
    return _every_row_counts(problem, pieces)


def _every_row_counts(problem: AttentionKLProblem, pieces: list[Piece]) -> tuple[Piece, ...] | None:
    """``pieces`` as a tuple where there is one and every row of each sees a key, else None."""
    if not pieces or not all(_piece(problem, p).every_row_counts() for p in pieces):
        return None
    return tuple(pieces)


def _piece(problem: AttentionKLProblem, piece: Piece) -> AttentionKLProblem:
    """``piece`` of ``problem`` as a problem of its own, without masks or offsets (views)."""
    b, q0, n_q, k0, n_k = piece

    def cut(x: torch.Tensor, start: int, n: int) -> torch.Tensor:
        return x[b:b + 1, :, start:start + n]

    return replace(problem, q_t=cut(problem.q_t, q0, n_q), k_t=cut(problem.k_t, k0, n_k),
                   q_s=cut(problem.q_s, q0, n_q), k_s=cut(problem.k_s, k0, n_k), key_padding_mask=None,
                   query_mask=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=n_q, max_seqlen_k=n_k,
                   host_offsets=None, host_masks=None, lengths=None)


def piece_problems(problem: AttentionKLProblem,
                   pieces: tuple[Piece, ...]) -> list[tuple[Piece, KLInputs, KLSpec]]:
    """``(piece, inputs, spec)``: the direction-free problem (:meth:`AttentionKLProblem.kernel_problem`) of each
    piece, on views of its tokens, the largest first (its kernels queue up while the host prepares the others).

    Example:
        >>> from streamkl._validation import prepare_problem
        >>> from streamkl.options import AttentionKLOptions
        >>> q = torch.randn(2, 2, 6, 8)
        >>> problem = prepare_problem(q, q, q, q, AttentionKLOptions())
        >>> [(p.batch, tuple(i.q_b.shape)) for p, i, _ in piece_problems(problem, (Piece(1, 0, 4, 0, 6),))]
        [(1, (1, 2, 4, 8))]
    """
    ordered = sorted(pieces, key=lambda p: p.n_q * p.n_k, reverse=True)
    return [(p, *_piece(problem, p).kernel_problem()) for p in ordered]


def per_row_result(problem: AttentionKLProblem, parts: list[tuple[Piece, KLInputs, KLSpec]],
                   results: list[torch.Tensor]) -> torch.Tensor:
    """The per-row KL ``[B, H, N_q]`` of ``problem`` from each piece's (``parts``, :func:`piece_problems`): 0 in the
    rows outside every piece, as the masked or packed call makes them.

    Example:
        >>> from streamkl._validation import prepare_problem
        >>> from streamkl.options import AttentionKLOptions
        >>> q = torch.randn(2, 2, 6, 8)
        >>> problem = prepare_problem(q, q, q, q, AttentionKLOptions(reduction="none"))
        >>> parts = piece_problems(problem, (Piece(1, 0, 4, 0, 6),))
        >>> per_row_result(problem, parts, [torch.ones(1, 2, 4)])[:, 0].tolist()
        [[0.0, 0.0, 0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]]
    """
    out = results[0].new_zeros((problem.batch, problem.heads, problem.n_q))
    for (p, _, _), result in zip(parts, results):
        out[p.batch, :, p.q_start:p.q_start + p.n_q] = result[0]
    return out
