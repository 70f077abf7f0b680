"""What the portable Triton kernels (:mod:`streamkl._triton`) and the Hopper Gluon kernels (:mod:`streamkl._hopper`)
share, so that neither imports the other's private names:

* :mod:`.interpreter`: whether Triton's CPU interpreter is on (``TRITON_INTERPRET``; the one place that reads it);
* :mod:`.numerics`: the base-2 constants of the kernels and the score scales in their units;
* :mod:`.scheduling`: the longest-first order of causal grids, sized from the L2 cache;
* :mod:`.tiles`: :class:`~.tiles.LaunchConfig`, one kernel's tile shape and launch parameters;
* :mod:`.launch`: :class:`~.launch.KernelLauncher`, launches without Triton's per-call argument binding.

Importing this package imports nothing; :mod:`.interpreter` imports no Triton either.
"""
