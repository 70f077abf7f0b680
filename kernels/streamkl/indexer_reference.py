"""Exact chunked PyTorch implementation of the indexer loss: the CPU/MPS backend of :func:`streamkl.indexer_kl`.

It processes ``chunk`` query rows at a time against all keys, so its peak extra memory is
``O(B·chunk·max(H, H_I)·N_k)`` (``chunk`` is sized from a fixed element budget, never ``N_q × N_k``), and computes
exactly what :mod:`streamkl.indexer_naive` defines, with explicit formulas for the backward:

* forward, per row ``t``: ``p = mean_h exp(s_h − lse_h)`` over the usable keys (``lse_h`` computed, or the
  caller's), ``I = Σ_j w_j ReLU(q_idx_j·k_idx)``, ``lse_I = logsumexp(I)``,
  ``KL = Σ p (log p − I + lse_I)`` (``0·log 0 = 0``), and ``psum = Σ p`` (1 up to rounding with a correct lse);
* backward, with upstream ``g``: ``dI = g (psum·softmax(I) − p)`` (the exact gradient of the forward formula for
  any ``p``), then ``dw_j = Σ_s dI·ReLU(R_j)``, ``dq_idx_j = w_j Σ_s dI·1[R_j > 0]·k_idx``,
  ``dk_idx = Σ_t Σ_j dI·w_j·1[R_j > 0]·q_idx_j`` with ``R_j = q_idx_j·k_idx``.

The sparse stage is the dense one with the row's unselected keys masked out (``topk_indices`` lists distinct keys).
Rows with no usable key get ``KL = 0``, ``lse_I = +inf`` and ``psum = 0``: their recomputed probabilities are
exactly 0, so they contribute no gradient.
"""

from __future__ import annotations

import torch

#: Elements of one chunk's largest map (``B·chunk·max(H, H_I)·N_k``) the reference aims for.
CHUNK_ELEMENTS = 1 << 24


def chunk_rows(batch: int, heads: int, index_heads: int, n_q: int, n_k: int) -> int:
    """Query rows per chunk: as many as keep one ``[B, rows, max(H, H_I), N_k]`` map near ``CHUNK_ELEMENTS``."""
    per_row = max(1, batch * max(heads, index_heads) * n_k)
    return max(1, min(max(n_q, 1), CHUNK_ELEMENTS // per_row))


def chunk_allowed(i0: int, i1: int, n_q: int, n_k: int, causal: bool, key_padding_mask: torch.Tensor | None,
                  topk_indices: torch.Tensor | None, batch: int, device: torch.device) -> torch.Tensor:
    """Bool ``[B, i1 - i0, N_k]``: the keys rows ``i0..i1`` may use (causal, padding, selection)."""
    allowed = torch.ones(batch, i1 - i0, n_k, dtype=torch.bool, device=device)
    if causal:
        rows = torch.arange(i0, i1, device=device)[:, None]
        allowed = allowed & (torch.arange(n_k, device=device)[None, :] <= rows + (n_k - n_q))
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, :]
    if topk_indices is not None:
        idx = topk_indices[:, i0:i1].long()
        selected = torch.zeros(batch, i1 - i0, n_k + 1, dtype=torch.bool, device=device)
        selected.scatter_(2, torch.where(idx < 0, n_k, idx), True)
        allowed = allowed & selected[..., :n_k]
    return allowed


def _head_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """``q [B, H, c, D] · k [B, H_kv, N_k, D]ᵀ · scale`` -> ``[B, H, c, N_k]``; head ``h`` reads key head ``h // G``."""
    b, h, c, d = q.shape
    h_kv = k.shape[1]
    s = torch.matmul(q.reshape(b, h_kv, h // h_kv, c, d), k.unsqueeze(2).transpose(-1, -2))
    return s.reshape(b, h, c, k.shape[2]) * scale


def _chunk_target(q, k, lse, allowed, scale, i0, i1, dtype):
    """``(p [B, c, N_k], lse_h [B, H, c])`` of rows ``i0..i1``; ``lse_h`` is +inf on rows with no usable key."""
    s = _head_scores(q[:, :, i0:i1].to(dtype), k.to(dtype), scale)
    valid = allowed.any(-1)[:, None, :]  # [B, 1, c]
    if lse is None:
        lse_h = torch.logsumexp(s.masked_fill(~allowed[:, None], float("-inf")), dim=-1)
    else:
        lse_h = lse[:, :, i0:i1].to(dtype)
    lse_h = torch.where(valid, lse_h, float("inf"))
    p = torch.exp(s - lse_h[..., None]).masked_fill(~allowed[:, None], 0.0).mean(1)
    return p, lse_h


def _chunk_index_logits(q_idx, k_idx, i0, i1, dtype):
    """``R [B, c, H_I, N_k]``: every indexer head's raw logits ``q_idx_j·k_idx`` for rows ``i0..i1``."""
    return torch.einsum("bjtd,bsd->btjs", q_idx[:, :, i0:i1].to(dtype), k_idx.to(dtype))


def chunked_indexer_kl_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w_idx: torch.Tensor,
    lse: torch.Tensor | None,
    topk_indices: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row indexer KL and the state the backward needs.

    Args:
        q, k: ``[B, H, N_q, D]``, ``[B, H_kv, N_k, D]`` main-attention queries and keys (constants).
        q_idx, k_idx, w_idx: ``[B, H_I, N_q, D_I]``, ``[B, N_k, D_I]``, ``[B, N_q, H_I]`` indexer inputs.
        lse: ``[B, H, N_q]`` main-attention log-sum-exp (nats), or None to compute it.
        topk_indices: ``[B, N_q, K]`` selected keys (``-1`` = empty), or None (dense stage).
        key_padding_mask: ``[B, N_k]`` bool (True = real key) or None.
        causal: bottom-right aligned causal mask.
        scale: main-attention score scale.

    Returns:
        ``(kl [B, N_q], lse_h [B, H, N_q], lse_index [B, N_q], psum [B, N_q])`` in float32 (float64 for float64
        inputs); ``lse_h`` is the per-head normaliser used (``lse`` itself when given, +inf on empty rows), and
        ``lse_index`` is +inf on rows with no usable key.

    Example:
        >>> q, k = torch.randn(1, 2, 6, 8), torch.randn(1, 1, 6, 8)
        >>> q_idx, k_idx, w_idx = torch.randn(1, 3, 6, 4), torch.randn(1, 6, 4), torch.rand(1, 6, 3)
        >>> kl, lse_h, lse_index, psum = chunked_indexer_kl_fwd(q, k, q_idx, k_idx, w_idx, None, None, None, True, 0.3)
        >>> float(kl[0, 0]), bool(torch.allclose(psum, torch.ones(1, 6)))
        (0.0, True)
    """
    dtype = torch.float64 if torch.float64 in (q.dtype, q_idx.dtype, w_idx.dtype) else torch.float32
    batch, heads, n_q, _ = q.shape
    n_k = k.shape[2]
    device = q.device
    kl = torch.zeros(batch, n_q, dtype=dtype, device=device)
    lse_index = torch.full_like(kl, float("inf"))
    psum = torch.zeros_like(kl)
    lse_h = torch.full((batch, heads, n_q), float("inf"), dtype=dtype, device=device)
    step = chunk_rows(batch, heads, q_idx.shape[1], n_q, n_k)
    for i0 in range(0, n_q, step):
        i1 = min(i0 + step, n_q)
        allowed = chunk_allowed(i0, i1, n_q, n_k, causal, key_padding_mask, topk_indices, batch, device)
        valid = allowed.any(-1)
        p, lse_h[:, :, i0:i1] = _chunk_target(q, k, lse, allowed, scale, i0, i1, dtype)
        r = _chunk_index_logits(q_idx, k_idx, i0, i1, dtype)
        logits = (torch.relu(r) * w_idx[:, i0:i1, :, None].to(dtype)).sum(2)
        lse_i = torch.logsumexp(logits.masked_fill(~allowed, float("-inf")), dim=-1)
        lse_i = torch.where(valid, lse_i, float("inf"))
        log_p = torch.log(torch.where(p > 0, p, 1.0))
        terms = torch.where(p > 0, p * (log_p - logits + torch.where(valid, lse_i, 0.0)[..., None]), 0.0)
        kl[:, i0:i1] = terms.sum(-1)
        lse_index[:, i0:i1] = lse_i
        psum[:, i0:i1] = p.sum(-1)
    return kl, lse_h, lse_index, psum


def chunked_indexer_kl_bwd(
    grad_kl: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w_idx: torch.Tensor,
    lse_h: torch.Tensor,
    lse_index: torch.Tensor,
    psum: torch.Tensor,
    topk_indices: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``Σ grad_kl · KL`` w.r.t. ``q_idx``, ``k_idx`` and ``w_idx``, recomputed chunk by chunk.

    ``lse_h``, ``lse_index`` and ``psum`` are what :func:`chunked_indexer_kl_fwd` returned.

    Returns:
        ``(dq_idx, dk_idx, dw_idx)`` in the compute dtype, shaped like ``q_idx``, ``k_idx``, ``w_idx``.

    Example:
        >>> q, k = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
        >>> q_idx, k_idx, w_idx = torch.randn(1, 3, 6, 4), torch.randn(1, 6, 4), torch.rand(1, 6, 3)
        >>> state = chunked_indexer_kl_fwd(q, k, q_idx, k_idx, w_idx, None, None, None, True, 0.3)
        >>> grads = chunked_indexer_kl_bwd(torch.ones(1, 6), q, k, q_idx, k_idx, w_idx, *state[1:], None, None,
        ...                                True, 0.3)
        >>> [tuple(g.shape) for g in grads]
        [(1, 3, 6, 4), (1, 6, 4), (1, 6, 3)]
    """
    dtype = psum.dtype
    batch, heads, n_q, _ = q.shape
    n_k = k.shape[2]
    device = q.device
    dq_idx = torch.zeros(q_idx.shape, dtype=dtype, device=device)
    dk_idx = torch.zeros(k_idx.shape, dtype=dtype, device=device)
    dw_idx = torch.zeros(w_idx.shape, dtype=dtype, device=device)
    grad_kl = grad_kl.to(dtype)
    step = chunk_rows(batch, heads, q_idx.shape[1], n_q, n_k)
    for i0 in range(0, n_q, step):
        i1 = min(i0 + step, n_q)
        allowed = chunk_allowed(i0, i1, n_q, n_k, causal, key_padding_mask, topk_indices, batch, device)
        p, _ = _chunk_target(q, k, lse_h, allowed, scale, i0, i1, dtype)
        r = _chunk_index_logits(q_idx, k_idx, i0, i1, dtype)
        w = w_idx[:, i0:i1].to(dtype)  # [B, c, H_I]
        logits = (torch.relu(r) * w[..., None]).sum(2)
        q_index = torch.exp(logits - lse_index[:, i0:i1, None]).masked_fill(~allowed, 0.0)
        d_logits = grad_kl[:, i0:i1, None] * (psum[:, i0:i1, None] * q_index - p)  # [B, c, N_k]
        dw_idx[:, i0:i1] = (d_logits[:, :, None] * torch.relu(r)).sum(-1)
        d_r = d_logits[:, :, None] * (r > 0)  # [B, c, H_I, N_k]: through the ReLU (derivative 0 at <= 0)
        dq_idx[:, :, i0:i1] = torch.einsum("btjs,bsd->bjtd", d_r, k_idx.to(dtype)) * w.transpose(1, 2)[..., None]
        dk_idx += torch.einsum("btjs,bjtd->bsd", d_r * w[..., None], q_idx[:, :, i0:i1].to(dtype))
    return dq_idx, dk_idx, dw_idx
