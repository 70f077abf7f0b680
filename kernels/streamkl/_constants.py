"""Numerical constants and option values shared by the reference, the Triton kernels and the public API."""

import math

#: log2(e). Scores are multiplied by ``scale * LOG2E`` so the kernels can use ``exp2`` (one MUFU.EX2
#: instruction on NVIDIA GPUs) instead of ``exp``; the saved log-sum-exps are then in base 2.
LOG2E: float = 1.0 / math.log(2.0)

#: ln(2). Converts base-2 quantities back to natural units (KL divergences and their gradients are in nats).
LN2: float = math.log(2.0)

#: Options accepted by :func:`streamkl.attention_kl`, in one place so the module and the function agree.
DIRECTIONS: tuple[str, ...] = ("forward", "reverse")
REDUCTIONS: tuple[str, ...] = ("none", "sum", "mean")
#: "thd" is the packed variable-length layout of flash-attn's varlen functions: ``[total_tokens, heads, dim]``.
LAYOUTS: tuple[str, ...] = ("bhnd", "bnhd", "thd")
BACKENDS: tuple[str, ...] = ("auto", "triton", "reference")

#: Window bound meaning "unbounded" (flash-attn's ``window_size`` convention).
UNBOUNDED: int = -1
