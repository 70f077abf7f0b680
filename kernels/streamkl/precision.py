"""The precision of the op's products, chosen as torch's own attention and matmul choose it.

* Under autocast the inputs are cast once to the autocast dtype of their device, as autocast casts the inputs of
  ``F.scaled_dot_product_attention`` (an op on its lower-precision list): every floating input except float64 (which
  autocast leaves alone). The math after that cast is the op's own (fp32 statistics and accumulation); autocast is
  off inside the op, so no product of the reference backend is rounded to bf16 or fp16 again.
* float32 inputs outside autocast follow ``torch.get_float32_matmul_precision()``, as ``torch.matmul`` does:
  ``"highest"`` gives IEEE-fp32 products, ``"high"`` and ``"medium"`` TF32 tensor-core products (Triton backend; the
  reference backend always computes IEEE-fp32). An explicit ``allow_tf32`` decides instead.

:func:`product_precision` names the result for a dtype (what the pairing line of the Lightning front doors prints).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

__all__ = ["autocast_dtype", "cast_for_autocast", "no_autocast", "product_precision", "resolve_allow_tf32"]

#: What :func:`product_precision` calls each kind of product.
PRECISION_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast casts to on ``device`` while it is enabled there, else ``None``.

    Example:
        >>> autocast_dtype(torch.device("cpu")) is None
        True
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     autocast_dtype(torch.device("cpu"))
        torch.bfloat16
    """
    try:
        if not torch.is_autocast_enabled(device.type):
            return None
        return torch.get_autocast_dtype(device.type)
    except RuntimeError:  # a device type autocast does not know (e.g. meta)
        return None


def cast_for_autocast(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """The tensors as autocast hands them to an op on its lower-precision list: under autocast on their device, every
    floating tensor but a float64 one in the autocast dtype (a differentiable cast); otherwise unchanged.

    Example:
        >>> q = torch.randn(1, 2, 4, 8)
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     [x.dtype for x in cast_for_autocast(q, q.double())]
        [torch.bfloat16, torch.float64]
        >>> cast_for_autocast(q)[0] is q
        True
    """
    first = next((x for x in tensors if isinstance(x, torch.Tensor)), None)
    dtype = None if first is None else autocast_dtype(first.device)
    if dtype is None:
        return tensors
    return tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point()
                 and x.dtype not in (torch.float64, dtype) else x for x in tensors)


def no_autocast(device: torch.device) -> AbstractContextManager[None]:
    """A context that switches autocast off on ``device`` while the op's own math runs (a no-op when it is off).

    Example:
        >>> with torch.autocast("cpu"), no_autocast(torch.device("cpu")):
        ...     torch.is_autocast_enabled("cpu")
        False
    """
    if autocast_dtype(device) is None:
        return nullcontext()
    return torch.autocast(device.type, enabled=False)


def resolve_allow_tf32(allow_tf32: bool | None) -> bool:
    """Whether float32 products may use TF32: ``allow_tf32`` when given, else what
    ``torch.get_float32_matmul_precision()`` says (``"highest"``: no; ``"high"``, ``"medium"``: yes).

    Raises:
        TypeError: ``allow_tf32`` is neither None nor a bool.

    Example:
        >>> resolve_allow_tf32(True)
        True
        >>> previous = torch.get_float32_matmul_precision()
        >>> torch.set_float32_matmul_precision("high")
        >>> resolve_allow_tf32(None)
        True
        >>> torch.set_float32_matmul_precision(previous)
    """
    if allow_tf32 is None:
        if torch.compiler.is_compiling():  # read once, when the graph is traced (streamkl._traced_precision)
            from ._traced_precision import torch_allows_tf32

            return torch_allows_tf32()
        return torch.get_float32_matmul_precision() != "highest"
    if not isinstance(allow_tf32, bool):
        raise TypeError(f"Expected argument `allow_tf32` to be None or a bool, but got {type(allow_tf32).__name__}.")
    return allow_tf32


def product_precision(dtype: torch.dtype, allow_tf32: bool | None = None, *, backend: str = "triton") -> str:
    """What the products of one side's scores use for inputs of ``dtype``: ``"bf16"``, ``"fp16"`` (their
    products are exact in the fp32 accumulators), ``"fp32 (TF32)"``, ``"fp32 (IEEE)"`` or ``"fp64"``.
    ``allow_tf32`` as in :func:`resolve_allow_tf32`; the ``"reference"`` backend computes fp32 products in IEEE.

    Example:
        >>> product_precision(torch.bfloat16), product_precision(torch.float32, True)
        ('bf16', 'fp32 (TF32)')
        >>> product_precision(torch.float32, True, backend="reference")
        'fp32 (IEEE)'
    """
    if dtype in PRECISION_NAMES:
        return PRECISION_NAMES[dtype]
    tf32 = backend == "triton" and resolve_allow_tf32(allow_tf32)
    return "fp32 (TF32)" if tf32 else "fp32 (IEEE)"
