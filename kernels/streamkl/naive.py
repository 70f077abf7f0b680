"""Materialising oracle for the attention KL divergence: the definition of "correct".

It builds both full ``N_q × N_k`` score maps, applies the masks, takes ``log_softmax`` and sums
``P (log P - log Q)`` row by row, all through ordinary differentiable torch ops. It needs
``O(B·H·N_q·N_k)`` memory, so it is only for tests, for small problems and as the baseline that the
benchmarks beat. Give it float64 inputs (or ``compute_dtype=torch.float64``) to use it as the oracle.
"""

from __future__ import annotations

import torch

from ._reduction import reduce_per_row_kl
from ._validation import AttentionKLProblem, prepare_problem, result_dtype


def _expand_kv(k: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, H_k, N, D) -> (B, H, N, D): query head h reads key head h // (H // H_k)."""
    return k.repeat_interleave(heads // k.shape[1], dim=1)


def allowed_keys(problem: AttentionKLProblem) -> torch.Tensor | None:
    """Bool map ``(B or 1, 1, N_q, N_k)`` of allowed (query, key) pairs, or None when all are allowed.

    Causal masking is aligned to the bottom-right corner (key j is allowed for query i iff
    ``j <= i + N_k - N_q``), as FlashAttention does when ``N_q != N_k``.
    """
    n_q, n_k, device = problem.n_q, problem.n_k, problem.q_t.device
    allowed = None
    if problem.causal:
        rows = torch.arange(n_q, device=device)[:, None]
        cols = torch.arange(n_k, device=device)[None, :]
        allowed = (cols <= rows + (n_k - n_q))[None, None]
    if problem.key_padding_mask is not None:
        kpm = problem.key_padding_mask[:, None, None, :]
        allowed = kpm if allowed is None else allowed & kpm
    return allowed


def naive_per_row_kl(problem: AttentionKLProblem, compute_dtype: torch.dtype) -> torch.Tensor:
    """Per-row KL ``(B, H, N_q)`` of a validated problem, materialising both probability maps."""
    heads = problem.heads
    q_t, k_t, q_s, k_s = (x.to(compute_dtype) for x in (problem.q_t, problem.k_t, problem.q_s, problem.k_s))
    s_t = q_t @ _expand_kv(k_t, heads).transpose(-1, -2) * problem.scale_t
    s_s = q_s @ _expand_kv(k_s, heads).transpose(-1, -2) * problem.scale_s
    if problem.reverse:
        s_t, s_s = s_s, s_t  # KL(P_s || P_t): the expectation is taken under the student
    allowed = allowed_keys(problem)
    if allowed is None:
        allowed = torch.ones((1, 1, problem.n_q, problem.n_k), dtype=torch.bool, device=s_t.device)
    row_valid = allowed.any(-1)
    if problem.query_mask is not None:
        row_valid = row_valid & problem.query_mask[:, None, :]
    keep = allowed & row_valid[..., None]
    # Masked scores become -inf (probability 0); rows with no allowed key become all-zero rows so that
    # log_softmax stays finite, and every term of such a row is then zeroed by `keep` (KL 0, gradient 0).
    def log_probs(s: torch.Tensor) -> torch.Tensor:
        s = s.masked_fill(~allowed, float("-inf")).masked_fill(~row_valid[..., None], 0.0)
        return torch.log_softmax(s, dim=-1).masked_fill(~keep, 0.0)

    logp, logq = log_probs(s_t), log_probs(s_s)
    p = torch.exp(logp).masked_fill(~keep, 0.0)
    return (p * (logp - logq)).sum(-1)


def naive_attention_kl(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    q_s: torch.Tensor,
    k_s: torch.Tensor,
    *,
    causal: bool = False,
    scale_t: float | None = None,
    scale_s: float | None = None,
    temperature: float = 1.0,
    direction: str = "forward",
    reduction: str = "mean",
    key_padding_mask: torch.Tensor | None = None,
    query_mask: torch.Tensor | None = None,
    layout: str = "bhnd",
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    r"""KL divergence between two attention distributions, computed by materialising them.

    Same arguments and semantics as :func:`streamkl.attention_kl` (see there), plus ``compute_dtype``:
    the dtype of the math (default float32, float64 when an input is float64). Differentiable through
    plain autograd. Memory is ``O(B·H·N_q·N_k)``: use it as the oracle and as the naive baseline only.

    Returns:
        ``(B, H, N_q)`` per-row KL for ``reduction="none"``, else a scalar, in ``compute_dtype``.

    Example:
        >>> import torch
        >>> from streamkl import naive_attention_kl
        >>> q = torch.randn(1, 2, 5, 8, dtype=torch.float64)
        >>> k = torch.randn(1, 2, 5, 8, dtype=torch.float64)
        >>> float(naive_attention_kl(q, k, q, k))  # identical distributions
        0.0
    """
    problem = prepare_problem(
        q_t,
        k_t,
        q_s,
        k_s,
        causal=causal,
        scale_t=scale_t,
        scale_s=scale_s,
        temperature=temperature,
        direction=direction,
        reduction=reduction,
        key_padding_mask=key_padding_mask,
        query_mask=query_mask,
        layout=layout,
    )
    dtype = compute_dtype or result_dtype(q_t, k_t, q_s, k_s)
    kl = naive_per_row_kl(problem, dtype)
    allowed = allowed_keys(problem)
    counted = torch.ones(problem.batch, 1, problem.n_q, dtype=torch.bool, device=kl.device)
    if allowed is not None:
        counted = counted & allowed.any(-1)
    if problem.query_mask is not None:
        counted = counted & problem.query_mask[:, None, :]
    counted = counted.expand(problem.batch, problem.heads, problem.n_q)
    return reduce_per_row_kl(kl, counted, reduction)
