"""Kernel launches without Triton's per-call argument binding.

``kernel[grid](*args, **meta)`` binds and specialises every argument on every call (~70 arguments for the
attention-KL kernels: tens of microseconds of host time each launch). :class:`KernelLauncher` does that once
per specialisation: the first launch goes through Triton (which compiles or loads the kernel and returns it),
and later launches with the same specialisation call the compiled kernel's launcher directly, with exactly
the arguments, stream, launch metadata and launch hooks Triton would pass (Triton >= 3.3 passes every bound
argument, constexprs included, to ``CompiledKernel.run``).

The cache key holds everything Triton specialises on: every scalar argument's value (so ``== 1``, ``% 16`` and
the integer width are fixed), each tensor's dtype and 16-byte alignment, which optional tensors are None, the
constexprs, ``num_warps``/``num_stages`` and the device; for a TMA tensor descriptor (the Gluon kernels of
:mod:`streamkl._hopper`), its base tensor's dtype and alignment, shape, strides and block shape. Floats are part
of the key too, which costs nothing here (they follow the shapes and options). Under the interpreter every launch
goes through Triton.
"""

from __future__ import annotations

import torch
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

try:
    from triton import knobs
except ImportError:  # Triton < 3.4: no knobs; every launch goes through Triton
    knobs = None


#: Launch-cache entries per kernel (one per distinct geometry); the cache is emptied when full.
MAX_ENTRIES = 1024


class KernelLauncher:
    """Launch ``fn`` (a ``@triton.jit`` or ``@gluon.jit`` kernel whose parameters are: tensors or tensor descriptors,
    then scalars, then constexprs).

    Example (not run here: it needs a GPU)::

        launch = KernelLauncher(_attention_kl_fwd_kernel)
        launch(grid, tensors, scalars, meta)  # meta: ((name, value), ...) constexprs, then num_warps/num_stages
    """

    def __init__(self, fn):
        self.fn = fn
        self._kernels: dict = {}

    def __call__(self, grid: tuple[int, int], tensors: tuple, scalars: tuple, meta: tuple) -> None:
        fn = self.fn
        if knobs is None or not isinstance(fn, JITFunction):  # the interpreter (TRITON_INTERPRET=1), old Triton
            fn[grid](*tensors, *scalars, **dict(meta))
            return
        device = driver.active.get_current_device()
        signature = tuple(_signature(t) for t in tensors)
        key = (device, signature, scalars, meta)
        entry = self._kernels.get(key)
        if entry is None:
            kernel = fn[grid](*tensors, *scalars, **dict(meta))
            if kernel is not None and hasattr(kernel, "result"):  # Triton's async compile mode
                kernel = kernel.result()
            if kernel is not None and hasattr(kernel, "run") and hasattr(kernel, "packed_metadata"):
                named = dict(meta)
                tail = tuple(named[name] for name in fn.arg_names[len(tensors) + len(scalars):])
                if len(self._kernels) >= MAX_ENTRIES:  # shapes that change every call (packed batches): stay bounded
                    self._kernels.clear()
                self._kernels[key] = (kernel, tail)
            return
        kernel, tail = entry
        stream = driver.active.get_current_stream(device)
        args = (*tensors, *scalars, *tail)
        runtime = knobs.runtime
        kernel.run(grid[0], grid[1], 1, stream, kernel.function, kernel.packed_metadata,
                   kernel.launch_metadata(grid, stream, *args), runtime.launch_enter_hook, runtime.launch_exit_hook,
                   *args)


def _signature(t) -> tuple | None:
    """What Triton specialises a tensor (or tensor-descriptor) argument on, as a hashable key."""
    if t is None:
        return None
    base = getattr(t, "base", None)
    if base is not None and hasattr(t, "block_shape"):  # a host-side TMA descriptor
        return (base.dtype, base.data_ptr() % 16 == 0, tuple(t.shape), tuple(t.strides), tuple(t.block_shape))
    return (t.dtype, t.data_ptr() % 16 == 0)


def contiguous_or_none(x: torch.Tensor | None) -> torch.Tensor | None:
    """``x`` made contiguous (a copy only where it is not), or None for a missing optional tensor (the sinks).

    Example:
        >>> contiguous_or_none(None) is None, contiguous_or_none(torch.zeros(2, 3).t()).is_contiguous()
        (True, True)
    """
    return None if x is None else x.contiguous()


def tensor_geometry(*tensors: torch.Tensor | None) -> tuple:
    """``(shape, strides)`` of each tensor (None for a missing one): the hashable part of a launch plan's key."""
    return tuple(None if t is None else (t.shape, t.stride()) for t in tensors)
