"""Peak live-tensor bytes of a piece of torch code, measured op by op with a dispatch mode."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _LiveBytes(TorchDispatchMode):
    """Adds the storage size of every tensor an op creates; subtracts it when the storage is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _release(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self._seen:
                    self._seen.add(key)
                    self.live += storage.nbytes()
                    weakref.finalize(storage, self._release, key, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out


def peak_live_bytes(fn: Callable[[], object]) -> int:
    """Largest number of bytes held at once by tensors created while ``fn`` runs (inputs excluded)."""
    mode = _LiveBytes()
    with mode:
        fn()
    return mode.peak
