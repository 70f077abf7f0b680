r"""Sequence-sharded attention KL: the exact KL when the keys of a sequence are split into shards (context
parallelism).

The forward of :func:`streamkl.attention_kl` keeps three numbers per query row: the KL and the two log-sum-exps.
Computed over one shard ``s`` of the keys, they determine that shard's share of the row exactly, so the rows'
statistics over all keys follow from the shards' (a *merge*, :func:`merge_partials`):

.. math::

    \mathrm{lse}_a = \operatorname{logsumexp}_s \mathrm{lse}_{a,s}, \qquad
    \mathrm{lse}_b = \operatorname{logsumexp}_s \mathrm{lse}_{b,s}, \qquad
    \mathrm{KL} = \sum_s w_s \bigl(\mathrm{KL}_s + (\mathrm{lse}_{a,s} - \mathrm{lse}_a)
                                     - (\mathrm{lse}_{b,s} - \mathrm{lse}_b)\bigr),
    \quad w_s = e^{\mathrm{lse}_{a,s} - \mathrm{lse}_a}

where ``a`` is the distribution the KL is taken under (the teacher for ``direction="forward"``, the student for
``"reverse"``). The backward of shard ``s`` is the op's own backward on that shard's keys, run with the *merged*
statistics and the same upstream gradient: the gradient of every score depends on its row only through those
three numbers. Nothing here approximates: a sharded KL equals the unsharded one up to floating-point rounding.

Four levels, from the parts to the whole:

* :func:`attention_kl_partial`: one shard's per-row :class:`KLPartial` (no gradient);
* :func:`merge_partials`: the exact merge of partials (associative: partials of merged groups merge again);
* :func:`attention_kl_partial_backward`: one shard's gradients from the merged statistics (what a ring needs);
* :func:`sharded_attention_kl`: the differentiable KL of queries against a list of key shards in one process,
  and :func:`context_parallel_attention_kl`, the same across the ranks of a ``torch.distributed`` group, where
  every rank holds one contiguous chunk of the sequence (queries and keys); its backward reduces the keys'
  gradients to the ranks that own them.

Positions: the queries given are rows ``query_start .. query_start + n_q - 1`` of a problem with ``total_q``
queries and ``total_k`` keys, and a shard holds keys ``key_start .. key_start + n_k - 1``. Causal masks and sliding
windows follow :func:`streamkl.attention_kl`'s rule on the *global* positions (query ``i`` aligned bottom-right to
key ``i + total_k - total_q``), so a shard of keys sees exactly the rows that would see those keys in the whole
problem; the shard's problem is cut to the rows and keys that can meet (a shard entirely in a row block's future is
never computed). Masks that are supported in a shard: ``causal``, ``window``, a key padding mask (the shard's
columns), a query mask (the rows') and a general ``attn_mask`` (the rows' × the shard's columns). Sinks are one
extra outcome per row: they are folded in once, after the merge (:func:`sharded_attention_kl`,
:func:`context_parallel_attention_kl`), never per shard. Packed sequences (layout ``"thd"``) are not supported:
shard each sequence on its own.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch

from ._problem import KLInputs, KLSpec
from ._reduction import reduce_per_row_kl
from ._validation import prepare_problem
from .autograd import forward_impl, sink_gradients
from .dispatch import backward as dispatch_backward
from .dispatch import select_backend
from .options import AttentionKLOptions
from .precision import cast_for_autocast, no_autocast, resolve_allow_tf32

__all__ = [
    "KLPartial",
    "attention_kl_partial",
    "attention_kl_partial_backward",
    "context_parallel_attention_kl",
    "merge_partials",
    "sharded_attention_kl",
]


class KLPartial(NamedTuple):
    """Per-row statistics of ``KL(P_a ‖ P_b)`` over a set of keys, each ``[B, H, N_q]``.

    ``a`` is the distribution the KL is taken under: the teacher for ``direction="forward"``, the student for
    ``"reverse"``. A row with no allowed key in the set (or excluded by ``query_mask``) has ``kl = 0`` and
    ``lse_a = lse_b = -inf``: no probability mass, the neutral element of :func:`merge_partials`.

    Attributes:
        kl: the KL between the two softmaxes restricted to the set (nats).
        lse_a: the log-sum-exp of ``a``'s scores over the set (nats).
        lse_b: the same for ``b``.
    """

    kl: torch.Tensor
    lse_a: torch.Tensor
    lse_b: torch.Tensor


# ---------------------------------------------------------------------------------------------- geometry
def _shard_window(n_q: int, n_k: int, align: int, left: int, right: int) -> tuple[int, int, int, int] | None:
    """Cut a key shard's problem to what the kernels' bottom-right rule can express.

    Local row ``i`` may see local key ``j`` iff ``align - left <= j - i <= align + right`` (an unbounded side when
    its bound is -1). Returns ``(rows, keys, left', right')``: rows ``[0, rows)`` and keys ``[0, keys)`` take part,
    and ``(left', right')`` (each >= 0, or -1) is the window of that cut problem in the kernels' convention (row
    ``i`` aligned to key ``i + keys - rows``). The rows and keys cut off see nothing of the shard. ``None`` when no
    row sees any key.

    Example:
        >>> _shard_window(4, 4, 0, -1, 0)     # the diagonal block of a causal problem
        (4, 4, -1, 0)
        >>> _shard_window(4, 4, 4, -1, 0)     # keys entirely in the rows' past: all visible
        (4, 4, -1, 4)
        >>> _shard_window(4, 4, -4, -1, 0) is None   # entirely in their future
        True
        >>> _shard_window(4, 6, -1, -1, 0)    # keys 3.. are in every row's future: cut to 3 keys
        (4, 3, -1, 0)
    """
    if n_q <= 0 or n_k <= 0:
        return None
    rows, keys = n_q, n_k
    if right >= 0 and keys - rows > align + right:  # keys after the last row's window: nobody sees them
        keys = max(0, rows + align + right)
    if left >= 0 and keys - rows < align - left:  # rows whose window starts after the last key: they see nothing
        rows = max(0, keys - align + left)
    if rows == 0 or keys == 0:
        return None
    offset = keys - rows
    return rows, keys, (offset - align + left) if left >= 0 else -1, (align + right - offset) if right >= 0 else -1


def _cut(inputs: KLInputs, spec: KLSpec, align: int) -> tuple[KLInputs, KLSpec, int, int] | None:
    """The shard's problem cut by :func:`_shard_window` (strided views), its spec, and the rows and keys kept."""
    geometry = _shard_window(inputs.q_a.shape[2], inputs.k_a.shape[2], align, spec.window_left, spec.window_right)
    if geometry is None:
        return None
    rows, keys, left, right = geometry
    r, k = slice(0, rows), slice(0, keys)

    def cut(x: torch.Tensor | None, *index: slice) -> torch.Tensor | None:
        return None if x is None else x[index]

    every = slice(None)
    sub = inputs._replace(
        q_a=inputs.q_a[:, :, r], k_a=inputs.k_a[:, :, k], q_b=inputs.q_b[:, :, r], k_b=inputs.k_b[:, :, k],
        sink_a=None, sink_b=None, key_padding_mask=cut(inputs.key_padding_mask, every, k),
        query_mask=cut(inputs.query_mask, every, r), attn_mask=cut(inputs.attn_mask, every, every, r, k),
    )
    return sub, replace(spec, window_left=left, window_right=right, max_seqlen_q=rows, max_seqlen_k=keys), rows, keys


def _alignment(n_q: int, n_k: int, query_start: object, key_start: object, total_q: object, total_k: object,
               positional: bool) -> int:
    """Where local row 0 is aligned among the shard's keys: ``query_start + total_k - total_q - key_start``."""
    for name, value in (("query_start", query_start), ("key_start", key_start)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TypeError(f"Expected argument `{name}` to be an int >= 0, but got {value!r}.")
    for name, value in (("total_q", total_q), ("total_k", total_k)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise TypeError(f"Expected argument `{name}` to be None or an int >= 0, but got {value!r}.")
    if positional and (total_q is None or total_k is None):
        raise ValueError(
            "Expected `total_q` and `total_k` (the numbers of queries and keys of the whole problem) with `causal` "
            f"or `window`: the mask depends on global positions, but got total_q={total_q!r}, total_k={total_k!r}."
        )
    total_q = n_q + query_start if total_q is None else total_q
    total_k = n_k + key_start if total_k is None else total_k
    if query_start + n_q > total_q:
        raise ValueError(
            f"Expected query_start + N_q <= total_q, but got query_start={query_start}, N_q={n_q}, total_q={total_q}."
        )
    if key_start + n_k > total_k:
        raise ValueError(
            f"Expected key_start + N_k <= total_k, but got key_start={key_start}, N_k={n_k}, total_k={total_k}."
        )
    return query_start + (total_k - total_q) - key_start


# ---------------------------------------------------------------------------------------------- the shard's math
def _partial_forward(inputs: KLInputs, spec: KLSpec, align: int, backend: str, allow_tf32: bool,
                     dtype: torch.dtype) -> KLPartial:
    """One shard's :class:`KLPartial` over all ``N_q`` rows (``-inf`` where the shard has nothing for a row)."""
    shape = inputs.q_a.shape[:3]
    device = inputs.q_a.device
    kl = torch.zeros(shape, dtype=dtype, device=device)
    lse_a = torch.full(shape, float("-inf"), dtype=dtype, device=device)
    lse_b = lse_a.clone()
    cut = _cut(inputs, spec, align)
    if cut is None or shape.numel() == 0:
        return KLPartial(kl, lse_a, lse_b)
    sub, sub_spec, rows, _ = cut
    part_kl, part_a, part_b = forward_impl(sub, sub_spec, backend, allow_tf32)
    empty = torch.isposinf(part_a)  # the kernels' "no allowed key" (+inf) is "no mass" (-inf) here
    kl[:, :, :rows] = part_kl
    lse_a[:, :, :rows] = part_a.masked_fill(empty, float("-inf"))
    lse_b[:, :, :rows] = part_b.masked_fill(empty, float("-inf"))
    return KLPartial(kl, lse_a, lse_b)


def _merge(partials: Sequence[KLPartial]) -> KLPartial:
    """:func:`merge_partials` without the checks (computed in float64, returned in the partials' dtype)."""
    dtype = partials[0].kl.dtype
    kl_s, a_s, b_s = (torch.stack([getattr(p, f).double() for p in partials]) for f in KLPartial._fields)
    lse_a, lse_b = torch.logsumexp(a_s, 0), torch.logsumexp(b_s, 0)
    weight = torch.exp(a_s - lse_a)
    terms = weight * (kl_s + (a_s - lse_a) - (b_s - lse_b))
    terms = torch.where(torch.isneginf(a_s), 0.0, terms)  # a set without mass adds nothing (its terms are NaN)
    kl = torch.where(torch.isneginf(lse_a), 0.0, terms.sum(0))
    return KLPartial(kl.to(dtype), lse_a.to(dtype), lse_b.to(dtype))


def _fold_sinks(total: KLPartial, sink_a: torch.Tensor | None, sink_b: torch.Tensor | None) -> KLPartial:
    """Add the sinks (one more outcome per row, logits ``[H]`` in score units) to the rows that have a key."""
    if sink_a is None or sink_b is None:
        return total
    shape = total.kl.shape
    sink = KLPartial(torch.zeros_like(total.kl), sink_a.detach().to(total.kl.dtype)[None, :, None].expand(shape),
                     sink_b.detach().to(total.kl.dtype)[None, :, None].expand(shape))
    merged = _merge([total, sink])
    keep = ~torch.isneginf(total.lse_a)  # a row with no key is not counted, sink or not (as in attention_kl)
    return KLPartial(*(torch.where(keep, m, t) for m, t in zip(merged, total)))


def _kernel_stats(total: KLPartial) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The merged statistics in the kernels' convention: ``lse = +inf`` on rows without a key."""
    empty = torch.isneginf(total.lse_a)
    return total.kl, total.lse_a.masked_fill(empty, float("inf")), total.lse_b.masked_fill(empty, float("inf"))


def _partial_backward(grad_kl: torch.Tensor, inputs: KLInputs, spec: KLSpec, align: int, kl: torch.Tensor,
                      lse_a: torch.Tensor, lse_b: torch.Tensor, need_a: bool, need_b: bool, options: tuple[Any, ...]
                      ) -> tuple[torch.Tensor | None, ...]:
    """``(dq_a, dk_a, dq_b, dk_b)`` of one shard (full shapes, zero where the shard was cut; None if not needed)
    from the merged statistics in the kernels' convention. ``options`` = ``(backend, allow_tf32, deterministic)``."""
    backend, allow_tf32, deterministic = options
    dtype = kl.dtype
    like = (inputs.q_a, inputs.k_a, inputs.q_b, inputs.k_b)
    needs = (need_a, need_a, need_b, need_b)
    grads = [torch.zeros(x.shape, dtype=dtype, device=x.device) if n else None for x, n in zip(like, needs)]
    cut = _cut(inputs, spec, align)
    if cut is None or not (need_a or need_b) or kl.numel() == 0:
        return tuple(grads)
    sub, sub_spec, rows, keys = cut
    stats = [x[:, :, :rows].contiguous() for x in (grad_kl, kl, lse_a, lse_b)]
    with no_autocast(kl.device):
        parts = dispatch_backward(stats[0], sub, sub_spec, *stats[1:], need_a, need_b, backend, allow_tf32,
                                  deterministic)
    for grad, part, n in zip(grads, parts, (rows, keys, rows, keys)):
        if grad is not None:
            grad[:, :, :n] = part
    return tuple(grads)


# ---------------------------------------------------------------------------------------------- validation
def _prepare(q_t: torch.Tensor, k_t: torch.Tensor, q_s: torch.Tensor, k_s: torch.Tensor, options: dict[str, Any],
             **masks: Any) -> tuple[KLInputs, KLSpec, str, Any]:
    """Validate one shard's problem like :func:`streamkl.attention_kl` does; returns the kernel problem, the
    backend that runs it and the validated problem."""
    if options.get("layout") == "thd":
        raise ValueError(
            "Expected argument `layout` to be 'bhnd' or 'bnhd' for a sharded KL, but got 'thd': packed sequences are "
            "not sharded; shard each sequence on its own (layout 'bhnd' with B = 1)."
        )
    q_t, k_t, q_s, k_s = cast_for_autocast(q_t, k_t, q_s, k_s)  # as attention_kl (streamkl.precision)
    problem = prepare_problem(q_t, k_t, q_s, k_s, AttentionKLOptions(reduction="none", **options, **masks))
    backend = select_backend(options.get("backend", "auto"), problem.q_t.device,
                              (problem.q_t.dtype, problem.q_s.dtype), (problem.q_t.shape[-1], problem.q_s.shape[-1]))
    inputs, spec = problem.kernel_problem()
    return inputs, spec, backend, problem


def _check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"Expected argument `{name}` to be a bool, but got {type(value).__name__}.")
    return value


def _positional(causal: bool, window: Any) -> bool:
    return bool(causal) or (window is not None and tuple(window) != (-1, -1))


def _to_layout(grad: torch.Tensor | None, layout: str) -> torch.Tensor | None:
    """A gradient in the canonical ``(B, H, N, D)`` view back in the user's layout."""
    return grad.transpose(1, 2) if grad is not None and layout == "bnhd" else grad


# ---------------------------------------------------------------------------------------------- public: parts
def attention_kl_partial(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    q_s: torch.Tensor,
    k_s: torch.Tensor,
    *,
    query_start: int = 0,
    key_start: int = 0,
    total_q: int | None = None,
    total_k: int | None = None,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    key_padding_mask: torch.Tensor | None = None,
    query_mask: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    scale_t: float | None = None,
    scale_s: float | None = None,
    temperature: float = 1.0,
    direction: str = "forward",
    softcap_t: float | None = None,
    softcap_s: float | None = None,
    layout: str = "bhnd",
    backend: str = "auto",
    allow_tf32: bool | None = None,
) -> KLPartial:
    r"""The per-row statistics of the attention KL over one shard of the keys (no gradient).

    Merge the shards' partials with :func:`merge_partials`; the merged ``kl`` is what :func:`streamkl.attention_kl`
    returns with ``reduction="none"`` over all keys (rows without any key: 0).

    Args:
        q_t, q_s: the queries (the rows this call computes), as in :func:`streamkl.attention_kl`.
        k_t, k_s: the shard's keys ``[B, H_k, n_k, D]`` (``n_k`` may be 0).
        query_start: the global index of the first of these queries. Default: 0.
        key_start: the global index of the shard's first key. Default: 0.
        total_q: the number of queries of the whole problem; with ``key_start`` and the others it places the
            causal diagonal and the window. Required with ``causal``/``window``. Default: None.
        total_k: the number of keys of the whole problem. Required with ``causal``/``window``. Default: None.
        causal, window: as in :func:`streamkl.attention_kl`, on the global positions.
        key_padding_mask: ``[B, n_k]`` bool, the shard's columns (True = real key). Default: None.
        query_mask: ``[B, N_q]`` bool, False excludes the row (it gets no mass). Default: None.
        attn_mask: ``[B or 1, H or 1, N_q, n_k]`` bool, these rows × the shard's keys. Default: None.
        scale_t, scale_s, temperature, direction, softcap_t, softcap_s, layout, backend, allow_tf32: as in
            :func:`streamkl.attention_kl` (``layout`` "bhnd" or "bnhd").

    Returns:
        :class:`KLPartial`, each ``[B, H, N_q]`` float32 (float64 for float64 inputs).

    Raises:
        TypeError, ValueError: what :func:`streamkl.attention_kl` raises for the same arguments; a position that is
            not an int >= 0, positions outside the totals, missing totals with ``causal``/``window``, layout "thd".

    Example:
        Two shards of 8 keys each, merged, equal the op over all 16 keys:

        >>> import torch
        >>> from streamkl import attention_kl
        >>> q_t, k_t, q_s, k_s = (torch.randn(1, 2, 16, 8, dtype=torch.float64) for _ in range(4))
        >>> parts = [attention_kl_partial(q_t, k_t[:, :, i:i + 8], q_s, k_s[:, :, i:i + 8], key_start=i,
        ...                               total_q=16, total_k=16, causal=True) for i in (0, 8)]
        >>> merged = merge_partials(parts)
        >>> full = attention_kl(q_t, k_t, q_s, k_s, causal=True, reduction="none")
        >>> torch.allclose(merged.kl, full, rtol=1e-12, atol=1e-12)
        True
    """
    call = {k: v for k, v in locals().items() if k not in ("q_t", "k_t", "q_s", "k_s")}
    inputs, spec, problem, align, (impl, tf32) = _shard_problem(q_t, k_t, q_s, k_s, call)
    dtype = torch.float64 if torch.float64 in (problem.q_t.dtype, problem.q_s.dtype) else torch.float32
    with torch.no_grad():
        return _partial_forward(inputs, spec, align, impl, tf32, dtype)


#: The options of a shard that :func:`streamkl.attention_kl` validates (everything but positions and masks).
_OP_OPTIONS = ("causal", "window", "scale_t", "scale_s", "temperature", "direction", "softcap_t", "softcap_s",
               "layout", "backend")


def _shard_problem(q_t: torch.Tensor, k_t: torch.Tensor, q_s: torch.Tensor, k_s: torch.Tensor,
                   call: dict[str, Any]) -> tuple[KLInputs, KLSpec, Any, int, tuple[str, bool]]:
    """Validate one shard's keyword arguments (those of :func:`attention_kl_partial`, defaults filled in) and place
    the shard: the kernel problem, its spec, the validated problem, the alignment and ``(backend, allow_tf32)``.

    Raises:
        TypeError: a keyword :func:`attention_kl_partial` does not take, or what it raises.
    """
    bound = inspect.signature(attention_kl_partial).bind(q_t, k_t, q_s, k_s, **call)
    bound.apply_defaults()
    given = bound.arguments
    inputs, spec, impl, problem = _prepare(q_t, k_t, q_s, k_s, {k: given[k] for k in _OP_OPTIONS},
                                           key_padding_mask=given["key_padding_mask"],
                                           query_mask=given["query_mask"], attn_mask=given["attn_mask"])
    align = _alignment(problem.n_q, problem.n_k, given["query_start"], given["key_start"], given["total_q"],
                       given["total_k"], _positional(given["causal"], given["window"]))
    return inputs, spec, problem, align, (impl, resolve_allow_tf32(given["allow_tf32"]))


def merge_partials(partials: Sequence[KLPartial]) -> KLPartial:
    r"""Merge the :class:`KLPartial` of disjoint key sets into the statistics over their union, exactly.

    Associative and commutative; a set without keys (``lse = -inf``) is neutral. Computed in float64, returned in
    the partials' dtype. Not differentiable (use :func:`sharded_attention_kl` for gradients, or
    :func:`attention_kl_partial_backward`).

    Raises:
        TypeError: not a non-empty sequence of :class:`KLPartial`.
        ValueError: partials of different shapes or devices.

    Example:
        Two one-key shards: ``a`` scores both keys 0, ``b`` scores them 0 and ``log 3`` (``P_b = (1/4, 3/4)``):

        >>> import math
        >>> row = lambda v: torch.full((1, 1, 1), v)
        >>> merged = merge_partials([KLPartial(row(0.0), row(0.0), row(0.0)),
        ...                          KLPartial(row(0.0), row(0.0), row(math.log(3)))])
        >>> round(float(merged.kl), 6), round(0.5 * math.log(4 / 3), 6)   # ½·log(½/¼) + ½·log(½/¾)
        (0.143841, 0.143841)
    """
    if isinstance(partials, KLPartial) or not isinstance(partials, Sequence) or not partials:
        raise TypeError(
            f"Expected argument `partials` to be a non-empty sequence of KLPartial, but got {type(partials).__name__}"
            + (" (empty)" if isinstance(partials, Sequence) and not partials else "") + "."
        )
    for i, p in enumerate(partials):
        if not isinstance(p, KLPartial):
            raise TypeError(f"Expected `partials[{i}]` to be a KLPartial, but got {type(p).__name__}.")
        shape, device = tuple(partials[0].kl.shape), partials[0].kl.device
        for name, x in zip(KLPartial._fields, p):
            if tuple(x.shape) != shape or x.device != device:
                raise ValueError(
                    f"Expected every partial to have shape {shape} on {device} like partials[0].kl, but "
                    f"partials[{i}].{name} has shape {tuple(x.shape)} on {x.device}."
                )
    return _merge(list(partials))


def attention_kl_partial_backward(
    grad_kl: torch.Tensor,
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    q_s: torch.Tensor,
    k_s: torch.Tensor,
    merged: KLPartial,
    *,
    teacher_grads: bool = False,
    deterministic: bool = True,
    **options: Any,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    r"""One shard's share of the gradients of ``Σ grad_kl · KL``, from the merged statistics of all shards.

    The gradients of the queries are the sum of every shard's ``dq``; the shard's keys get their whole gradient
    here (``dk`` of keys the rows never see is 0). Arguments as in :func:`attention_kl_partial` (the same for the
    shard as in its forward), plus:

    Args:
        grad_kl: ``[B, H, N_q]``: the upstream gradient of each row's KL.
        merged: the :func:`merge_partials` of every shard's partial (all keys).
        teacher_grads: also return the teacher's gradients. Default: False.
        deterministic: as in :func:`streamkl.attention_kl`. Default: True.
        options: the keyword arguments of :func:`attention_kl_partial` (positions, masks, options), as given to
            the shard's forward.

    Returns:
        ``(dq_t, dk_t, dq_s, dk_s)`` shaped like the inputs, in their dtypes (the teacher's None unless
        ``teacher_grads``).

    Example:
        >>> import torch
        >>> from streamkl import attention_kl
        >>> q_t, k_t = torch.randn(1, 2, 6, 8, dtype=torch.float64), torch.randn(1, 2, 6, 8, dtype=torch.float64)
        >>> q_s = torch.randn(1, 2, 6, 8, dtype=torch.float64, requires_grad=True)
        >>> k_s = torch.randn(1, 2, 6, 8, dtype=torch.float64, requires_grad=True)
        >>> shards = [(0, 2), (2, 6)]
        >>> opts = dict(total_q=6, total_k=6, causal=True)
        >>> merged = merge_partials([attention_kl_partial(q_t, k_t[:, :, a:b], q_s, k_s[:, :, a:b], key_start=a,
        ...                                               **opts) for a, b in shards])
        >>> g = torch.ones(1, 2, 6, dtype=torch.float64)
        >>> grads = [attention_kl_partial_backward(g, q_t, k_t[:, :, a:b], q_s, k_s[:, :, a:b], merged, key_start=a,
        ...                                        **opts) for a, b in shards]
        >>> attention_kl(q_t, k_t, q_s, k_s, causal=True, reduction="sum").backward()
        >>> bool(torch.allclose(sum(g[2] for g in grads), q_s.grad))
        True
        >>> bool(torch.allclose(torch.cat([g[3] for g in grads], 2), k_s.grad))
        True
    """
    teacher_grads = _check_flag("teacher_grads", teacher_grads)
    deterministic = _check_flag("deterministic", deterministic) or torch.are_deterministic_algorithms_enabled()
    inputs, spec, problem, align, (impl, allow_tf32) = _shard_problem(q_t, k_t, q_s, k_s, options)
    if not isinstance(merged, KLPartial):
        raise TypeError(f"Expected argument `merged` to be a KLPartial, but got {type(merged).__name__}.")
    rows = tuple(problem.q_t.shape[:3])
    for name, x in (("grad_kl", grad_kl), *((f"merged.{f}", v) for f, v in zip(KLPartial._fields, merged))):
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != rows:
            raise ValueError(
                f"Expected `{name}` to be a tensor of shape (B, H, N_q) = {rows}, but got "
                f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}."
            )
    kl, lse_a, lse_b = _kernel_stats(merged)
    need_t, need_s = teacher_grads, True
    need_a, need_b = (need_s, need_t) if problem.reverse else (need_t, need_s)
    with torch.no_grad():
        grads = _partial_backward(grad_kl.to(kl.dtype), inputs, spec, align, kl, lse_a, lse_b, need_a, need_b,
                                  (impl, allow_tf32, deterministic))
    dq_a, dk_a, dq_b, dk_b = (None if g is None else g.to(x.dtype)
                              for g, x in zip(grads, (inputs.q_a, inputs.k_a, inputs.q_b, inputs.k_b)))
    teacher, student = ((dq_b, dk_b), (dq_a, dk_a)) if problem.reverse else ((dq_a, dk_a), (dq_b, dk_b))
    return (*(_to_layout(g, problem.layout) for g in teacher),  # type: ignore[return-value]
            *(_to_layout(g, problem.layout) for g in student))


# ---------------------------------------------------------------------------------------------- public: the KL
@dataclass(frozen=True)
class _Plan:
    """Everything but the differentiable tensors of one sharded problem (in the kernels' a/b terms)."""

    shards: tuple[KLInputs, ...]  # each shard's inputs (masks included); q and k are replaced at every call
    spec: KLSpec
    aligns: tuple[int, ...]
    options: tuple[Any, ...]  # (backend, allow_tf32, deterministic)
    dtype: torch.dtype

    def inputs(self, i: int, q_a: torch.Tensor, q_b: torch.Tensor, k_a: torch.Tensor, k_b: torch.Tensor) -> KLInputs:
        return self.shards[i]._replace(q_a=q_a, k_a=k_a, q_b=q_b, k_b=k_b, sink_a=None, sink_b=None)


class _ShardedKLFunction(torch.autograd.Function):
    """``apply(plan, q_a, q_b, sink_a, sink_b, k_a_0, k_b_0, k_a_1, k_b_1, ...) -> (kl, lse_a, lse_b)`` in the
    kernels' convention (``+inf`` on rows without a key); only ``kl`` is differentiable."""

    @staticmethod
    def forward(ctx, plan: _Plan, q_a, q_b, sink_a, sink_b, *keys):
        backend, allow_tf32, _ = plan.options
        partials = [_partial_forward(plan.inputs(i, q_a, q_b, keys[2 * i], keys[2 * i + 1]), plan.spec, align,
                                     backend, allow_tf32, plan.dtype) for i, align in enumerate(plan.aligns)]
        kl, lse_a, lse_b = _kernel_stats(_fold_sinks(_merge(partials), sink_a, sink_b))
        ctx.save_for_backward(q_a, q_b, sink_a, sink_b, kl, lse_a, lse_b, *keys)
        ctx.plan = plan
        ctx.mark_non_differentiable(lse_a, lse_b)
        return kl, lse_a, lse_b

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_kl, _grad_lse_a, _grad_lse_b):
        plan: _Plan = ctx.plan
        q_a, q_b, sink_a, sink_b, kl, lse_a, lse_b, *keys = ctx.saved_tensors
        need = ctx.needs_input_grad
        need_a = bool(need[1] or any(need[5::2]))
        need_b = bool(need[2] or any(need[6::2]))
        out: list[torch.Tensor | None] = [None] * len(need)
        if grad_kl is None:
            return tuple(out)
        grad_kl = grad_kl.to(kl.dtype).contiguous()
        dq_a = torch.zeros(q_a.shape, dtype=kl.dtype, device=q_a.device) if need_a else None
        dq_b = torch.zeros(q_b.shape, dtype=kl.dtype, device=q_b.device) if need_b else None
        if need_a or need_b:
            for i, align in enumerate(plan.aligns):
                k_a, k_b = keys[2 * i], keys[2 * i + 1]
                g_qa, g_ka, g_qb, g_kb = _partial_backward(grad_kl, plan.inputs(i, q_a, q_b, k_a, k_b), plan.spec,
                                                           align, kl, lse_a, lse_b, need_a, need_b, plan.options)
                if need_a:
                    dq_a += g_qa
                    out[5 + 2 * i] = g_ka.to(k_a.dtype)
                if need_b:
                    dq_b += g_qb
                    out[6 + 2 * i] = g_kb.to(k_b.dtype)
        out[1] = None if dq_a is None else dq_a.to(q_a.dtype)
        out[2] = None if dq_b is None else dq_b.to(q_b.dtype)
        out[3], out[4] = sink_gradients(grad_kl, kl, lse_a, lse_b, sink_a, sink_b, bool(need[3]), bool(need[4]))
        return tuple(out)


def sharded_attention_kl(
    q_t: torch.Tensor,
    k_t: Sequence[torch.Tensor],
    q_s: torch.Tensor,
    k_s: Sequence[torch.Tensor],
    *,
    query_start: int = 0,
    total_q: int | None = None,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    key_padding_mask: torch.Tensor | None = None,
    query_mask: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    scale_t: float | None = None,
    scale_s: float | None = None,
    temperature: float = 1.0,
    direction: str = "forward",
    reduction: str = "mean",
    softcap_t: float | None = None,
    softcap_s: float | None = None,
    sinks_t: torch.Tensor | None = None,
    sinks_s: torch.Tensor | None = None,
    layout: str = "bhnd",
    backend: str = "auto",
    allow_tf32: bool | None = None,
    deterministic: bool = True,
) -> torch.Tensor:
    r"""The attention KL of the queries against keys given as consecutive shards, differentiable.

    Equal to :func:`streamkl.attention_kl` on the concatenated keys (and, with ``query_start``/``total_q``, on
    these rows of a larger problem), without concatenating them: each shard is computed on its own
    (:func:`attention_kl_partial`), the partials are merged (:func:`merge_partials`), and the backward runs every
    shard's backward with the merged statistics (:func:`attention_kl_partial_backward`). Shards may live on
    different storage; each keeps its own gradient. The options ``causal``, ``window``, ``scale_t``, ``scale_s``,
    ``temperature``, ``direction``, ``softcap_t``, ``softcap_s``, ``layout``, ``backend``, ``allow_tf32`` and
    ``deterministic`` mean what they mean in :func:`streamkl.attention_kl`.

    Args:
        q_t, q_s: the queries ``[B, H, N_q, D]``: rows ``query_start .. query_start + N_q - 1`` of the problem.
        k_t, k_s: the key shards, in order (shard ``i`` starts where shard ``i - 1`` ends; ``total_k`` is the sum
            of their lengths); ``k_t[i]`` and ``k_s[i]`` hold the same positions. A shard may be empty.
        query_start: the global index of the first query. Default: 0.
        total_q: the number of queries of the whole problem. Default: None: ``query_start + N_q``.
        key_padding_mask: ``[B, total_k]`` bool over all shards' keys. Default: None.
        query_mask: ``[B, N_q]`` bool. Default: None.
        attn_mask: ``[B or 1, H or 1, N_q, total_k]`` bool. Default: None.
        reduction: ``"none"`` (per row ``[B, H, N_q]``), ``"sum"`` or ``"mean"`` over these rows (counted as in
            :func:`streamkl.attention_kl`). Default: ``"mean"``.
        sinks_t, sinks_s: sink logits ``[H]``, folded in once after the merge. Default: None.

    Returns:
        The KL like :func:`streamkl.attention_kl` (float32, float64 for float64 inputs).

    Raises:
        TypeError, ValueError: what :func:`streamkl.attention_kl` raises for the same arguments; ``k_t``/``k_s``
            not sequences of tensors of the same length, layout "thd", bad positions.

    Example:
        >>> import torch
        >>> from streamkl import attention_kl
        >>> q_t, k_t = torch.randn(2, 4, 12, 16), torch.randn(2, 2, 12, 16)
        >>> q_s, k_s = torch.randn(2, 4, 12, 8, requires_grad=True), torch.randn(2, 2, 12, 8, requires_grad=True)
        >>> mask = torch.rand(2, 12) > 0.2
        >>> loss = sharded_attention_kl(q_t, k_t.split(5, dim=2), q_s, k_s.split(5, dim=2), causal=True,
        ...                             key_padding_mask=mask)
        >>> full = attention_kl(q_t, k_t, q_s, k_s, causal=True, key_padding_mask=mask)
        >>> torch.allclose(loss, full, atol=1e-6)
        True
    """
    for name, shards in (("k_t", k_t), ("k_s", k_s)):
        if isinstance(shards, torch.Tensor) or not isinstance(shards, Sequence) or not shards \
                or not all(isinstance(x, torch.Tensor) for x in shards):
            raise TypeError(
                f"Expected argument `{name}` to be a non-empty sequence of key shards (tensors), but got "
                f"{type(shards).__name__}; split the keys, e.g. `k.split(n, dim=2)`."
            )
    if len(k_t) != len(k_s):
        raise ValueError(f"Expected `k_t` and `k_s` to hold the same number of shards, but got {len(k_t)} and "
                         f"{len(k_s)}.")
    deterministic = _check_flag("deterministic", deterministic) or torch.are_deterministic_algorithms_enabled()
    allow_tf32 = resolve_allow_tf32(allow_tf32)
    if not isinstance(reduction, str) or reduction not in ("none", "sum", "mean"):
        raise ValueError(f"Expected argument `reduction` to be one of ['none', 'sum', 'mean'], but got {reduction!r}.")
    seq_dim = 1 if layout == "bnhd" else 2
    lengths = [int(x.shape[seq_dim]) if x.dim() == 4 else 0 for x in k_t]
    total_k = sum(lengths)
    options = dict(causal=causal, window=window, scale_t=scale_t, scale_s=scale_s, temperature=temperature,
                   direction=direction, softcap_t=softcap_t, softcap_s=softcap_s, layout=layout, backend=backend)
    _check_full_mask("key_padding_mask", key_padding_mask, q_t, total_k, -1)
    _check_full_mask("attn_mask", attn_mask, q_t, total_k, -1)
    shards, keys, aligns = [], [], []
    start, sinks, first = 0, None, None
    for i, (kt, ks) in enumerate(zip(k_t, k_s)):
        stop = start + lengths[i]
        kpm = None if key_padding_mask is None else key_padding_mask[:, start:stop]
        am = None if attn_mask is None else attn_mask[..., start:stop]
        inputs, spec, impl, problem = _prepare(q_t, kt, q_s, ks, options, key_padding_mask=kpm, query_mask=query_mask,
                                               attn_mask=am, sinks_t=sinks_t if i == 0 else None,
                                               sinks_s=sinks_s if i == 0 else None)
        if i == 0:
            first, sinks = (problem, spec, impl), (inputs.sink_a, inputs.sink_b)
        aligns.append(_alignment(problem.n_q, problem.n_k, query_start, start, total_q, total_k, False))
        shards.append(inputs)
        keys += [inputs.k_a, inputs.k_b]
        start = stop
    problem, spec, impl = first  # type: ignore[misc]
    dtype = torch.float64 if torch.float64 in (problem.q_t.dtype, problem.q_s.dtype) else torch.float32
    plan = _Plan(tuple(shards), spec, tuple(aligns), (impl, allow_tf32, deterministic), dtype)
    kl, lse_a, _ = _ShardedKLFunction.apply(plan, shards[0].q_a, shards[0].q_b, *sinks, *keys)
    return reduce_per_row_kl(kl, ~torch.isposinf(lse_a), reduction)


def _check_full_mask(name: str, mask: object, q: torch.Tensor, total_k: int, dim: int) -> None:
    """A mask over all shards' keys must span ``total_k`` columns (the rest is checked shard by shard)."""
    if isinstance(mask, torch.Tensor) and mask.dim() >= 2 and mask.shape[dim] != total_k:
        raise ValueError(
            f"Expected argument `{name}` to span all {total_k} keys of the shards in its last dim, but got shape "
            f"{tuple(mask.shape)}."
        )


# ---------------------------------------------------------------------------------------------- torch.distributed
class _GatherShards(torch.autograd.Function):
    """``apply(group, x) -> (x of rank 0, x of rank 1, ...)``: an all-gather whose backward sums each shard's
    gradient over the group onto the rank that owns it (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, group, x: torch.Tensor):
        import torch.distributed as dist

        x = x.contiguous()
        shards = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shards, x, group=group)
        ctx.group = group
        return tuple(shards)

    @staticmethod
    def backward(ctx, *grads):
        import torch.distributed as dist

        grads = [g.contiguous() for g in grads]
        out = torch.empty_like(grads[0])
        dist.reduce_scatter(out, grads, group=ctx.group)
        return None, out


def _gather_mask(mask: torch.Tensor, group: Any) -> torch.Tensor:
    """All-gather a ``[B, n]`` bool mask along its columns (as uint8: not every backend moves bools)."""
    import torch.distributed as dist

    parts = [torch.empty_like(mask, dtype=torch.uint8) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mask.to(torch.uint8).contiguous(), group=group)
    return torch.cat(parts, 1).bool()


def context_parallel_attention_kl(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    q_s: torch.Tensor,
    k_s: torch.Tensor,
    *,
    group: Any = None,
    key_padding_mask: torch.Tensor | None = None,
    **options: Any,
) -> torch.Tensor:
    r"""The attention KL of a sequence split across the ranks of a ``torch.distributed`` group (context parallel).

    Every rank of ``group`` (``W`` ranks, rank ``r``) holds the same-sized contiguous chunk of the sequence:
    queries ``r·n_q .. (r+1)·n_q - 1`` and keys ``r·n_k .. (r+1)·n_k - 1`` of a problem with ``W·n_q`` queries and
    ``W·n_k`` keys, teacher and student alike. The keys are all-gathered (one collective per side; the key padding
    mask too), each rank computes its own rows' KL against every shard (:func:`sharded_attention_kl`; shards in a
    rank's causal future are skipped), and the backward sums the keys' gradients onto the ranks that own them (a
    reduce-scatter), so every rank's ``q``/``k`` gradients are exactly those of the whole problem's KL.

    Every rank must call it (it is collective). The result is this rank's: per row (``"none"``), or the sum or the
    mean over this rank's counted rows. With a data-parallel gradient average over the group, the mean of the ranks'
    ``"mean"`` is the whole sequence's mean when every rank counts the same number of rows (``"sum"`` divided by
    the global count otherwise). Sinks (replicated) get this rank's share of their gradient.

    Args:
        q_t, k_t, q_s, k_s: this rank's chunk, ``[B, H, n_q, D]`` / ``[B, H_k, n_k, D]`` (or "bnhd").
        group: the process group (default: the world).
        key_padding_mask: ``[B, n_k]`` bool, this rank's keys. Default: None.
        options: the other keyword arguments of :func:`sharded_attention_kl` (``causal``, ``window``,
            ``reduction``, ``sinks_t``/``sinks_s``, ``layout``, ``backend``, ...; not the positions, which come from
            the rank): ``query_mask`` is ``[B, n_q]`` (this rank's queries), ``attn_mask``
            ``[B or 1, H or 1, n_q, W·n_k]`` (this rank's rows against all keys: costly, prefer the structured
            masks).

    Returns:
        This rank's KL (per row ``[B, H, n_q]``, or a scalar).

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        TypeError: ``query_start`` or ``total_q`` given (the rank places its chunk), or what
            :func:`sharded_attention_kl` raises.
        ValueError: ranks with different ``B``/``n_q``/``n_k``; what :func:`sharded_attention_kl` raises.

    Example:
        On each of ``W`` processes (``torch.distributed`` initialised, e.g. by ``torchrun``), with this rank's
        chunk of a long sequence::

            loss = context_parallel_attention_kl(q_t, k_t, q_s, k_s, causal=True)
            loss.backward()   # gradients of this rank's q_s and k_s, exactly those of the whole sequence's KL

        ``tests/streamkl/test_sharded.py`` runs it on 2 CPU processes (gloo) against the single-process op.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context_parallel_attention_kl needs torch.distributed initialised (init_process_group).")
    placed = sorted({"query_start", "total_q"} & set(options))
    if placed:
        raise TypeError(f"context_parallel_attention_kl() places each rank's chunk itself; do not pass {placed}.")
    layout = options.get("layout", "bhnd")
    for name, x in (("q_t", q_t), ("k_t", k_t), ("q_s", q_s), ("k_s", k_s)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"Expected argument `{name}` to be a 4-D tensor (layout {layout!r}), but got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}.")
    if layout not in ("bhnd", "bnhd"):
        raise ValueError(f"Expected argument `layout` to be 'bhnd' or 'bnhd' for a sharded KL, but got {layout!r}.")
    seq = 1 if layout == "bnhd" else 2
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    sizes = torch.tensor([q_t.shape[0], q_t.shape[seq], k_t.shape[seq]], dtype=torch.int64, device=q_t.device)
    every = [torch.empty_like(sizes) for _ in range(world)]
    dist.all_gather(every, sizes, group=group)
    every_list = [tuple(s.tolist()) for s in every]
    if len(set(every_list)) != 1:
        raise ValueError(
            "Expected every rank to hold the same batch size B and the same numbers of queries and keys (n_q, n_k), "
            f"but got (B, n_q, n_k) = {every_list} by rank."
        )
    n_q = int(q_t.shape[seq])
    kpm = None if key_padding_mask is None else _gather_mask(key_padding_mask, group)
    return sharded_attention_kl(q_t, _GatherShards.apply(group, k_t), q_s, _GatherShards.apply(group, k_s),
                                query_start=rank * n_q, total_q=world * n_q, key_padding_mask=kpm, **options)
