"""Exact chunked PyTorch implementation of the attention KL: the CPU/MPS backend.

It computes exactly what :mod:`streamkl.naive` defines, with the StreamKL algorithm written in plain
torch ops: one pass over key chunks per query chunk with online rescaling of both distributions
(forward), and a backward that recomputes both probability chunks from the three saved per-row
statistics. Peak extra memory is ``O(B·H·chunk²)`` for the score chunks plus the ``O(N·D)``
gradients: never an ``N_q × N_k`` map.

Both passes compute ``KL(P_a ‖ P_b)``; :func:`streamkl.attention_kl` maps the teacher/student onto
(a, b) according to ``direction`` (forward: a = teacher, b = student; reverse: the other way round).
With scores ``x = q_a·k_a·scale_a`` and ``y = q_b·k_b·scale_b`` over the allowed keys of a row:

* forward: ``m = max x``, ``Z = Σ e^(x-m)``, ``A = Σ e^(x-m)(x-y)``, ``KL = A/Z − lse_a + lse_b``;
* backward: ``∂KL/∂y = P_b − P_a`` and ``∂KL/∂x = P_a[(x − lse_a) − (y − lse_b) − KL]``.

Rows with no allowed key (or excluded by ``query_mask``) get ``KL = 0`` and ``lse = +inf``, so the
recomputed probabilities of those rows are exactly 0 in the backward and their gradients vanish.
"""

from __future__ import annotations

import torch

from ._validation import result_dtype

#: Default number of query rows and keys processed per chunk.
DEFAULT_CHUNK_SIZE = 256


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """``q (B, H, m, D) · k (B, H_k, n, D)ᵀ · scale`` -> ``(B, H, m, n)``; query head h reads key head h // G."""
    b, h, m, d = q.shape
    h_k, n = k.shape[1], k.shape[2]
    s = torch.matmul(q.reshape(b, h_k, h // h_k, m, d), k.unsqueeze(2).transpose(-1, -2))
    return s.reshape(b, h, m, n) * scale


def _grad_q(ds: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """``dS (B, H, m, n) · k (B, H_k, n, D) · scale`` -> ``(B, H, m, D)``."""
    b, h, m, n = ds.shape
    h_k = k.shape[1]
    dq = torch.matmul(ds.reshape(b, h_k, h // h_k, m, n), k.unsqueeze(2))
    return dq.reshape(b, h, m, k.shape[-1]) * scale


def _grad_k(ds: torch.Tensor, q: torch.Tensor, h_k: int, scale: float) -> torch.Tensor:
    """``dSᵀ · q`` summed over the query heads sharing a key head -> ``(B, H_k, n, D)``."""
    b, h, m, n = ds.shape
    g = h // h_k
    dk = torch.matmul(ds.reshape(b, h_k, g, m, n).transpose(-1, -2), q.reshape(b, h_k, g, m, q.shape[-1]))
    return dk.sum(2) * scale


def _chunk_allowed(
    i0: int,
    i1: int,
    j0: int,
    j1: int,
    n_q: int,
    n_k: int,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor | None:
    """Allowed (query, key) pairs of one chunk as ``(B or 1, 1, i1-i0, j1-j0)`` bool, or None if all are."""
    allowed = None
    if causal:
        rows = torch.arange(i0, i1, device=device)[:, None]
        cols = torch.arange(j0, j1, device=device)[None, :]
        allowed = (cols <= rows + (n_k - n_q))[None, None]
    if key_padding_mask is not None:
        kpm = key_padding_mask[:, None, None, j0:j1]
        allowed = kpm if allowed is None else allowed & kpm
    return allowed


def _key_chunks(i0: int, i1: int, n_q: int, n_k: int, causal: bool, chunk: int):
    """Key chunk bounds a query chunk must visit (causal: stop after the diagonal)."""
    last = n_k if not causal else min(n_k, i1 - 1 + (n_k - n_q) + 1)
    for j0 in range(0, max(last, 0), chunk):
        yield j0, min(j0 + chunk, last)


def _online_update(
    s: torch.Tensor, allowed: torch.Tensor | None, m: torch.Tensor, z: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One online-softmax step: returns (new max, new sum, rescale factor of old sums, chunk weights)."""
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    m_new = torch.maximum(m, s.amax(-1))
    m_safe = m_new.masked_fill(torch.isneginf(m_new), 0.0)  # a row with no key yet keeps weight 0
    alpha = torch.exp(m - m_safe)
    p = torch.exp(s - m_safe[..., None])
    return m_new, z * alpha + p.sum(-1), alpha, p


def chunked_attention_kl_fwd(
    q_a: torch.Tensor,
    k_a: torch.Tensor,
    q_b: torch.Tensor,
    k_b: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    query_mask: torch.Tensor | None,
    causal: bool,
    scale_a: float,
    scale_b: float,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row ``KL(P_a ‖ P_b)`` and the saved statistics, in ``O(N·chunk)`` memory.

    Args:
        q_a, k_a: ``[B, H, N_q, D_a]`` and ``[B, H_ka, N_k, D_a]`` of the distribution the expectation
            is taken under. Any strides.
        q_b, k_b: ``[B, H, N_q, D_b]`` and ``[B, H_kb, N_k, D_b]`` of the other distribution.
        key_padding_mask: ``[B, N_k]`` bool (True = real key) or None.
        query_mask: ``[B, N_q]`` bool (False = row excluded) or None.
        causal: bottom-right aligned causal mask.
        scale_a, scale_b: score scales (temperature already folded in).
        chunk_size: query rows and keys per chunk. Default: ``DEFAULT_CHUNK_SIZE``.

    Returns:
        ``(kl, lse_a, lse_b)``, each ``[B, H, N_q]`` in float32 (float64 for float64 inputs); the
        log-sum-exps are in nats and ``+inf`` on rows with no allowed key.

    Example:
        >>> q, k = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
        >>> kl, lse_a, lse_b = chunked_attention_kl_fwd(q, k, q, k, None, None, True, 0.3, 0.3)
        >>> kl.abs().max().item()
        0.0
    """
    chunk_size = chunk_size or DEFAULT_CHUNK_SIZE
    dtype = result_dtype(q_a, k_a, q_b, k_b)
    batch, heads, n_q, _ = q_a.shape
    n_k = k_a.shape[2]
    device = q_a.device
    shape = (batch, heads, n_q)
    kl = torch.zeros(shape, dtype=dtype, device=device)
    lse_a = torch.full(shape, float("inf"), dtype=dtype, device=device)
    lse_b = torch.full(shape, float("inf"), dtype=dtype, device=device)
    for i0 in range(0, n_q, chunk_size):
        i1 = min(i0 + chunk_size, n_q)
        qa, qb = q_a[:, :, i0:i1].to(dtype), q_b[:, :, i0:i1].to(dtype)
        rows = (batch, heads, i1 - i0)
        m_a = torch.full(rows, float("-inf"), dtype=dtype, device=device)
        m_b = m_a.clone()
        z_a = torch.zeros(rows, dtype=dtype, device=device)
        z_b = z_a.clone()
        acc = z_a.clone()
        for j0, j1 in _key_chunks(i0, i1, n_q, n_k, causal, chunk_size):
            x = _scores(qa, k_a[:, :, j0:j1].to(dtype), scale_a)
            y = _scores(qb, k_b[:, :, j0:j1].to(dtype), scale_b)
            allowed = _chunk_allowed(i0, i1, j0, j1, n_q, n_k, causal, key_padding_mask, device)
            m_a, z_a, alpha, p_a = _online_update(x, allowed, m_a, z_a)
            acc = acc * alpha + (p_a * (x - y)).sum(-1)  # p_a is exactly 0 on masked pairs
            m_b, z_b, _, _ = _online_update(y, allowed, m_b, z_b)
        valid = z_a > 0
        if query_mask is not None:
            valid = valid & query_mask[:, None, i0:i1]
        la = m_a + torch.log(z_a)
        lb = m_b + torch.log(z_b)
        kl[:, :, i0:i1] = torch.where(valid, acc / z_a - la + lb, 0.0)
        lse_a[:, :, i0:i1] = torch.where(valid, la, float("inf"))
        lse_b[:, :, i0:i1] = torch.where(valid, lb, float("inf"))
    return kl, lse_a, lse_b


def chunked_attention_kl_bwd(
    grad_kl: torch.Tensor,
    q_a: torch.Tensor,
    k_a: torch.Tensor,
    q_b: torch.Tensor,
    k_b: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    kl: torch.Tensor,
    lse_a: torch.Tensor,
    lse_b: torch.Tensor,
    causal: bool,
    scale_a: float,
    scale_b: float,
    need_grad_a: bool,
    need_grad_b: bool,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of ``Σ grad_kl · KL`` w.r.t. ``q_a, k_a`` (if ``need_grad_a``) and ``q_b, k_b``.

    Recomputes both probability chunks from ``lse_a``/``lse_b`` (saved by
    :func:`chunked_attention_kl_fwd`); rows with ``lse = +inf`` contribute nothing. The query mask
    needs no argument: excluded rows already carry ``lse = +inf``.

    Returns:
        ``(dq_a, dk_a, dq_b, dk_b)`` in the compute dtype (None where not requested).

    Example:
        >>> q_t, k_t = torch.randn(1, 2, 6, 8), torch.randn(1, 1, 6, 8)
        >>> q_s, k_s = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4)
        >>> kl, la, lb = chunked_attention_kl_fwd(q_t, k_t, q_s, k_s, None, None, False, 0.3, 0.5)
        >>> grads = chunked_attention_kl_bwd(torch.ones_like(kl), q_t, k_t, q_s, k_s, None, kl, la, lb,
        ...                                  False, 0.3, 0.5, need_grad_a=False, need_grad_b=True)
        >>> [None if g is None else tuple(g.shape) for g in grads]
        [None, None, (1, 2, 6, 4), (1, 2, 6, 4)]
    """
    chunk_size = chunk_size or DEFAULT_CHUNK_SIZE
    dtype = kl.dtype
    n_q = q_a.shape[2]
    n_k = k_a.shape[2]
    device = q_a.device
    dq_a = torch.zeros(q_a.shape, dtype=dtype, device=device) if need_grad_a else None
    dk_a = torch.zeros(k_a.shape, dtype=dtype, device=device) if need_grad_a else None
    dq_b = torch.zeros(q_b.shape, dtype=dtype, device=device) if need_grad_b else None
    dk_b = torch.zeros(k_b.shape, dtype=dtype, device=device) if need_grad_b else None
    if not (need_grad_a or need_grad_b):
        return dq_a, dk_a, dq_b, dk_b
    grad_kl = grad_kl.to(dtype)
    for i0 in range(0, n_q, chunk_size):
        i1 = min(i0 + chunk_size, n_q)
        qa, qb = q_a[:, :, i0:i1].to(dtype), q_b[:, :, i0:i1].to(dtype)
        la, lb = lse_a[:, :, i0:i1, None], lse_b[:, :, i0:i1, None]
        # finite stand-ins for the log-ratio term; the probabilities themselves use the +inf lse (-> 0)
        la_f, lb_f = la.masked_fill(torch.isinf(la), 0.0), lb.masked_fill(torch.isinf(lb), 0.0)
        g = grad_kl[:, :, i0:i1, None]
        kl_rows = kl[:, :, i0:i1, None]
        for j0, j1 in _key_chunks(i0, i1, n_q, n_k, causal, chunk_size):
            ka, kb = k_a[:, :, j0:j1].to(dtype), k_b[:, :, j0:j1].to(dtype)
            x = _scores(qa, ka, scale_a)
            y = _scores(qb, kb, scale_b)
            p_a = torch.exp(x - la)
            p_b = torch.exp(y - lb)
            allowed = _chunk_allowed(i0, i1, j0, j1, n_q, n_k, causal, key_padding_mask, device)
            if allowed is not None:
                p_a = p_a.masked_fill(~allowed, 0.0)
                p_b = p_b.masked_fill(~allowed, 0.0)
            if need_grad_b:
                ds_b = g * (p_b - p_a)
                dq_b[:, :, i0:i1] += _grad_q(ds_b, kb, scale_b)
                dk_b[:, :, j0:j1] += _grad_k(ds_b, qb, k_b.shape[1], scale_b)
            if need_grad_a:
                ds_a = g * p_a * ((x - la_f) - (y - lb_f) - kl_rows)
                dq_a[:, :, i0:i1] += _grad_q(ds_a, ka, scale_a)
                dk_a[:, :, j0:j1] += _grad_k(ds_a, qa, k_a.shape[1], scale_a)
    return dq_a, dk_a, dq_b, dk_b


def chunked_attention_kl(*args, **kwargs) -> torch.Tensor:
    """:func:`streamkl.attention_kl` forced onto this chunked PyTorch backend (``backend="reference"``).

    Example:
        >>> q, k = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
        >>> float(chunked_attention_kl(q, k, q, k, causal=True))
        0.0
    """
    from .api import attention_kl

    if "backend" in kwargs:
        raise TypeError("chunked_attention_kl() always uses backend='reference'; do not pass `backend`.")
    return attention_kl(*args, backend="reference", **kwargs)
