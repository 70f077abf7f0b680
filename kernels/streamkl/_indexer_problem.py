"""The indexer loss's problem: the input checks of :func:`streamkl.indexer_kl` (one place, shared by the op, the oracle
and every backend), the validated problem and its reductions. Imports no kernel (the oracle reads it)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._constants import BACKENDS, REDUCTIONS
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
