"""Exact chunked PyTorch implementation of the attention KL: the CPU/MPS backend.

It computes exactly what :mod:`streamkl.naive` defines, with the StreamKL algorithm written in plain
torch ops: one pass over key chunks per query chunk with online rescaling of both distributions
(forward), and a backward that recomputes both probability chunks from the three saved per-row
statistics. Peak extra memory is ``O(B·H·chunk²)`` for the score chunks plus the ``O(N·D)``
gradients: never an ``N_q × N_k`` map. Key chunks outside every row's window are skipped; packed sequences
(``cu_seqlens``) are computed one after the other, so nothing crosses a boundary.

Both passes compute ``KL(P_a ‖ P_b)`` (see :mod:`streamkl._problem` for the score and mask rules);
:func:`streamkl.attention_kl` maps the teacher/student onto (a, b) according to ``direction``. With scores
``x`` and ``y`` over the allowed keys of a row:

* forward: ``m = max x``, ``Z = Σ e^(x-m)``, ``A = Σ e^(x-m)(x-y)``, ``KL = A/Z − lse_a + lse_b``; a sink is one
  more outcome, merged into (m, Z, A) after the keys;
* backward: ``∂KL/∂y = P_b − P_a`` and ``∂KL/∂x = P_a[(x − lse_a) − (y − lse_b) − KL]``, times
  ``1 − tanh²`` on a soft-capped side.

Rows with no allowed key (or excluded by ``query_mask``) get ``KL = 0`` and ``lse = +inf``, so the
recomputed probabilities of those rows are exactly 0 in the backward and their gradients vanish. Non-finite
values in entries a row never sees are replaced by 0 before they meet that row (``0 · inf`` would be NaN).
"""

from __future__ import annotations

import torch

from ._problem import KLInputs, KLSpec
from ._validation import result_dtype

#: Default number of query rows and keys processed per chunk.
DEFAULT_CHUNK_SIZE = 256


def _finite(x: torch.Tensor) -> torch.Tensor:
    """``x`` with non-finite entries replaced by 0: operands of products whose masked terms must stay 0."""
    return torch.where(torch.isfinite(x), x, 0.0)


def _raw_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``q (B, H, m, D) · k (B, H_k, n, D)ᵀ`` -> ``(B, H, m, n)``; query head h reads key head h // G."""
    b, h, m, d = q.shape
    h_k, n = k.shape[1], k.shape[2]
    s = torch.matmul(q.reshape(b, h_k, h // h_k, m, d), k.unsqueeze(2).transpose(-1, -2))
    return s.reshape(b, h, m, n)


def _scores(raw: torch.Tensor, scale: float, softcap: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scores (nats) and, for a soft-capped side, ``tanh`` of the pre-activation (for the derivative)."""
    if not softcap:
        return raw * scale, None
    u = torch.tanh(raw * scale)
    return softcap * u, u


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


def _chunk_allowed(i0: int, i1: int, j0: int, j1: int, n_q: int, n_k: int, spec: KLSpec,
                   key_padding_mask: torch.Tensor | None, device: torch.device,
                   attn_mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """Allowed (query, key) pairs of one chunk as ``(B or 1, 1 or H, i1-i0, j1-j0)`` bool, or None if all are."""
    allowed = None
    if spec.banded:
        rows = torch.arange(i0, i1, device=device)[:, None] + (n_k - n_q)
        cols = torch.arange(j0, j1, device=device)[None, :]
        allowed = torch.ones(i1 - i0, j1 - j0, dtype=torch.bool, device=device)
        if spec.window_left >= 0:
            allowed = allowed & (cols >= rows - spec.window_left)
        if spec.window_right >= 0:
            allowed = allowed & (cols <= rows + spec.window_right)
        allowed = allowed[None, None]
    if key_padding_mask is not None:
        kpm = key_padding_mask[:, None, None, j0:j1]
        allowed = kpm if allowed is None else allowed & kpm
    if attn_mask is not None:
        block = attn_mask[:, :, i0:i1, j0:j1]
        allowed = block if allowed is None else allowed & block
    return allowed


def _key_chunks(i0: int, i1: int, n_q: int, n_k: int, spec: KLSpec, chunk: int):
    """Key chunk bounds a query chunk must visit: only the keys inside some row's window."""
    lo, hi = 0, n_k
    if spec.window_left >= 0:
        lo = max(i0 + (n_k - n_q) - spec.window_left, 0)
    if spec.window_right >= 0:
        hi = min(n_k, max(i1 - 1 + (n_k - n_q) + spec.window_right + 1, 0))
    for j0 in range(lo, hi, chunk):
        yield j0, min(j0 + chunk, hi)


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


def _merge_sink(m, z, sink):
    """Fold one more outcome (logit ``sink``, broadcast over rows) into a row's running (max, sum)."""
    m_new = torch.maximum(m, sink)
    alpha = torch.exp(m - m_new)
    w = torch.exp(sink - m_new)
    return m_new, z * alpha + w, alpha, w


def _forward_one(q_a, k_a, q_b, k_b, sink_a, sink_b, key_padding_mask, query_mask, spec: KLSpec, chunk: int,
                 dtype: torch.dtype, attn_mask: torch.Tensor | None = None):
    """``(kl, lse_a, lse_b)`` of one dense ``(B, H, N_q)`` problem (one packed sequence is B = 1)."""
    batch, heads, n_q, _ = q_a.shape
    n_k = k_a.shape[2]
    device = q_a.device
    shape = (batch, heads, n_q)
    kl = torch.zeros(shape, dtype=dtype, device=device)
    lse_a = torch.full(shape, float("inf"), dtype=dtype, device=device)
    lse_b = torch.full(shape, float("inf"), dtype=dtype, device=device)
    for i0 in range(0, n_q, chunk):
        i1 = min(i0 + chunk, n_q)
        qa, qb = q_a[:, :, i0:i1].to(dtype), q_b[:, :, i0:i1].to(dtype)
        rows = (batch, heads, i1 - i0)
        m_a = torch.full(rows, float("-inf"), dtype=dtype, device=device)
        m_b = m_a.clone()
        z_a = torch.zeros(rows, dtype=dtype, device=device)
        z_b = z_a.clone()
        acc = z_a.clone()
        for j0, j1 in _key_chunks(i0, i1, n_q, n_k, spec, chunk):
            x, _ = _scores(_raw_scores(qa, k_a[:, :, j0:j1].to(dtype)), spec.scale_a, spec.softcap_a)
            y, _ = _scores(_raw_scores(qb, k_b[:, :, j0:j1].to(dtype)), spec.scale_b, spec.softcap_b)
            allowed = _chunk_allowed(i0, i1, j0, j1, n_q, n_k, spec, key_padding_mask, device, attn_mask)
            m_a, z_a, alpha, p_a = _online_update(x, allowed, m_a, z_a)
            diff = x - y if allowed is None else torch.where(allowed, x - y, 0.0)  # p_a is exactly 0 on masked pairs
            acc = acc * alpha + (p_a * diff).sum(-1)
            m_b, z_b, _, _ = _online_update(y, allowed, m_b, z_b)
        valid = z_a != 0  # no allowed key; a NaN row stays valid, so its NaN shows
        if query_mask is not None:
            valid = valid & query_mask[:, None, i0:i1]
        if sink_a is not None:
            sa, sb = sink_a.to(dtype)[None, :, None], sink_b.to(dtype)[None, :, None]
            m_a, z_a, alpha, w = _merge_sink(m_a, z_a, sa)
            acc = acc * alpha + w * (sa - sb)
            m_b, z_b, _, _ = _merge_sink(m_b, z_b, sb)
        la = m_a + torch.log(z_a)
        lb = m_b + torch.log(z_b)
        kl[:, :, i0:i1] = torch.where(valid, acc / z_a - la + lb, 0.0)
        lse_a[:, :, i0:i1] = torch.where(valid, la, float("inf"))
        lse_b[:, :, i0:i1] = torch.where(valid, lb, float("inf"))
    return kl, lse_a, lse_b


def _sequences(inputs: KLInputs):
    """``(query slice, key slice)`` of every problem: one per packed sequence, or everything at once."""
    if inputs.cu_seqlens_q is None:
        yield slice(None), slice(None)
        return
    cu_q, cu_k = inputs.cu_seqlens_q.tolist(), inputs.cu_seqlens_k.tolist()
    for s in range(len(cu_q) - 1):
        yield slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])


def chunked_attention_kl_fwd(
    inputs: KLInputs, spec: KLSpec, chunk_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row ``KL(P_a ‖ P_b)`` and the saved statistics, in ``O(N·chunk)`` memory.

    Args:
        inputs: the tensors in canonical ``(B, H, N, D)`` views (packed: ``(1, H, total, D)`` with offsets);
            any strides.
        spec: scales, soft-caps and window (see :class:`streamkl._problem.KLSpec`).
        chunk_size: query rows and keys per chunk. Default: ``DEFAULT_CHUNK_SIZE``.

    Returns:
        ``(kl, lse_a, lse_b)``, each ``[B, H, N_q]`` in float32 (float64 for float64 inputs); the
        log-sum-exps are in nats (sinks included) and ``+inf`` on rows with no allowed key.

    Example:
        >>> from streamkl._problem import KLInputs, KLSpec
        >>> q, k = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
        >>> spec = KLSpec(scale_a=0.3, scale_b=0.3, window_right=0)  # causal
        >>> kl, lse_a, lse_b = chunked_attention_kl_fwd(KLInputs(q, k, q, k, *[None] * 7), spec)
        >>> kl.abs().max().item()
        0.0
    """
    chunk = chunk_size or DEFAULT_CHUNK_SIZE
    q_a = inputs.q_a
    dtype = result_dtype(q_a, inputs.k_a, inputs.q_b, inputs.k_b)
    shape = q_a.shape[:3]
    kl = torch.zeros(shape, dtype=dtype, device=q_a.device)
    lse_a = torch.full(shape, float("inf"), dtype=dtype, device=q_a.device)
    lse_b = lse_a.clone()
    for rows, keys in _sequences(inputs):
        out = _forward_one(
            q_a[:, :, rows], inputs.k_a[:, :, keys], inputs.q_b[:, :, rows], inputs.k_b[:, :, keys],
            inputs.sink_a, inputs.sink_b, inputs.key_padding_mask, inputs.query_mask, spec, chunk, dtype,
            inputs.attn_mask,
        )
        for buffer, value in zip((kl, lse_a, lse_b), out):
            buffer[:, :, rows] = value
    return kl, lse_a, lse_b


def _backward_one(grad_kl, q_a, k_a, q_b, k_b, key_padding_mask, kl, lse_a, lse_b, spec: KLSpec,
                  need_a: bool, need_b: bool, grads, chunk: int, attn_mask: torch.Tensor | None = None):
    """Accumulate one dense problem's gradients into ``grads = [dq_a, dk_a, dq_b, dk_b]`` (views of the result)."""
    dq_a, dk_a, dq_b, dk_b = grads
    dtype = kl.dtype
    n_q, n_k = q_a.shape[2], k_a.shape[2]
    device = q_a.device
    scale_ga, scale_gb = spec.grad_scale("a"), spec.grad_scale("b")
    for i0 in range(0, n_q, chunk):
        i1 = min(i0 + chunk, n_q)
        la, lb = lse_a[:, :, i0:i1, None], lse_b[:, :, i0:i1, None]
        row_ok = ~torch.isposinf(la)  # a NaN row stays "ok": its NaN must reach the gradients
        # rows that are excluded never meet their (possibly non-finite) queries
        qa = torch.where(row_ok, q_a[:, :, i0:i1].to(dtype), 0.0)
        qb = torch.where(row_ok, q_b[:, :, i0:i1].to(dtype), 0.0)
        # finite stand-ins for the log-ratio term; the probabilities themselves use the +inf lse (-> 0)
        la_f, lb_f = la.masked_fill(~row_ok, 0.0), lb.masked_fill(~row_ok, 0.0)
        g = grad_kl[:, :, i0:i1, None]
        kl_rows = kl[:, :, i0:i1, None]
        for j0, j1 in _key_chunks(i0, i1, n_q, n_k, spec, chunk):
            ka, kb = k_a[:, :, j0:j1].to(dtype), k_b[:, :, j0:j1].to(dtype)
            x, u_a = _scores(_raw_scores(qa, ka), spec.scale_a, spec.softcap_a)
            y, u_b = _scores(_raw_scores(qb, kb), spec.scale_b, spec.softcap_b)
            allowed = _chunk_allowed(i0, i1, j0, j1, n_q, n_k, spec, key_padding_mask, device, attn_mask)
            keep = row_ok if allowed is None else allowed & row_ok
            p_a = torch.exp(x - la).masked_fill(~keep, 0.0)
            p_b = torch.exp(y - lb).masked_fill(~keep, 0.0)
            ka, kb = _finite(ka), _finite(kb)
            if need_b:
                ds_b = g * (p_b - p_a)
                if u_b is not None:
                    ds_b = ds_b * (1 - u_b * u_b)
                ds_b = ds_b.masked_fill(~keep, 0.0)
                dq_b[:, :, i0:i1] += _grad_q(ds_b, kb, scale_gb)
                dk_b[:, :, j0:j1] += _grad_k(ds_b, qb, k_b.shape[1], scale_gb)
            if need_a:
                ds_a = g * p_a * ((x - la_f) - (y - lb_f) - kl_rows)
                if u_a is not None:
                    ds_a = ds_a * (1 - u_a * u_a)
                ds_a = ds_a.masked_fill(~keep, 0.0)
                dq_a[:, :, i0:i1] += _grad_q(ds_a, ka, scale_ga)
                dk_a[:, :, j0:j1] += _grad_k(ds_a, qa, k_a.shape[1], scale_ga)


def chunked_attention_kl_bwd(
    grad_kl: torch.Tensor,
    inputs: KLInputs,
    spec: KLSpec,
    kl: torch.Tensor,
    lse_a: torch.Tensor,
    lse_b: torch.Tensor,
    need_grad_a: bool,
    need_grad_b: bool,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of ``Σ grad_kl · KL`` w.r.t. ``q_a, k_a`` (if ``need_grad_a``) and ``q_b, k_b``.

    Recomputes both probability chunks from ``lse_a``/``lse_b`` (saved by :func:`chunked_attention_kl_fwd`);
    rows with ``lse = +inf`` contribute nothing. The query mask needs no argument: excluded rows already carry
    ``lse = +inf``. The sinks' gradients are per-row quantities (:func:`streamkl.autograd.sink_gradients`).

    Returns:
        ``(dq_a, dk_a, dq_b, dk_b)`` in the compute dtype (None where not requested).

    Example:
        >>> from streamkl._problem import KLInputs, KLSpec
        >>> q_t, k_t = torch.randn(1, 2, 6, 8), torch.randn(1, 1, 6, 8)
        >>> q_s, k_s = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4)
        >>> inputs, spec = KLInputs(q_t, k_t, q_s, k_s, *[None] * 7), KLSpec(scale_a=0.3, scale_b=0.5)
        >>> kl, la, lb = chunked_attention_kl_fwd(inputs, spec)
        >>> grads = chunked_attention_kl_bwd(torch.ones_like(kl), inputs, spec, kl, la, lb,
        ...                                  need_grad_a=False, need_grad_b=True)
        >>> [None if g is None else tuple(g.shape) for g in grads]
        [None, None, (1, 2, 6, 4), (1, 2, 6, 4)]
    """
    chunk = chunk_size or DEFAULT_CHUNK_SIZE
    dtype = kl.dtype
    device = kl.device
    q_a, k_a, q_b, k_b = inputs.q_a, inputs.k_a, inputs.q_b, inputs.k_b

    def zeros(x: torch.Tensor, need: bool) -> torch.Tensor | None:
        return torch.zeros(x.shape, dtype=dtype, device=device) if need else None

    grads = [zeros(q_a, need_grad_a), zeros(k_a, need_grad_a), zeros(q_b, need_grad_b), zeros(k_b, need_grad_b)]
    if not (need_grad_a or need_grad_b):
        return tuple(grads)
    grad_kl = grad_kl.to(dtype)
    for rows, keys in _sequences(inputs):
        views = [None if g is None else g[:, :, sl] for g, sl in zip(grads, (rows, keys, rows, keys))]
        _backward_one(
            grad_kl[:, :, rows], q_a[:, :, rows], k_a[:, :, keys], q_b[:, :, rows], k_b[:, :, keys],
            inputs.key_padding_mask, kl[:, :, rows], lse_a[:, :, rows], lse_b[:, :, rows], spec,
            need_grad_a, need_grad_b, views, chunk, inputs.attn_mask,
        )
    return tuple(grads)

