"""Input checking and normalisation for :func:`streamkl.attention_kl`.

Every user-facing entry point (the functional op, :class:`streamkl.AttentionKLLoss` and the naive oracle)
goes through :func:`prepare_problem`, so a bad argument fails with the same message everywhere. Messages
name the argument, what was expected and what was given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._constants import BACKENDS, DIRECTIONS, LAYOUTS, REDUCTIONS

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class AttentionKLProblem:
    """Validated inputs in the canonical ``(B, H, N, D)`` view (strided views, never copies).

    ``scale_t``/``scale_s`` already include the division by the temperature: the score of a pair is
    ``q·k · scale``.
    """

    q_t: torch.Tensor
    k_t: torch.Tensor
    q_s: torch.Tensor
    k_s: torch.Tensor
    key_padding_mask: torch.Tensor | None
    query_mask: torch.Tensor | None
    causal: bool
    scale_t: float
    scale_s: float
    reverse: bool
    reduction: str

    @property
    def batch(self) -> int:
        return self.q_t.shape[0]

    @property
    def heads(self) -> int:
        return self.q_t.shape[1]

    @property
    def n_q(self) -> int:
        return self.q_t.shape[2]

    @property
    def n_k(self) -> int:
        return self.k_t.shape[2]


def check_choice(name: str, value: object, allowed: tuple[str, ...]) -> str:
    """Return ``value`` if it is one of ``allowed``, else raise a ValueError naming ``name``."""
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"Expected argument `{name}` to be one of {list(allowed)}, but got {value!r}.")
    return value


def check_temperature(temperature: object) -> float:
    """Return the temperature as a float; it must be a finite real number > 0."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(
            f"Expected argument `temperature` to be a Python float or int, but got {type(temperature).__name__}."
        )
    value = float(temperature)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"Expected argument `temperature` to be finite and > 0, but got {temperature!r}.")
    return value


def check_scale(name: str, scale: object) -> float | None:
    """Return ``scale`` as a float (or None for the default); it must be finite and > 0."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(
            f"Expected argument `{name}` to be None or a Python float, but got {type(scale).__name__}."
        )
    value = float(scale)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"Expected argument `{name}` to be a finite float > 0, but got {scale!r}.")
    return value


def check_options(
    *,
    causal: object,
    scale_t: object,
    scale_s: object,
    temperature: object,
    direction: object,
    reduction: object,
    layout: object,
    backend: object,
) -> None:
    """Check every non-tensor option (used by the functional op and the module constructor)."""
    if not isinstance(causal, bool):
        raise TypeError(f"Expected argument `causal` to be a bool, but got {type(causal).__name__}.")
    check_scale("scale_t", scale_t)
    check_scale("scale_s", scale_s)
    check_temperature(temperature)
    check_choice("direction", direction, DIRECTIONS)
    check_choice("reduction", reduction, REDUCTIONS)
    check_choice("layout", layout, LAYOUTS)
    check_choice("backend", backend, BACKENDS)


def _check_tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"Expected argument `{name}` to be a torch.Tensor, but got {type(x).__name__}.")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"Expected argument `{name}` to have a floating dtype (float16, bfloat16, float32 or float64), "
            f"but got {x.dtype}."
        )
    if x.dim() != 4:
        raise ValueError(
            f"Expected argument `{name}` to be a 4-D tensor, but got shape {tuple(x.shape)} ({x.dim()}-D)."
        )
    return x


def _check_mask(name: str, mask: object, batch: int, length: int, length_name: str, device) -> torch.Tensor | None:
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"Expected argument `{name}` to be None or a torch.Tensor, but got {type(mask).__name__}.")
    if mask.dtype != torch.bool:
        raise TypeError(
            f"Expected argument `{name}` to have dtype torch.bool (True = keep), but got {mask.dtype}."
        )
    if tuple(mask.shape) != (batch, length):
        raise ValueError(
            f"Expected argument `{name}` to have shape (B, {length_name}) = {(batch, length)}, "
            f"but got {tuple(mask.shape)}."
        )
    if mask.device != device:
        raise ValueError(f"Expected argument `{name}` to be on {device} like q_t, but got {mask.device}.")
    return mask


def prepare_problem(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    q_s: torch.Tensor,
    k_s: torch.Tensor,
    *,
    causal: bool,
    scale_t: float | None,
    scale_s: float | None,
    temperature: float,
    direction: str,
    reduction: str,
    key_padding_mask: torch.Tensor | None,
    query_mask: torch.Tensor | None,
    layout: str,
    backend: str = "auto",
) -> AttentionKLProblem:
    """Validate all arguments of :func:`streamkl.attention_kl` and return the canonical problem."""
    check_options(
        causal=causal,
        scale_t=scale_t,
        scale_s=scale_s,
        temperature=temperature,
        direction=direction,
        reduction=reduction,
        layout=layout,
        backend=backend,
    )
    tensors = {"q_t": q_t, "k_t": k_t, "q_s": q_s, "k_s": k_s}
    for name, x in tensors.items():
        _check_tensor(name, x)
    device = q_t.device
    for name, x in tensors.items():
        if x.device != device:
            raise ValueError(
                f"Expected all inputs on one device, but `q_t` is on {device} and `{name}` is on {x.device}."
            )
    if layout == "bnhd":  # (B, N, H, D) -> (B, H, N, D) strided view, no copy
        q_t, k_t, q_s, k_s = (x.transpose(1, 2) for x in (q_t, k_t, q_s, k_s))
    fmt = "(B, H, N, D)" if layout == "bhnd" else "(B, N, H, D)"
    shapes = ", ".join(f"{n}={tuple(x.shape)}" for n, x in tensors.items())

    batch, heads, n_q, _ = q_t.shape
    n_k = k_t.shape[2]
    for name, q, k in (("teacher", q_t, k_t), ("student", q_s, k_s)):
        side = name[0]
        if q.shape[-1] != k.shape[-1]:
            raise ValueError(
                f"Expected `q_{side}` and `k_{side}` to share the head dim D_{side}, "
                f"but got q_{side}: {q.shape[-1]} and k_{side}: {k.shape[-1]} (layout {layout} = {fmt}; {shapes})."
            )
        if q.shape[-1] == 0:
            raise ValueError(f"Expected a head dim D_{side} >= 1, but got 0 ({shapes}).")
        if q.shape[0] != batch or k.shape[0] != batch:
            raise ValueError(f"Expected the same batch size B for all inputs, but got {shapes} (layout {fmt}).")
        if q.shape[1] != heads:
            raise ValueError(
                f"Expected `q_t` and `q_s` to have the same number of query heads H, but got {shapes} "
                f"(layout {fmt})."
            )
        if q.shape[2] != n_q:
            raise ValueError(
                f"Expected `q_t` and `q_s` to have the same number of queries N_q, but got {shapes} (layout {fmt})."
            )
        if k.shape[2] != n_k:
            raise ValueError(
                f"Expected `k_t` and `k_s` to have the same number of keys N_k, but got {shapes} (layout {fmt})."
            )
        h_k = k.shape[1]
        if h_k == 0 or heads % h_k != 0:
            raise ValueError(
                f"Expected the query heads H={heads} to be divisible by the key heads of `k_{side}` "
                f"(H_k={h_k}) for grouped-query attention, but got {shapes} (layout {fmt})."
            )
    for side in ("t", "s"):
        q, k = tensors[f"q_{side}"], tensors[f"k_{side}"]
        if q.dtype != k.dtype:
            raise TypeError(
                f"Expected `q_{side}` and `k_{side}` to have the same dtype, but got {q.dtype} and {k.dtype} "
                "(teacher and student may differ from each other)."
            )
    key_padding_mask = _check_mask("key_padding_mask", key_padding_mask, batch, n_k, "N_k", device)
    query_mask = _check_mask("query_mask", query_mask, batch, n_q, "N_q", device)

    t = check_temperature(temperature)
    st = check_scale("scale_t", scale_t)
    ss = check_scale("scale_s", scale_s)
    st = (1.0 / math.sqrt(q_t.shape[-1]) if st is None else st) / t
    ss = (1.0 / math.sqrt(q_s.shape[-1]) if ss is None else ss) / t
    return AttentionKLProblem(
        q_t=q_t,
        k_t=k_t,
        q_s=q_s,
        k_s=k_s,
        key_padding_mask=key_padding_mask,
        query_mask=query_mask,
        causal=causal,
        scale_t=st,
        scale_s=ss,
        reverse=direction == "reverse",
        reduction=reduction,
    )


def result_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 when any input is float64, else float32: the dtype of the per-row KL and of the math."""
    return torch.float64 if any(x.dtype == torch.float64 for x in tensors) else torch.float32
