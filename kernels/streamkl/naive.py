"""Materialising oracle for the attention KL divergence: the definition of "correct".

It builds both full ``N_q × N_k`` score maps, applies soft-capping, the masks (causal, sliding window, key
padding, packed-sequence boundaries) and the sinks (one extra column per side), takes ``log_softmax`` and sums
``P (log P - log Q)`` row by row, all through ordinary differentiable torch ops. It needs ``O(B·H·N_q·N_k)``
memory (packed inputs: ``total_q × total_k``), so it is only for tests, for small problems and as the baseline
that the benchmarks beat. Give it float64 inputs (or ``compute_dtype=torch.float64``) to use it as the oracle.

Everything here is written from the definitions in :func:`streamkl.attention_kl`'s docstring, independently of
the streaming backends: the mask is one boolean map, the sink is one more column.
"""

from __future__ import annotations

from typing import Any

import torch

from ._problem import AttentionKLProblem
from ._reduction import reduce_per_row_kl
from ._validation import prepare_problem, result_dtype
from .options import BATCH, PROBLEM, AttentionKLOptions, KLWithCount, keyword_signature


def _expand_kv(k: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, H_k, N, D) -> (B, H, N, D): query head h reads key head h // (H // H_k)."""
    return k.repeat_interleave(heads // k.shape[1], dim=1)


def _positions(cu_seqlens: torch.Tensor | None, total: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per token: (sequence id, position inside its sequence, length of its sequence)."""
    if cu_seqlens is None:
        index = torch.arange(total, device=device)
        return torch.zeros_like(index), index, torch.full_like(index, total)
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    lengths = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
    return seq, torch.arange(total, device=device) - cu[seq], lengths[seq]


def allowed_keys(problem: AttentionKLProblem) -> torch.Tensor:
    """Bool map ``(B or 1, 1 or H, N_q, N_k)`` of allowed (query, key) pairs.

    Query ``i`` of a sequence with ``n_q`` queries and ``n_k`` keys sees key ``j`` of the same sequence iff
    ``i' − left ≤ j ≤ i' + right`` with ``i' = i + n_k − n_q`` (bottom-right alignment, as FlashAttention;
    −1 = unbounded; causal is ``right = 0``), the key padding mask keeps ``j`` and ``attn_mask`` allows the pair.
    """
    device = problem.q_t.device
    seq_q, pos_q, len_q = _positions(problem.cu_seqlens_q, problem.n_q, device)
    seq_k, pos_k, _len_k = _positions(problem.cu_seqlens_k, problem.n_k, device)
    if problem.cu_seqlens_q is None:
        len_k_of_row = torch.full_like(pos_q, problem.n_k)
    else:
        cu_k = problem.cu_seqlens_k.to(device=device, dtype=torch.long)
        len_k_of_row = (cu_k[1:] - cu_k[:-1])[seq_q]
    aligned = (pos_q + len_k_of_row - len_q)[:, None]  # i' of every row
    j = pos_k[None, :]
    allowed = seq_q[:, None] == seq_k[None, :]
    left, right = problem.window
    if left >= 0:
        allowed = allowed & (j >= aligned - left)
    if right >= 0:
        allowed = allowed & (j <= aligned + right)
    allowed = allowed[None, None]
    if problem.key_padding_mask is not None:
        allowed = allowed & problem.key_padding_mask[:, None, None, :]
    if problem.attn_mask is not None:
        allowed = allowed & problem.attn_mask
    return allowed


def _scores(q: torch.Tensor, k: torch.Tensor, heads: int, scale: float, cap: float | None, temperature: float):
    raw = q @ _expand_kv(k, heads).transpose(-1, -2)
    if cap is None:
        return raw * scale / temperature
    return cap * torch.tanh(raw * scale / cap) / temperature


def naive_per_row_kl(problem: AttentionKLProblem, compute_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row KL ``(B, H, N_q)`` of a validated problem, materialising both probability maps; also returns the
    ``(B, 1 or H, N_q)`` bool map of counted rows (at least one allowed key, kept by the query mask)."""
    heads, t = problem.heads, problem.temperature
    q_t, k_t, q_s, k_s = (x.to(compute_dtype) for x in (problem.q_t, problem.k_t, problem.q_s, problem.k_s))
    s_t = _scores(q_t, k_t, heads, problem.scale_t, problem.softcap_t, t)
    s_s = _scores(q_s, k_s, heads, problem.scale_s, problem.softcap_s, t)
    allowed = allowed_keys(problem)
    row_valid = allowed.any(-1)
    if problem.query_mask is not None:
        row_valid = row_valid & problem.query_mask[:, None, :]
    if problem.sinks_t is not None:  # one more outcome per side: the sink, logit sink/T, never masked
        def with_sink(s: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
            column = (sinks.to(compute_dtype) / t)[None, :, None, None].expand(*s.shape[:3], 1)
            return torch.cat([s, column], dim=-1)

        s_t, s_s = with_sink(s_t, problem.sinks_t), with_sink(s_s, problem.sinks_s)
        allowed = torch.cat([allowed, torch.ones_like(allowed[..., :1])], dim=-1)
    if problem.reverse:
        s_t, s_s = s_s, s_t  # KL(P_s || P_t): the expectation is taken under the student
    keep = allowed & row_valid[..., None]

    # Masked scores become -inf (probability 0); rows with no allowed key become all-zero rows so that
    # log_softmax stays finite, and every term of such a row is then zeroed by `keep` (KL 0, gradient 0).
    def log_probs(s: torch.Tensor) -> torch.Tensor:
        s = s.masked_fill(~allowed, float("-inf")).masked_fill(~row_valid[..., None], 0.0)
        return torch.log_softmax(s, dim=-1).masked_fill(~keep, 0.0)

    logp, logq = log_probs(s_t), log_probs(s_s)
    p = torch.exp(logp).masked_fill(~keep, 0.0)
    return (p * (logp - logq)).sum(-1), row_valid


def naive_attention_kl(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    q_s: torch.Tensor,
    k_s: torch.Tensor,
    *,
    options: AttentionKLOptions | None = None,
    compute_dtype: torch.dtype | None = None,
    **kwargs: Any,
) -> torch.Tensor | KLWithCount:
    r"""KL divergence between two attention distributions, computed by materialising them.

    Same arguments and semantics as :func:`streamkl.attention_kl` (see there) except the options that choose how the
    op runs (``backend``, ``allow_tf32``, ``deterministic``, ``check_finite``: an ``options`` instance may hold them,
    and they are ignored here), plus ``compute_dtype``: the dtype of the math (default float32, float64 when an input
    is float64). Differentiable through plain autograd. Memory is ``O(B·H·N_q·N_k)``: use it as the oracle and as the
    naive baseline only. Non-finite values in entries a row never sees do not reach that row's KL; in the gradients
    of this oracle they may (``0 · inf`` in the backward of a masked product), which :func:`streamkl.attention_kl`
    avoids.

    Returns:
        ``(B, H, N_q)`` per-row KL for ``reduction="none"`` (``[total_q, H]`` for layout "thd"), else a scalar,
        in ``compute_dtype``; with ``return_count``, a :class:`~streamkl.options.KLWithCount` of it and the counted
        rows (float32), counted from the materialised mask.

    Example:
        >>> import torch
        >>> from streamkl import naive_attention_kl
        >>> q = torch.randn(1, 2, 5, 8, dtype=torch.float64)
        >>> k = torch.randn(1, 2, 5, 8, dtype=torch.float64)
        >>> float(naive_attention_kl(q, k, q, k))  # identical distributions
        0.0
    """
    opts = AttentionKLOptions.of("naive_attention_kl", options, kwargs, kinds=(PROBLEM, BATCH))
    problem = prepare_problem(q_t, k_t, q_s, k_s, opts)
    dtype = compute_dtype or result_dtype(q_t, k_t, q_s, k_s)
    kl, counted = naive_per_row_kl(problem, dtype)
    counted = counted.expand(problem.batch, problem.heads, problem.n_q)
    result = reduce_per_row_kl(kl, counted, problem.reduction)
    if problem.reduction == "none" and problem.packed:
        result = result[0].transpose(0, 1)
    if opts.return_count:
        return KLWithCount(result, counted.sum().to(torch.float32))
    return result


naive_attention_kl.__signature__ = keyword_signature(naive_attention_kl, (PROBLEM, BATCH))
