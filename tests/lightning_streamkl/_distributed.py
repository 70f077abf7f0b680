"""Running Lightning's distributed strategies on CPU processes in tests.

:func:`launch` starts ``world`` processes with ``torch.multiprocessing`` and the environment of an external launcher
(``torchrun``-style: ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``), so a ``Trainer`` inside each of them
joins one gloo group whatever its strategy: DDP, ``FSDPStrategy`` (through :class:`CPUFSDPStrategy`) or
``ModelParallelStrategy``. :func:`full_state` reads a model's parameters and gradients unsharded, named as in the
unwrapped model, under any of them.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from lightning.pytorch.strategies import FSDPStrategy

from lightning_streamkl.capture.base import unwrapped_path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0",
                      WORLD_SIZE=str(world), RANK=str(rank))
    torch.set_num_threads(1)
    fn(rank, *args)
    # Rank 0 hosts the group's TCP store: were it to exit while another rank still reads from the store (the end of a
    # new_group), that rank would fail with "Connection reset by peer" (seen once in a CPU suite). No rank of a gloo
    # group leaves before all are done; NCCL groups (the GPU tests) are left to their own teardown.
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "gloo":
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def start_method_for(requested: str | None = None) -> str:
    """``requested``, else ``"fork"`` while this process has not initialised CUDA and ``"spawn"`` once it has.

    ``"fork"`` starts the processes in well under a second: they inherit the imported modules. A forked process
    cannot use CUDA once the parent initialised it ("Cannot re-initialize CUDA in forked subprocess"), which any GPU
    test earlier in the same pytest run does; a spawned one starts clean whatever ran before.
    """
    if requested is not None:
        return requested
    return "spawn" if torch.cuda.is_initialized() else "fork"


def launch(fn: Callable[..., None], world: int, *args: Any, start_method: str | None = None) -> None:
    """Run ``fn(rank, *args)`` in ``world`` processes that see one external-launch environment (each sets one
    intra-op thread first), started as :func:`start_method_for` says."""
    mp.start_processes(_entry, args=(world, free_port(), fn, args), nprocs=world,
                       start_method=start_method_for(start_method))


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy``, unchanged but for one argument: it wraps the model with
    ``device_id=torch.device("cpu")``. Lightning passes ``device_id=None`` on CPU, and FSDP then refuses to run
    without an accelerator; with the CPU named it runs on gloo. (Lightning also refuses ``strategy="fsdp"`` with
    ``accelerator="cpu"`` by the flag's exact type, which a subclass passes.)"""

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        original = FullyShardedDataParallel.__init__

        def init(wrapper, *args, device_id=None, **kwargs):
            original(wrapper, *args, device_id=torch.device("cpu") if device_id is None else device_id, **kwargs)

        FullyShardedDataParallel.__init__ = init
        try:
            return super()._setup_model(model)
        finally:
            FullyShardedDataParallel.__init__ = original


def full_state(trainer: Any, module: torch.nn.Module, grads: bool) -> dict[str, torch.Tensor]:
    """``module``'s parameters (or their gradients) unsharded, on the CPU, named as in the unwrapped model.

    Collective under FSDP (every process must call it): FSDP1 gathers with ``summon_full_params``, FSDP2 (DTensor
    parameters) with ``full_tensor``.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

    def read(p: torch.nn.Parameter) -> torch.Tensor | None:
        x = p.grad if grads else p
        if x is None:
            return None
        x = x.full_tensor() if isinstance(x, DTensor) else x
        return x.detach().cpu().clone()

    root = trainer.strategy.model
    if isinstance(root, FSDP):
        with FSDP.summon_full_params(root, with_grads=grads, writeback=False):
            return {unwrapped_path(n): v for n, p in module.named_parameters() if (v := read(p)) is not None}
    return {n: v for n, p in module.named_parameters() if (v := read(p)) is not None}


def run_and_collect(fn: Callable[..., None], world: int, *args: Any, start_method: str | None = None
                    ) -> list[dict[str, Any]]:
    """:func:`launch` ``fn(rank, out_dir, *args)``, which saves ``<out_dir>/rank<r>.pt``; returns those records."""
    with tempfile.TemporaryDirectory() as tmp:
        launch(fn, world, tmp, *args, start_method=start_method)
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world)]
