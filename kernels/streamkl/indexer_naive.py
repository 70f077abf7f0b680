"""Materialising oracle of the indexer loss: the definition of "correct" for :func:`streamkl.indexer_kl`.

It follows the definition literally with ordinary differentiable torch ops: the main attention's ``[B, H, N_q,
N_k]`` score map, each head's softmax over the keys a row may use (causal, padding and, in the sparse stage, the
selected keys), the head mean ``p``, the indexer logits ``I`` as a ``[B, N_q, H_I, N_k]`` map through ReLU and the
weights, and ``KL(p ‖ softmax(I))`` row by row. Memory is ``O(B·(H + H_I)·N_q·N_k)``: use it as the oracle (give it
float64 inputs or ``compute_dtype=torch.float64``) and, through :func:`megatron_style_indexer_loss`, as the naive
baseline the benchmark beats.
"""

from __future__ import annotations

import torch

from ._indexer_problem import IndexerKLProblem, prepare_indexer_problem, reduce_rows


def allowed_pairs(problem: IndexerKLProblem) -> torch.Tensor:
    """Bool ``[B, N_q, N_k]``: the keys each row's distributions range over.

    Causal masking is aligned to the bottom-right corner (key ``s`` is allowed for query ``t`` iff
    ``s <= t + N_k - N_q``); ``key_padding_mask`` drops padded keys; in the sparse stage only the keys listed in the
    row's ``topk_indices`` (``-1`` slots ignored) remain.
    """
    b, n_q, n_k, device = problem.batch, problem.n_q, problem.n_k, problem.q.device
    allowed = torch.ones(b, n_q, n_k, dtype=torch.bool, device=device)
    if problem.causal:
        rows = torch.arange(n_q, device=device)[:, None]
        cols = torch.arange(n_k, device=device)[None, :]
        allowed = allowed & (cols <= rows + (n_k - n_q))
    if problem.key_padding_mask is not None:
        allowed = allowed & problem.key_padding_mask[:, None, :]
    if problem.topk_indices is not None:
        idx = problem.topk_indices.long()
        selected = torch.zeros(b, n_q, n_k + 1, dtype=torch.bool, device=device)
        selected.scatter_(2, torch.where(idx < 0, n_k, idx), True)  # -1 slots land in a dropped extra column
        allowed = allowed & selected[..., :n_k]
    return allowed


def naive_indexer_kl_per_row(problem: IndexerKLProblem, compute_dtype: torch.dtype) -> torch.Tensor:
    """Per-row ``KL(p ‖ softmax(I))`` ``[B, N_q]`` of a validated problem, materialising every map."""
    q, k = problem.q.detach().to(compute_dtype), problem.k.detach().to(compute_dtype)
    q_idx, k_idx, w_idx = (x.to(compute_dtype) for x in (problem.q_idx, problem.k_idx, problem.w_idx))
    allowed = allowed_pairs(problem)  # [B, N_q, N_k]
    row_valid = allowed.any(-1)
    k = k.repeat_interleave(problem.heads // k.shape[1], dim=1)  # GQA: query head h reads key head h // G
    scores = q @ k.transpose(-1, -2) * problem.scale  # [B, H, N_q, N_k]
    if problem.lse is None:
        probs = torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")).masked_fill(
            ~row_valid[:, None, :, None], 0.0), dim=-1)
    else:
        probs = torch.exp(scores - problem.lse.detach().to(compute_dtype)[..., None])
    p = probs.masked_fill(~allowed[:, None], 0.0).mean(1)  # [B, N_q, N_k], constant
    logits = torch.einsum("bjtd,bsd->btjs", q_idx, k_idx)  # [B, N_q, H_I, N_k]
    index_scores = (torch.relu(logits) * w_idx[..., None]).sum(2)  # [B, N_q, N_k]
    log_q = torch.log_softmax(index_scores.masked_fill(~allowed, float("-inf")).masked_fill(
        ~row_valid[..., None], 0.0), dim=-1)
    # p·log p := 0 where p = 0; masked keys carry p = 0 and a zeroed log q (no 0·(-inf))
    log_p = torch.log(torch.where(p > 0, p, 1.0))
    kl = (p * (log_p - log_q.masked_fill(~allowed, 0.0))).sum(-1)
    return kl.masked_fill(~row_valid, 0.0)


def naive_indexer_kl(
    q: torch.Tensor,
    k: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w_idx: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    lse: torch.Tensor | None = None,
    topk_indices: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    reduction: str = "mean",
    layout: str = "bhnd",
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    r"""The indexer loss computed by materialising every score map (the oracle).

    Same arguments and semantics as :func:`streamkl.indexer_kl` (see there), plus ``compute_dtype``: the dtype of
    the math (default float32, float64 when an input is float64). Gradients reach ``q_idx``, ``k_idx`` and
    ``w_idx`` through plain autograd; ``q``, ``k`` and ``lse`` are constants. Memory is
    ``O(B·(H + H_I)·N_q·N_k)``.

    Returns:
        ``[B, N_q]`` per-row KL for ``reduction="none"``, else a scalar, in ``compute_dtype``.

    Example:
        >>> import torch
        >>> from streamkl import naive_indexer_kl
        >>> q, k = torch.randn(1, 4, 6, 8, dtype=torch.float64), torch.randn(1, 2, 6, 8, dtype=torch.float64)
        >>> q_idx, k_idx = torch.randn(1, 3, 6, 5, dtype=torch.float64), torch.randn(1, 6, 5, dtype=torch.float64)
        >>> w_idx = torch.rand(1, 6, 3, dtype=torch.float64)
        >>> loss = naive_indexer_kl(q, k, q_idx, k_idx, w_idx, reduction="none")
        >>> tuple(loss.shape), bool((loss >= 0).all()), float(loss[0, 0])  # row 0 sees one key: KL 0
        ((1, 6), True, 0.0)
    """
    problem = prepare_indexer_problem(
        q, k, q_idx, k_idx, w_idx, causal=causal, scale=scale, lse=lse, topk_indices=topk_indices,
        key_padding_mask=key_padding_mask, reduction=reduction, layout=layout, check_indices=True,
    )
    dtype = compute_dtype or problem.compute_dtype
    kl = naive_indexer_kl_per_row(problem, dtype)
    return reduce_rows(kl, allowed_pairs(problem).any(-1), reduction)


def megatron_style_indexer_loss(
    q: torch.Tensor,
    k: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w_idx: torch.Tensor,
    *,
    scale: float,
    topk_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """The materialised indexer loss as training code commonly writes it (the benchmark's naive baseline).

    Causal, ``bhnd`` layout, fp32 math, mean over rows: the ``[B, H, N, N]`` fp32 main scores, the causal (and in
    the sparse stage top-k) mask applied to each head's scores before its softmax, the head mean, the
    ``[B, N, H_I, N]`` indexer scores through ReLU and the weights, and the KL (the shape of Megatron-Core's
    ``compute_dsa_indexer_loss``). It assumes every row has an allowed key (causal with ``N_q = N_k``) and does no
    input checks.

    Example:
        >>> q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
        >>> q_idx, k_idx, w_idx = torch.randn(1, 3, 5, 4), torch.randn(1, 5, 4), torch.rand(1, 5, 3)
        >>> a = megatron_style_indexer_loss(q, k, q_idx, k_idx, w_idx, scale=0.3)
        >>> b = naive_indexer_kl(q, k, q_idx, k_idx, w_idx, scale=0.3)
        >>> bool(torch.allclose(a, b, atol=1e-5))
        True
    """
    n = q.shape[2]
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [B, H, N, N]
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()[None]
    if topk_indices is not None:
        idx = topk_indices.long()
        sel = torch.zeros(q.shape[0], n, n + 1, dtype=torch.bool, device=q.device)
        sel.scatter_(2, torch.where(idx < 0, n, idx), True)
        mask = mask & sel[..., :n]
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    target = torch.softmax(scores, dim=-1).mean(1)  # [B, N, N]
    index_scores = torch.einsum("bjtd,bsd->btjs", q_idx.float(), k_idx.float())
    index_scores = (torch.relu(index_scores) * w_idx.float()[..., None]).sum(2).masked_fill(~mask, float("-inf"))
    log_q = torch.log_softmax(index_scores, dim=-1)
    kl = torch.where(target > 0, target * (torch.log(target.clamp_min(1e-30)) - log_q), 0.0).sum(-1)
    return kl.mean()
