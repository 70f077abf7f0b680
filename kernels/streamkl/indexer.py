"""The indexer loss: :func:`indexer_kl`, training a DeepSeek-V3.2-style lightning indexer against the main attention.

This module holds the public op, its input checks (one place, shared by the oracle and every backend) and the
dispatch. The math lives in :mod:`streamkl.indexer_reference` (exact chunked PyTorch, the CPU backend), the fused
kernels in :mod:`streamkl._triton.indexer_forward` / :mod:`streamkl._triton.indexer_backward`, and the
materialising oracle in :mod:`streamkl.indexer_naive`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._constants import BACKENDS, REDUCTIONS
from ._triton_common.interpreter import triton_interpreter_enabled
from ._validation import FLOAT_DTYPES, check_choice, check_float_tensor

#: The layouts of :func:`indexer_kl` (the packed "thd" layout of attention_kl is not one of them).
INDEXER_LAYOUTS: tuple[str, ...] = ("bhnd", "bnhd")

INDEX_DTYPES = (torch.int32, torch.int64)
#: Largest head dim (``D`` and ``D_I``) and indexer head count the Triton kernels take.
MAX_TRITON_HEAD_DIM = 256
MAX_TRITON_INDEXER_HEADS = 128


@dataclass(frozen=True)
class IndexerKLProblem:
    """Validated inputs in the canonical views (strided views of the caller's tensors, never copies).

    ``q [B, H, N_q, D]``, ``k [B, H_kv, N_k, D]``, ``q_idx [B, H_I, N_q, D_I]``, ``k_idx [B, N_k, D_I]``,
    ``w_idx [B, N_q, H_I]``, ``lse [B, H, N_q]`` or None, ``topk_indices [B, N_q, K]`` or None,
    ``key_padding_mask [B, N_k]`` or None; ``scale`` resolved (``1/sqrt(D)`` by default).
    """

    q: torch.Tensor
    k: torch.Tensor
    q_idx: torch.Tensor
    k_idx: torch.Tensor
    w_idx: torch.Tensor
    lse: torch.Tensor | None
    topk_indices: torch.Tensor | None
    key_padding_mask: torch.Tensor | None
    causal: bool
    scale: float
    reduction: str

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def heads(self) -> int:
        return self.q.shape[1]

    @property
    def n_q(self) -> int:
        return self.q.shape[2]

    @property
    def n_k(self) -> int:
        return self.k.shape[2]

    @property
    def compute_dtype(self) -> torch.dtype:
        """float64 when any float input is float64, else float32: the dtype of the per-row KL and of the math."""
        floats = (self.q, self.k, self.q_idx, self.k_idx, self.w_idx)
        return torch.float64 if any(x.dtype == torch.float64 for x in floats) else torch.float32


def _check_shape(name: str, x: torch.Tensor, expected: tuple[int, ...], doc: str, shapes: str) -> None:
    if tuple(x.shape) != expected:
        raise ValueError(
            f"Expected argument `{name}` to have shape {doc} = {expected}, but got {tuple(x.shape)} ({shapes})."
        )


def check_topk_values(topk_indices: torch.Tensor, n_k: int) -> None:
    """Raise a ValueError unless every slot is ``-1`` or a key position in ``[0, N_k)``, distinct within a row.

    Costs one sort of the indices and one device synchronisation.

    Example:
        >>> check_topk_values(torch.tensor([[[0, 2, -1, -1]]]), n_k=3)
        >>> check_topk_values(torch.tensor([[[0, 2, 2]]]), n_k=3)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Expected the entries of `topk_indices` to be distinct within a row ... lists key 2 twice.
    """
    if topk_indices.numel() == 0:
        return
    lo, hi = int(topk_indices.min()), int(topk_indices.max())
    if lo < -1 or hi >= n_k:
        bad = lo if lo < -1 else hi
        where = (topk_indices == bad).nonzero()[0].tolist()
        raise ValueError(
            f"Expected every entry of `topk_indices` to be -1 (empty slot) or a key position in [0, N_k) = "
            f"[0, {n_k}), but got {bad} at (b, t, slot) = {tuple(where)}."
        )
    ordered = topk_indices.sort(dim=-1).values
    dup = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
    if bool(dup.any()):
        b, t, slot = dup.nonzero()[0].tolist()
        raise ValueError(
            "Expected the entries of `topk_indices` to be distinct within a row (-1 may repeat), but row "
            f"(b={b}, t={t}) lists key {int(ordered[b, t, slot])} twice."
        )


def check_indexer_options(*, causal: object, scale: object, reduction: object, layout: object,
                          backend: object) -> float | None:
    """Check every non-tensor option; returns ``scale`` as a float (None for the default)."""
    if not isinstance(causal, bool):
        raise TypeError(f"Expected argument `causal` to be a bool, but got {type(causal).__name__}.")
    check_choice("reduction", reduction, REDUCTIONS)
    check_choice("layout", layout, INDEXER_LAYOUTS)
    check_choice("backend", backend, BACKENDS)
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"Expected argument `scale` to be None or a Python float, but got {type(scale).__name__}.")
    if not math.isfinite(float(scale)) or float(scale) <= 0.0:
        raise ValueError(f"Expected argument `scale` to be a finite float > 0, but got {scale!r}.")
    return float(scale)


def prepare_indexer_problem(
    q: torch.Tensor,
    k: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w_idx: torch.Tensor,
    *,
    causal: bool,
    scale: float | None,
    lse: torch.Tensor | None,
    topk_indices: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    reduction: str,
    layout: str,
    backend: str = "auto",
    check_indices: bool = True,
) -> IndexerKLProblem:
    """Validate every argument of :func:`indexer_kl` and return the canonical problem (no copies)."""
    scale = check_indexer_options(causal=causal, scale=scale, reduction=reduction, layout=layout, backend=backend)
    if not isinstance(check_indices, bool):
        raise TypeError(f"Expected argument `check_indices` to be a bool, but got {type(check_indices).__name__}.")
    bnhd = layout == "bnhd"
    fmt4 = "[B, N, H, D]" if bnhd else "[B, H, N, D]"
    check_float_tensor("q", q, 4, fmt4)
    check_float_tensor("k", k, 4, fmt4.replace("H", "H_kv"))
    check_float_tensor("q_idx", q_idx, 4, fmt4.replace("H", "H_I").replace("D", "D_I"))
    check_float_tensor("k_idx", k_idx, 3, "[B, N_k, D_I]")
    check_float_tensor("w_idx", w_idx, 3, "[B, N_q, H_I]")
    tensors = {"q": q, "k": k, "q_idx": q_idx, "k_idx": k_idx, "w_idx": w_idx}
    device = q.device
    for name, x in tensors.items():
        if x.device != device:
            raise ValueError(
                f"Expected all inputs on one device, but `q` is on {device} and `{name}` is on {x.device}."
            )
    if q.dtype != k.dtype:
        raise TypeError(f"Expected `q` and `k` to have the same dtype, but got {q.dtype} and {k.dtype}.")
    if q_idx.dtype != k_idx.dtype:
        raise TypeError(
            f"Expected `q_idx` and `k_idx` to have the same dtype, but got {q_idx.dtype} and {k_idx.dtype}."
        )
    if bnhd:  # [B, N, H, D] -> [B, H, N, D] strided views
        q, k, q_idx = (x.transpose(1, 2) for x in (q, k, q_idx))
    shapes = f"layout {layout!r}: " + ", ".join(f"{n}={tuple(x.shape)}" for n, x in tensors.items())
    batch, heads, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    h_i, d_i = q_idx.shape[1], q_idx.shape[3]
    if k.shape[0] != batch or q_idx.shape[0] != batch or k_idx.shape[0] != batch or w_idx.shape[0] != batch:
        raise ValueError(f"Expected the same batch size B={batch} for all inputs, but got {shapes}.")
    if k.shape[3] != d:
        raise ValueError(f"Expected `q` and `k` to share the head dim D, but got {d} and {k.shape[3]} ({shapes}).")
    if d == 0 or d_i == 0:
        raise ValueError(f"Expected head dims D >= 1 and D_I >= 1, but got D={d}, D_I={d_i} ({shapes}).")
    if h_kv == 0 or heads % h_kv != 0:
        raise ValueError(
            f"Expected the query heads H={heads} of `q` to be divisible by the key heads H_kv={h_kv} of `k` "
            f"(grouped-query attention), but got {shapes}."
        )
    if h_i == 0:
        raise ValueError(f"Expected at least one indexer head H_I in `q_idx`, but got {shapes}.")
    if q_idx.shape[2] != n_q:
        raise ValueError(f"Expected `q_idx` to have N_q={n_q} query positions like `q`, but got {shapes}.")
    _check_shape("k_idx", k_idx, (batch, n_k, d_i), "[B, N_k, D_I]", shapes)
    _check_shape("w_idx", w_idx, (batch, n_q, h_i), "[B, N_q, H_I]", shapes)

    if lse is not None:
        if not isinstance(lse, torch.Tensor):
            raise TypeError(f"Expected argument `lse` to be None or a torch.Tensor, but got {type(lse).__name__}.")
        if lse.dtype not in FLOAT_DTYPES:
            raise TypeError(f"Expected argument `lse` to have a floating dtype (float32 best), but got {lse.dtype}.")
        _check_shape("lse", lse, (batch, heads, n_q), "[B, H, N_q] (the layout does not apply to it)", shapes)
        if lse.device != device:
            raise ValueError(f"Expected argument `lse` to be on {device} like `q`, but got {lse.device}.")
    if topk_indices is not None:
        if not isinstance(topk_indices, torch.Tensor):
            raise TypeError(
                f"Expected argument `topk_indices` to be None or a torch.Tensor, but got {type(topk_indices).__name__}."
            )
        if topk_indices.dtype not in INDEX_DTYPES:
            raise TypeError(f"Expected argument `topk_indices` to be int32 or int64, but got {topk_indices.dtype}.")
        if topk_indices.dim() != 3 or tuple(topk_indices.shape[:2]) != (batch, n_q) or topk_indices.shape[2] == 0:
            raise ValueError(
                f"Expected argument `topk_indices` to have shape [B, N_q, K] = ({batch}, {n_q}, K) with K >= 1, "
                f"but got {tuple(topk_indices.shape)}."
            )
        if topk_indices.device != device:
            raise ValueError(
                f"Expected argument `topk_indices` to be on {device} like `q`, but got {topk_indices.device}."
            )
        if check_indices and not torch.compiler.is_compiling():
            check_topk_values(topk_indices, n_k)
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor):
            raise TypeError(
                "Expected argument `key_padding_mask` to be None or a torch.Tensor, but got "
                f"{type(key_padding_mask).__name__}."
            )
        if key_padding_mask.dtype != torch.bool:
            raise TypeError(
                f"Expected argument `key_padding_mask` to have dtype torch.bool (True = real key), but got "
                f"{key_padding_mask.dtype}."
            )
        _check_shape("key_padding_mask", key_padding_mask, (batch, n_k), "[B, N_k]", shapes)
        if key_padding_mask.device != device:
            raise ValueError(f"Expected argument `key_padding_mask` to be on {device} like `q`, but got "
                             f"{key_padding_mask.device}.")
    return IndexerKLProblem(
        q=q, k=k, q_idx=q_idx, k_idx=k_idx, w_idx=w_idx, lse=lse, topk_indices=topk_indices,
        key_padding_mask=key_padding_mask, causal=causal, scale=1.0 / math.sqrt(d) if scale is None else scale,
        reduction=reduction,
    )


def reduce_rows(kl: torch.Tensor, counted: torch.Tensor, reduction: str) -> torch.Tensor:
    """Apply ``reduction`` to a per-row KL ``[B, N_q]``; ``"mean"`` averages over the ``counted`` rows (0 if none).

    Example:
        >>> float(reduce_rows(torch.tensor([[1.0, 3.0, 0.0]]), torch.tensor([[True, True, False]]), "mean"))
        2.0
    """
    if reduction == "none":
        return kl
    total = kl.sum()
    return total if reduction == "sum" else total / counted.sum().clamp_min(1).to(kl.dtype)


def resolve_indexer_backend(backend: str, problem: IndexerKLProblem) -> str:
    """``"triton"`` or ``"reference"``: what ``backend`` ("auto" | "triton" | "reference") runs for ``problem``.

    ``"auto"`` takes the fused kernels for CUDA tensors that are not float64 and the chunked reference otherwise.
    ``"triton"`` on a CPU tensor needs Triton's interpreter (``TRITON_INTERPRET=1``); a request the kernels cannot
    serve raises instead of silently falling back.
    """
    fp64 = problem.compute_dtype == torch.float64
    on_cuda = problem.q.device.type == "cuda"
    if backend == "reference" or (backend == "auto" and (fp64 or not on_cuda)):
        return "reference"
    if not on_cuda and not triton_interpreter_enabled():
        raise ValueError(
            f"backend='triton' needs CUDA tensors (got tensors on {problem.q.device}); set TRITON_INTERPRET=1 before "
            "importing triton to run the kernels on the CPU interpreter, or use backend='reference'."
        )
    if fp64:
        raise TypeError("backend='triton' computes in float32 and does not take float64 inputs; use "
                        "backend='reference' (or 'auto', which routes float64 there).")
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
