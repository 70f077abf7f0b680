"""A right-padded batch as dense problems, one per batch row.

A Hugging Face batch of unequal sequences is padded at the end of each row and carries a mask, and the kernels for
dense tensors (the Gluon ones: :mod:`streamkl.dispatch`) take no mask. When every mask of a call keeps a prefix of
each batch row (its real tokens), row ``b`` of the batch is exactly the dense problem on its first ``n_q[b]``
queries and ``n_k[b]`` keys: strided views of the inputs, no copy. :func:`padded_pieces` finds those prefixes where
they say the same thing as the masks, and :func:`padded_attention_kl` runs one call per batch row and puts the
results together as the masked call returns them (excluded rows 0; the sum and the mean over the counted rows).

The masks are read on the host by :func:`streamkl.dispatch.read_masks` (one synchronisation, which it already takes
to drop masks that keep everything).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from ._problem import AttentionKLProblem

__all__ = ["padded_attention_kl", "padded_pieces"]


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


def padded_attention_kl(problem: AttentionKLProblem, pieces: tuple[tuple[int, int], ...], run) -> tuple:
    """``(result, rows)``: what :func:`streamkl.attention_kl` returns for ``problem`` (the per-row KL ``[B, H, N_q]``,
    its sum or its mean, as ``problem.reduction`` says) and the number of counted rows (a host int), from one call
    of ``run(inputs, spec, reduction)`` (the op's autograd, returning ``(result, lse_a, lse_b)``) per piece of
    :func:`padded_pieces`. Rows outside every piece are 0, as the masked call makes them.

    Example:
        >>> from streamkl._validation import prepare_problem
        >>> from streamkl.autograd import attention_kl_per_row
        >>> from streamkl.options import AttentionKLOptions
        >>> q = torch.randn(2, 2, 6, 8)
        >>> problem = prepare_problem(q, q, q, q + 1, AttentionKLOptions(reduction="none"))
        >>> run = lambda inputs, spec, reduction: attention_kl_per_row(inputs, spec, "reference", False, True,
        ...                                                            reduction)
        >>> kl, rows = padded_attention_kl(problem, ((6, 6), (4, 4)), run)
        >>> tuple(kl.shape), rows, float(kl[1, :, 4:].abs().sum())
        ((2, 2, 6), 20, 0.0)
    """
    each = "none" if problem.reduction == "none" else "sum"
    results, rows = [], 0
    for b, (n_q, n_k) in enumerate(pieces):
        if not n_q:
            results.append(None)
            continue
        inputs, spec = _piece(problem, b, n_q, n_k).kernel_problem()
        results.append(run(inputs, spec, each)[0])
        rows += problem.heads * n_q
    if each == "sum":
        total = sum(r for r in results if r is not None)
        return (total / rows if problem.reduction == "mean" else total), rows
    made = next(r for r in results if r is not None)
    shape = (1, problem.heads, problem.n_q)
    per_row = [made.new_zeros(shape) if r is None else F.pad(r, (0, problem.n_q - r.shape[-1])) for r in results]
    return torch.cat(per_row), rows
