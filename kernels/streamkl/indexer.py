"""The indexer loss: :func:`indexer_kl`, training a DeepSeek-V3.2-style lightning indexer against the main attention.

This module holds the public op and its backend choice; its input checks (one place, shared by the oracle and every
backend) are in :mod:`streamkl._indexer_problem`. The math lives in :mod:`streamkl.indexer_reference` (exact chunked
PyTorch, the CPU backend), the fused kernels in :mod:`streamkl._triton.indexer_forward` /
:mod:`streamkl._triton.indexer_backward`, and the materialising oracle in :mod:`streamkl.indexer_naive`.
"""

from __future__ import annotations

import torch

from ._indexer_problem import (
    MAX_TRITON_HEAD_DIM,
    MAX_TRITON_INDEXER_HEADS,
    IndexerKLProblem,
    prepare_indexer_problem,
    reduce_rows,
)
from .dispatch import select_backend

__all__ = ["indexer_kl", "resolve_indexer_backend"]


def resolve_indexer_backend(backend: str, problem: IndexerKLProblem) -> str:
    """``"triton"`` or ``"reference"``: what ``backend`` ("auto" | "triton" | "reference") runs for ``problem``.

    The backend rows of :data:`streamkl.dispatch.TABLE` (:func:`streamkl.dispatch.select_backend`): ``"auto"`` takes
    the fused kernels for CUDA tensors that are not float64 and the chunked reference otherwise; ``"triton"`` on a
    CPU tensor needs Triton's interpreter (``TRITON_INTERPRET=1``). A request the kernels cannot serve (also: head
    dims or indexer heads beyond the kernels' limits) raises instead of silently falling back.
    """
    if select_backend(backend, problem.q.device, (problem.compute_dtype,)) == "reference":
        return "reference"
    d, d_i, h_i = problem.q.shape[-1], problem.q_idx.shape[-1], problem.q_idx.shape[1]
    if max(d, d_i) > MAX_TRITON_HEAD_DIM or h_i > MAX_TRITON_INDEXER_HEADS:
        raise ValueError(
            f"The Triton indexer kernels take head dims up to {MAX_TRITON_HEAD_DIM} and up to "
            f"{MAX_TRITON_INDEXER_HEADS} indexer heads, but got D={d}, D_I={d_i}, H_I={h_i}; use backend='reference'."
        )
    return "triton"


def indexer_kl(
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
    backend: str = "auto",
    check_indices: bool = True,
) -> torch.Tensor:
    r"""KL divergence from the head-averaged main attention to a lightning indexer's distribution (DeepSeek-V3.2).

    For query row :math:`t` and the keys :math:`s` it may use (see ``causal``, ``key_padding_mask`` and
    ``topk_indices``), the target is the main attention averaged over its ``H`` heads and the student is the
    indexer's softmax:

    .. math::

        p_{ts} = \frac{1}{H} \sum_h \mathrm{softmax}_s\!\left(\mathrm{scale}\; q_{h,t} \cdot k_{h',s}\right),
        \qquad I_{ts} = \sum_j w_{tj}\, \mathrm{ReLU}\!\left(q^{I}_{j,t} \cdot k^{I}_{s}\right),

        \mathrm{KL}_t = \sum_s p_{ts} \left(\log p_{ts} - \log \mathrm{softmax}_s(I_{ts})\right),

    with ``h' = h // (H / H_kv)`` (GQA) and :math:`0 \log 0 = 0`. ``p`` is a constant: ``q``, ``k`` and ``lse``
    never receive gradients (detach them or not, as you like). Gradients reach ``q_idx``, ``k_idx`` and ``w_idx``;
    the ReLU's derivative is 0 at and below 0, as ``torch.relu``'s.

    Stages:

    * dense (``topk_indices=None``, DeepSeek's warm-up): every allowed key of the row;
    * sparse (``topk_indices`` given): only the keys a row selected, ``[B, N_q, K]`` distinct key positions with
      ``-1`` for an empty slot, shared by all heads. Each head's softmax is taken over the selected allowed keys (as
      the sparse main attention computes it) before the head mean; the indexer's softmax over the same keys.

    ``lse`` (optional, ``[B, H, N_q]``, natural log, the layout does not apply) is the main attention's
    log-sum-exp from the model's own forward (e.g. flash-attn's ``softmax_lse``); with it the fused path skips its
    first pass. It must be the normaliser of exactly the distribution defined above, including ``scale``: over the
    allowed keys in the dense stage, and over the *selected* allowed keys in the sparse stage (what a sparse
    attention kernel run over the same ``topk_indices`` returns; a dense lse with ``topk_indices`` gives a ``p``
    that does not sum to 1, and a wrong loss). Rows with no usable key ignore it.

    The fused forward keeps four fp32 numbers per query row plus the per-head log-sum-exps (``O(N·H)``); the
    backward recomputes the probabilities tile by tile. No ``N_q × N_k`` map is stored; the dense backward stages
    the loss's gradient w.r.t. the indexer logits for a bounded block of rows (``≤ 64 MiB``) at a time.

    Args:
        q: main-attention queries ``[B, H, N_q, D]`` (layout ``"bhnd"``) or ``[B, N_q, H, D]`` (``"bnhd"``), after
            RoPE, exactly as the attention used them.
        k: main-attention keys ``[B, H_kv, N_k, D]`` (``"bnhd"``: ``[B, N_k, H_kv, D]``); ``H`` divisible by
            ``H_kv``.
        q_idx: indexer queries ``[B, H_I, N_q, D_I]`` (``"bnhd"``: ``[B, N_q, H_I, D_I]``).
        k_idx: indexer keys ``[B, N_k, D_I]``, one per token, shared by the indexer heads (both layouts).
        w_idx: indexer head weights ``[B, N_q, H_I]`` (both layouts); fold any scale into them.
        causal: key ``s`` is allowed for query ``t`` iff ``s <= t + N_k - N_q`` (bottom-right aligned, as
            FlashAttention). Default: ``True``.
        scale: main-attention score scale. Default: ``1 / sqrt(D)``.
        lse: ``[B, H, N_q]`` main-attention log-sum-exp (see above), or None to compute it. Default: ``None``.
        topk_indices: ``[B, N_q, K]`` int32/int64 selected key positions (``-1`` = empty), or None for the dense
            stage. Default: ``None``.
        key_padding_mask: ``[B, N_k]`` bool, True for real keys. Default: ``None``.
        reduction: ``"none"`` (per-row ``[B, N_q]``), ``"sum"``, or ``"mean"`` over the rows with at least one
            allowed (and selected) key; 0 when there are none. Default: ``"mean"``.
        layout: ``"bhnd"`` or ``"bnhd"`` for ``q``, ``k`` and ``q_idx``; any strides, nothing is copied.
            Default: ``"bhnd"``.
        backend: ``"auto"`` (fused Triton kernels on CUDA, the chunked reference elsewhere and for float64),
            ``"triton"`` or ``"reference"``. Default: ``"auto"``.
        check_indices: check that ``topk_indices`` holds only ``-1`` or positions in ``[0, N_k)``, distinct within
            each row (one sort and one device synchronisation). Skipped while ``torch.compile`` traces; turn it off
            for CUDA-graph capture once the selection is known to be valid. Default: ``True``.

    Returns:
        ``[B, N_q]`` per-row KL for ``reduction="none"``, else a scalar; float32 (float64 when an input is float64).
        A row with no usable key has KL exactly 0 and contributes no gradient. Gradients come back in the dtypes of
        ``q_idx``, ``k_idx`` and ``w_idx`` (the math is fp32).

    Raises:
        TypeError: a non-tensor input, a non-floating ``q``/``k``/``q_idx``/``k_idx``/``w_idx``/``lse``, mismatched
            dtypes within ``(q, k)`` or ``(q_idx, k_idx)``, ``topk_indices`` not int32/int64, a mask that is not
            bool, a non-bool flag.
        ValueError: wrong ranks or shapes (named with what was expected), ``H`` not divisible by ``H_kv``, mixed
            devices, an unknown ``reduction``/``layout``/``backend``, a ``scale`` that is not finite and > 0,
            ``topk_indices`` out of ``[-1, N_k)`` or repeating a key in a row.

    Example:
        >>> import torch
        >>> from streamkl import indexer_kl
        >>> B, H, N, D, H_I, D_I = 2, 4, 16, 32, 3, 8
        >>> q, k = torch.randn(B, H, N, D), torch.randn(B, 1, N, D)          # main attention (MQA), constant
        >>> q_idx = torch.randn(B, H_I, N, D_I, requires_grad=True)          # the indexer
        >>> k_idx = torch.randn(B, N, D_I, requires_grad=True)
        >>> w_idx = torch.rand(B, N, H_I, requires_grad=True)
        >>> dense = indexer_kl(q, k, q_idx, k_idx, w_idx)                   # warm-up stage
        >>> with torch.no_grad():                                            # sparse stage: the indexer's top 4
        ...     scores = torch.einsum("bjtd,bsd->btjs", q_idx, k_idx).relu().mul(w_idx[..., None]).sum(2)
        ...     future = torch.ones(N, N, dtype=torch.bool).triu(1)
        ...     topk = scores.masked_fill(future, float("-inf")).topk(4, dim=-1).indices
        ...     topk = topk.masked_fill(topk > torch.arange(N)[:, None], -1)  # rows 0-2 have fewer than 4 keys
        >>> sparse = indexer_kl(q, k, q_idx, k_idx, w_idx, topk_indices=topk)
        >>> (dense + sparse).backward()
        >>> bool(dense > 0), tuple(q_idx.grad.shape), tuple(k_idx.grad.shape), tuple(w_idx.grad.shape)
        (True, (2, 3, 16, 8), (2, 16, 8), (2, 16, 3))
    """
    problem = prepare_indexer_problem(
        q, k, q_idx, k_idx, w_idx, causal=causal, scale=scale, lse=lse, topk_indices=topk_indices,
        key_padding_mask=key_padding_mask, reduction=reduction, layout=layout, backend=backend,
        check_indices=check_indices,
    )
    from .indexer_autograd import indexer_kl_per_row

    impl = resolve_indexer_backend(backend, problem)
    kl, lse_index = indexer_kl_per_row(
        problem.q.detach(), problem.k.detach(), problem.q_idx, problem.k_idx, problem.w_idx,
        None if problem.lse is None else problem.lse.detach(), problem.topk_indices, problem.key_padding_mask,
        problem.causal, problem.scale, impl,
    )
    return reduce_rows(kl, ~torch.isposinf(lse_index), problem.reduction)
