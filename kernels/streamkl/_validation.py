"""Input checking and normalisation for :func:`streamkl.attention_kl`.

The checks of one option (used when :class:`streamkl.options.AttentionKLOptions` is made) and
:func:`prepare_problem`, which checks the tensors against each other and the options. Every user-facing entry point
(the functional op, :class:`streamkl.AttentionKLLoss` and the naive oracle) goes through both, so a bad argument
fails with the same message everywhere. Messages name the argument, what was expected and what was given.
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING

import torch

from ._constants import UNBOUNDED
from ._problem import AttentionKLProblem

if TYPE_CHECKING:
    from .options import AttentionKLOptions

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_choice(name: str, value: object, allowed: tuple[str, ...]) -> str:
    """Return ``value`` if it is one of ``allowed``, else raise a ValueError naming ``name``."""
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"Expected argument `{name}` to be one of {list(allowed)}, but got {value!r}.")
    return value


#: The smallest normal float32: a smaller temperature's reciprocal scales the scores past float32's range.
FLOAT32_TINY: float = float(torch.finfo(torch.float32).tiny)


def check_temperature(temperature: object) -> float:
    """Return the temperature as a float; it must be a finite real number > 0."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(
            f"Expected argument `temperature` to be a Python float or int, but got {type(temperature).__name__}."
        )
    value = float(temperature)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"Expected argument `temperature` to be finite and > 0, but got {temperature!r}.")
    if value < FLOAT32_TINY:  # 1e-38 gave nan: the scores are divided by it in float32
        raise ValueError(f"Expected argument `temperature` to be finite and > 0, at least 1.1754944e-38 (the smallest "
                         f"normal float32; the op computes in float32), but got {temperature!r}.")
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


def check_window(window: object) -> tuple[int, int]:
    """Return ``window`` as ``(left, right)``; None means unbounded on both sides, ``(-1, -1)``."""
    if window is None:
        return UNBOUNDED, UNBOUNDED
    if (
        not isinstance(window, (tuple, list))
        or len(window) != 2
        or any(isinstance(w, bool) or not isinstance(w, int) for w in window)
    ):
        raise TypeError(
            f"Expected argument `window` to be None or a pair of ints (left, right), each >= -1 (-1 = unbounded), "
            f"but got {window!r}."
        )
    left, right = window
    if left < UNBOUNDED or right < UNBOUNDED:
        raise ValueError(
            f"Expected argument `window` to be a pair of ints (left, right), each >= -1 (-1 = unbounded), "
            f"but got {tuple(window)!r}."
        )
    return left, right


def check_softcap(name: str, cap: object) -> float | None:
    """Return the soft-cap as a float (or None: no capping); it must be finite and > 0."""
    if cap is None:
        return None
    if isinstance(cap, bool) or not isinstance(cap, (int, float)):
        raise TypeError(f"Expected argument `{name}` to be None or a Python float, but got {type(cap).__name__}.")
    value = float(cap)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(
            f"Expected argument `{name}` to be None (no capping) or a finite float > 0, but got {cap!r}."
        )
    return value


def check_flag(name: str, value: object) -> bool:
    """Return ``value`` if it is a bool, else raise a TypeError naming ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"Expected argument `{name}` to be a bool, but got {type(value).__name__}.")
    return value


def check_float_tensor(name: str, x: object, rank: int, shape_doc: str) -> torch.Tensor:
    """Return ``x`` if it is a floating-point tensor of ``rank`` dimensions, else raise a TypeError/ValueError naming
    ``name`` (``shape_doc`` describes the expected shape in the message)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"Expected argument `{name}` to be a torch.Tensor, but got {type(x).__name__}.")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"Expected argument `{name}` to have a floating dtype (float16, bfloat16, float32 or float64), "
            f"but got {x.dtype}."
        )
    if x.dim() != rank:
        raise ValueError(
            f"Expected argument `{name}` to be a {rank}-D tensor {shape_doc}, but got shape {tuple(x.shape)} "
            f"({x.dim()}-D)."
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
    if mask.device != device and mask.device.type != "cpu":
        raise ValueError(
            f"Expected argument `{name}` to be on {device} like q_t, or on the CPU, but got {mask.device}.")
    return mask


def _check_attn_mask(mask: object, batch: int, heads: int, n_q: int, n_k: int, device) -> torch.Tensor | None:
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"Expected argument `attn_mask` to be None or a torch.Tensor, but got {type(mask).__name__}.")
    if mask.dtype != torch.bool:
        raise TypeError(
            f"Expected argument `attn_mask` to have dtype torch.bool (True = the query may see the key), but got "
            f"{mask.dtype}; an additive float mask m converts as `m == 0` (or `m > -inf`)."
        )
    shape = tuple(mask.shape)
    if mask.dim() != 4 or shape[0] not in (1, batch) or shape[1] not in (1, heads) or shape[2:] != (n_q, n_k):
        raise ValueError(
            f"Expected argument `attn_mask` to have shape (B or 1, H or 1, N_q, N_k) = ({batch} or 1, {heads} or 1, "
            f"{n_q}, {n_k}), but got {shape}."
        )
    if mask.device != device:
        raise ValueError(f"Expected argument `attn_mask` to be on {device} like q_t, but got {mask.device}.")
    return mask


def _check_sinks(sinks_t: object, sinks_s: object, heads: int, device: torch.device) -> None:
    if (sinks_t is None) != (sinks_s is None):
        given, missing = ("sinks_t", "sinks_s") if sinks_s is None else ("sinks_s", "sinks_t")
        raise ValueError(
            f"Got `{given}` but `{missing}` is None: a sink is an extra outcome of a softmax, and a sink on one side "
            f"only has no counterpart on the other, so the KL would compare distributions over different outcomes. "
            "Pass the sink logits of both sides, or None on both to compare the distributions over the real keys."
        )
    for name, sinks in (("sinks_t", sinks_t), ("sinks_s", sinks_s)):
        if sinks is None:
            continue
        if not isinstance(sinks, torch.Tensor):
            raise TypeError(f"Expected argument `{name}` to be None or a torch.Tensor, but got {type(sinks).__name__}.")
        if sinks.dtype not in FLOAT_DTYPES:
            raise TypeError(f"Expected argument `{name}` to have a floating dtype, but got {sinks.dtype}.")
        if tuple(sinks.shape) != (heads,):
            raise ValueError(
                f"Expected argument `{name}` to have shape (H,) = ({heads},): one sink logit per query head, "
                f"but got {tuple(sinks.shape)}."
            )
        if sinks.device != device:
            raise ValueError(f"Expected argument `{name}` to be on {device} like q_t, but got {sinks.device}.")


def _check_cu_seqlens(name: str, cu: object, total: int, device: torch.device, read_values: bool
                      ) -> list[int] | None:
    """Check a ``cu_seqlens`` tensor (on ``device``, or on the CPU: offsets the host holds for inputs on a GPU);
    returns its values when they are read (always for offsets the host holds, whose reading costs no
    synchronisation), else None."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(
            f"Expected argument `{name}` to be a torch.Tensor of int32 cumulative sequence offsets (layout 'thd'), "
            f"but got {type(cu).__name__}."
        )
    if cu.dtype != torch.int32:
        raise TypeError(f"Expected argument `{name}` to have dtype torch.int32, but got {cu.dtype}.")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(
            f"Expected argument `{name}` to be a 1-D tensor [num_seqs + 1] with num_seqs >= 1, but got shape "
            f"{tuple(cu.shape)}."
        )
    if cu.device != device and cu.device.type != "cpu":
        raise ValueError(f"Expected argument `{name}` to be on {device} like q_t, or on the CPU, but got {cu.device}.")
    if not read_values and (cu.device.type != "cpu" or device.type == "cpu"):
        return None
    values = cu.tolist()
    if values[0] != 0 or values[-1] != total or any(b < a for a, b in itertools.pairwise(values)):
        shown = values if len(values) <= 12 else [*values[:6], "...", *values[-3:]]
        raise ValueError(
            f"Expected argument `{name}` to be non-decreasing offsets starting at 0 and ending at the total number of "
            f"tokens ({total}), but got {shown}."
        )
    return values


def _longest(offsets: list[int] | None) -> int | None:
    return None if offsets is None else max(b - a for a, b in itertools.pairwise(offsets))


def _check_max_seqlen(name: str, value: object, longest: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f"Expected argument `{name}` to be None or an int >= 0, but got {value!r}.")
    if longest is not None and value < longest:
        raise ValueError(
            f"Expected argument `{name}` to be at least the longest sequence ({longest}), but got {value}."
        )
    return value


def prepare_problem(q_t: torch.Tensor, k_t: torch.Tensor, q_s: torch.Tensor, k_s: torch.Tensor,
                    options: AttentionKLOptions) -> AttentionKLProblem:
    """Check the tensors of :func:`streamkl.attention_kl` against each other and against ``options`` (already checked
    on their own when they were made) and return the canonical problem."""
    layout, causal = options.layout, options.causal
    key_padding_mask, query_mask, attn_mask = options.key_padding_mask, options.query_mask, options.attn_mask
    sinks_t, sinks_s = options.sinks_t, options.sinks_s
    cu_seqlens_q, cu_seqlens_k = options.cu_seqlens_q, options.cu_seqlens_k
    max_seqlen_q, max_seqlen_k = options.max_seqlen_q, options.max_seqlen_k
    packed = layout == "thd"
    tensors = {"q_t": q_t, "k_t": k_t, "q_s": q_s, "k_s": k_s}
    for name, x in tensors.items():
        check_float_tensor(name, x, 3 if packed else 4, f"(layout {layout!r})")
    device = q_t.device
    for name, x in tensors.items():
        if x.device != device:
            raise ValueError(
                f"Expected all inputs on one device, but `q_t` is on {device} and `{name}` is on {x.device}."
            )
    if packed:  # (total, H, D) -> (1, H, total, D) strided view, no copy
        q_t, k_t, q_s, k_s = (x.transpose(0, 1).unsqueeze(0) for x in (q_t, k_t, q_s, k_s))
    elif layout == "bnhd":  # (B, N, H, D) -> (B, H, N, D) strided view, no copy
        q_t, k_t, q_s, k_s = (x.transpose(1, 2) for x in (q_t, k_t, q_s, k_s))
    fmt = {"bhnd": "(B, H, N, D)", "bnhd": "(B, N, H, D)", "thd": "(total, H, D)"}[layout]

    def shapes() -> str:  # for error messages only: built when one is raised
        return ", ".join(f"{n}={tuple(x.shape)}" for n, x in tensors.items())

    n_name = "total tokens" if packed else "N"

    batch, heads, n_q, _ = q_t.shape
    n_k = k_t.shape[2]
    for name, q, k in (("teacher", q_t, k_t), ("student", q_s, k_s)):
        side = name[0]
        if q.shape[-1] != k.shape[-1]:
            raise ValueError(
                f"Expected `q_{side}` and `k_{side}` to share the head dim D_{side}, "
                f"but got q_{side}: {q.shape[-1]} and k_{side}: {k.shape[-1]} (layout {layout} = {fmt}; {shapes()})."
            )
        if q.shape[-1] == 0:
            raise ValueError(f"Expected a head dim D_{side} >= 1, but got 0 ({shapes()}).")
        if q.shape[0] != batch or k.shape[0] != batch:
            raise ValueError(f"Expected the same batch size B for all inputs, but got {shapes()} (layout {fmt}).")
        if q.shape[1] != heads:
            raise ValueError(
                f"Expected `q_t` and `q_s` to have the same number of query heads H, but got {shapes()} "
                f"(layout {fmt})."
            )
        if q.shape[2] != n_q:
            raise ValueError(
                f"Expected `q_t` and `q_s` to have the same number of queries ({n_name}), but got {shapes()} "
                f"(layout {fmt})."
            )
        if k.shape[2] != n_k:
            raise ValueError(
                f"Expected `k_t` and `k_s` to have the same number of keys ({n_name}), but got {shapes()} "
                f"(layout {fmt})."
            )
        h_k = k.shape[1]
        if h_k == 0 or heads % h_k != 0:
            raise ValueError(
                f"Expected the query heads H={heads} to be divisible by the key heads of `k_{side}` "
                f"(H_k={h_k}) for grouped-query attention, but got {shapes()} (layout {fmt})."
            )
    for side in ("t", "s"):
        q, k = tensors[f"q_{side}"], tensors[f"k_{side}"]
        if q.dtype != k.dtype:
            raise TypeError(
                f"Expected `q_{side}` and `k_{side}` to have the same dtype, but got {q.dtype} and {k.dtype} "
                "(teacher and student may differ from each other)."
            )

    if packed:
        masks = (("key_padding_mask", key_padding_mask), ("query_mask", query_mask), ("attn_mask", attn_mask))
        for name, mask in masks:
            if mask is not None:
                raise ValueError(
                    f"Got `{name}` with layout='thd': packed sequences carry no padding, and their boundaries come "
                    "from `cu_seqlens_q`/`cu_seqlens_k`; drop the mask (or leave the padding tokens out of the pack)."
                )
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError(
                "Expected `cu_seqlens_q` and `cu_seqlens_k` (int32 cumulative offsets [num_seqs + 1]) with "
                f"layout='thd', but got cu_seqlens_q={type(cu_seqlens_q).__name__}, "
                f"cu_seqlens_k={type(cu_seqlens_k).__name__}."
            )
        # Reading the offsets costs a device synchronisation; with both maxima given they are trusted, as in
        # flash-attn's varlen functions (the kernels still never read outside the tensors).
        # Offsets on the CPU for inputs on a GPU are read for free: they are checked, give the maxima and the split
        # into sequences (streamkl.dispatch.read_offsets) without a synchronisation, and go to the device without one.
        read = max_seqlen_q is None or max_seqlen_k is None
        offsets_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, n_q, device, read)
        offsets_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, n_k, device, read)
        longest_q, longest_k = _longest(offsets_q), _longest(offsets_k)
        host_offsets = (offsets_q, offsets_k) if offsets_q is not None and offsets_k is not None and all(
            cu.device.type == "cpu" for cu in (cu_seqlens_q, cu_seqlens_k)) else None
        same = cu_seqlens_q is cu_seqlens_k or (offsets_q is not None and offsets_q == offsets_k)
        cu_seqlens_q = cu_seqlens_q.to(device, non_blocking=True)
        # equal offsets are one device tensor, as self-attention passes them (the Gluon training kernels need that)
        cu_seqlens_k = cu_seqlens_q if same else cu_seqlens_k.to(device, non_blocking=True)
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            raise ValueError(
                f"Expected `cu_seqlens_q` and `cu_seqlens_k` to describe the same number of sequences, but got "
                f"{cu_seqlens_q.numel() - 1} and {cu_seqlens_k.numel() - 1}."
            )
        max_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q, longest_q)
        max_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k, longest_k)
        max_q = longest_q if max_q is None else max_q
        max_k = longest_k if max_k is None else max_k
    else:
        for name, value in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                            ("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if value is not None:
                raise ValueError(
                    f"Got `{name}` with layout={layout!r}: sequence offsets belong to the packed layout; pass "
                    "layout='thd' with inputs [total_tokens, heads, dim]."
                )
        max_q, max_k, host_offsets = n_q, n_k, None
    key_padding_mask = _check_mask("key_padding_mask", key_padding_mask, batch, n_k, "N_k", device)
    query_mask = _check_mask("query_mask", query_mask, batch, n_q, "N_q", device)
    # Masks on the CPU for inputs on a GPU (as a data collator makes them) are kept for the host to read without a
    # synchronisation (streamkl.dispatch.read_masks), and go to the device without one.
    host_masks = {name: m for name, m in (("key_padding_mask", key_padding_mask), ("query_mask", query_mask))
                  if m is not None and m.device != device}
    if host_masks:
        key_padding_mask, query_mask = (None if m is None else m.to(device, non_blocking=True)
                                        for m in (key_padding_mask, query_mask))
    attn_mask = _check_attn_mask(attn_mask, batch, heads, n_q, n_k, device)
    _check_sinks(sinks_t, sinks_s, heads, device)

    left, right = check_window(options.window)
    if causal:  # flash-attn: causal is a window that ends at the diagonal
        right = 0
    st, ss = options.scale_t, options.scale_s
    return AttentionKLProblem(
        q_t=q_t,
        k_t=k_t,
        q_s=q_s,
        k_s=k_s,
        sinks_t=sinks_t,
        sinks_s=sinks_s,
        key_padding_mask=key_padding_mask,
        query_mask=query_mask,
        cu_seqlens_q=cu_seqlens_q if packed else None,
        cu_seqlens_k=cu_seqlens_k if packed else None,
        attn_mask=attn_mask,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        host_offsets=host_offsets,
        host_masks=host_masks or None,
        window=(left, right),
        scale_t=1.0 / math.sqrt(q_t.shape[-1]) if st is None else st,
        scale_s=1.0 / math.sqrt(q_s.shape[-1]) if ss is None else ss,
        softcap_t=options.softcap_t,
        softcap_s=options.softcap_s,
        temperature=options.temperature,
        reverse=options.direction == "reverse",
        reduction=options.reduction,
        layout=layout,
    )


def result_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 when any input is float64, else float32: the dtype of the per-row KL and of the math."""
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in tensors) else torch.float32
