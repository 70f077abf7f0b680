r"""
Moving tensors between devices
^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^

:func:`to_device`, the one rule for every copy the package makes of a batch, a capture or a mask: asynchronous
(``non_blocking``) when the destination is an accelerator, synchronous when it is the host. An asynchronous copy
from a GPU to the host returns a tensor whose contents are undefined until the device is synchronised, so a
teacher kept on the host (``teacher_device="cpu"``) could read token ids that had not arrived yet.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["to_device"]


def to_device(data: Any, device: torch.device | str) -> Any:
    """``data`` with every tensor in it (in mappings, lists and tuples, at any depth) moved to ``device``: without
    waiting when ``device`` is an accelerator, and complete on return when it is the host.

    Example:
        >>> to_device({"x": [torch.ones(1)], "n": 3}, torch.device("cpu"))
        {'x': [tensor([1.])], 'n': 3}
    """
    if isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=torch.device(device).type != "cpu")
    if isinstance(data, Mapping):
        return {k: to_device(v, device) for k, v in data.items()}
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # a namedtuple
        return type(data)(*(to_device(v, device) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(to_device(v, device) for v in data)
    return data
