"""A right-padded batch as dense problems, one per batch row.

A Hugging Face batch of unequal sequences is padded at the end of each row and carries a mask, and the kernels for
dense tensors (the Gluon ones: :mod:`streamkl.dispatch`) take no mask. When every mask of a call keeps a prefix of
each batch row (its real tokens), row ``b`` of the batch is exactly the dense problem on its first ``n_q[b]``
queries and ``n_k[b]`` keys: strided views of the inputs, no copy. :func:`padded_pieces` finds those prefixes where
they say the same thing as the masks, :func:`piece_problems` makes each row's problem, and
:func:`streamkl.autograd.attention_kl_padded` runs them and puts the results together as the masked call returns them
(excluded rows 0; the sum and the mean over the counted rows).

The masks are read on the host by :func:`streamkl.dispatch.read_masks`: the lengths in the synchronisation it
already takes to drop masks that keep everything, the prefixes in a second one for a batch that would split.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from ._problem import AttentionKLProblem, KLInputs, KLSpec

__all__ = ["padded_pieces", "per_row_result", "piece_problems"]


def padded_pieces(problem: AttentionKLProblem, query_lengths: list[int] | None,
                  key_lengths: list[int] | None) -> tuple[tuple[int, int], ...] | None:
    """``(queries, keys)`` of the dense problem each batch row of ``problem`` is, given that its ``query_mask`` keeps
    the first ``query_lengths[b]`` rows of batch row ``b`` and its ``key_padding_mask`` the first ``key_lengths[b]``
    keys (None: no such mask, every row or key); ``(0, 0)`` for a batch row with no counted row. None where the
    batch is not one such set of problems: a general ``attn_mask`` or packed sequences, or a window whose alignment
    the cut would move (queries are aligned to the last key: a causal row ``i`` sees keys up to
    ``i + n_k - n_q``), or a piece with a row that sees no key (the count of a mean would then need the device).

    Example:
        >>> from streamkl._validation import prepare_problem
        >>> from streamkl.options import AttentionKLOptions
        >>> q = torch.randn(3, 2, 8, 16)
        >>> problem = prepare_problem(q, q, q, q, AttentionKLOptions(causal=True))
        >>> padded_pieces(problem, [8, 5, 0], [8, 5, 0])   # the same prefix for queries and keys
        ((8, 8), (5, 5), (0, 0))
        >>> padded_pieces(problem, None, [8, 5, 2]) is None  # causal: padded queries still see the real keys
        True
    """
    if problem.attn_mask is not None or problem.packed:
        return None
    n_q, n_k = problem.n_q, problem.n_k
    offset = n_k - n_q  # query i is aligned to key i + offset
    left, right = problem.window
    pieces = []
    for b in range(problem.batch):
        rows = n_q if query_lengths is None else query_lengths[b]
        keys = n_k if key_lengths is None else key_lengths[b]
        if right == 0:  # causal: a row's last key is its own; the piece keeps the alignment and the keys rows see
            if keys < rows + offset:
                return None
            keys = rows + offset
        elif (left >= 0 or right > 0) and keys - rows != offset:
            return None
        if rows <= 0 or keys <= 0:
            pieces.append((0, 0))
            continue
        if not _piece(problem, b, rows, keys).every_row_counts():
            return None
        pieces.append((rows, keys))
    if not any(rows for rows, _ in pieces):
        return None
    return tuple(pieces)


def _piece(problem: AttentionKLProblem, b: int, rows: int, keys: int) -> AttentionKLProblem:
    """Batch row ``b`` of ``problem`` on its first ``rows`` queries and ``keys`` keys, without masks (views)."""
    return replace(problem, q_t=problem.q_t[b:b + 1, :, :rows], k_t=problem.k_t[b:b + 1, :, :keys],
                   q_s=problem.q_s[b:b + 1, :, :rows], k_s=problem.k_s[b:b + 1, :, :keys], key_padding_mask=None,
                   query_mask=None, max_seqlen_q=rows, max_seqlen_k=keys)


def piece_problems(problem: AttentionKLProblem,
                   pieces: tuple[tuple[int, int], ...]) -> list[tuple[int, KLInputs, KLSpec]]:
    """``(b, inputs, spec)``: the direction-free problem (:meth:`AttentionKLProblem.kernel_problem`) of each batch
    row ``b`` of :func:`padded_pieces` that has rows, on views of its real tokens.

    Example:
        >>> from streamkl._validation import prepare_problem
        >>> from streamkl.options import AttentionKLOptions
        >>> q = torch.randn(2, 2, 6, 8)
        >>> [(b, tuple(i.q_b.shape)) for b, i, _ in piece_problems(prepare_problem(q, q, q, q, AttentionKLOptions()),
        ...                                                        ((0, 0), (4, 6)))]
        [(1, (1, 2, 4, 8))]
    """
    return [(b, *_piece(problem, b, n_q, n_k).kernel_problem()) for b, (n_q, n_k) in enumerate(pieces) if n_q]


def per_row_result(problem: AttentionKLProblem, parts: list[tuple[int, KLInputs, KLSpec]],
                   results: list[torch.Tensor]) -> torch.Tensor:
    """The per-row KL ``[B, H, N_q]`` of ``problem`` from each piece's (``parts``, :func:`piece_problems`): 0 in the
    rows outside every piece, as the masked call makes them.

    Example:
        >>> from streamkl._validation import prepare_problem
        >>> from streamkl.options import AttentionKLOptions
        >>> q = torch.randn(2, 2, 6, 8)
        >>> problem = prepare_problem(q, q, q, q, AttentionKLOptions(reduction="none"))
        >>> parts = piece_problems(problem, ((0, 0), (4, 6)))
        >>> per_row_result(problem, parts, [torch.ones(1, 2, 4)])[:, 0].tolist()
        [[0.0, 0.0, 0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]]
    """
    by_row = {b: r for (b, _, _), r in zip(parts, results)}
    made = results[0]
    return torch.cat([F.pad(by_row[b], (0, problem.n_q - by_row[b].shape[-1])) if b in by_row
                      else made.new_zeros((1, problem.heads, problem.n_q)) for b in range(problem.batch)])
