r"""
Frozen teacher
^^^^^^^^^^^^^^

Everything about running the teacher of a distillation, and nothing else: loading it by name
(:func:`load_teacher`), freezing it, placing it (:class:`FrozenTeacher`: its own dtype unless told otherwise, on
the student's device, where it is, on another device, or kept in host memory and streamed onto the device one block
at a time for each pass (:func:`streamed`), or sharded over the processes of a data-parallel group with FSDP2:
:func:`shard_module`), the student itself with its adapters switched off as the teacher (:class:`AdaptersOff`,
:class:`SelfTeacher`: no second copy in memory), stopping its forward pass once the paired layers have been captured
(:func:`stop_after`), and feeding it the inputs a student submodule received (:class:`InputRecorder`,
:func:`find_copy`).
"""

from __future__ import annotations

import difflib
import os
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .transfer import to_device

__all__ = ["AdaptersOff", "FrozenTeacher", "InputRecorder", "SelfTeacher", "TeacherForwardError", "adapters_disabled",
           "borrowed", "check_separate", "check_teacher_path", "find_adapter_module", "find_copy", "is_compiled",
           "is_sharded", "load_teacher", "looks_like_path", "reshard", "shard_count", "shard_module", "shard_units",
           "shared_parameters", "stop_after", "streamed", "teacher_failed", "to_device"]

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def load_teacher(teacher: nn.Module | str, from_pretrained: Mapping[str, Any] | None = None) -> nn.Module:
    """A module as is; a string is a Hugging Face model name or local path, loaded with ``AutoModel`` (no LM head).

    Args:
        teacher: the module, or the name/path of a Hugging Face model.
        from_pretrained: keyword arguments of ``AutoModel.from_pretrained`` (``dtype``, ``revision``,
            ``attn_implementation``, ``trust_remote_code``, ``device_map``, ...); ``attn_implementation``
            defaults to ``"sdpa"``.

    Example:
        >>> load_teacher(nn.Linear(2, 2))
        Linear(in_features=2, out_features=2, bias=True)
        >>> load_teacher(3)
        Traceback (most recent call last):
        ...
        TypeError: Expected `teacher` to be a torch.nn.Module or the name/path of a Hugging Face model, but got int.
    """
    if isinstance(teacher, nn.Module):
        return teacher
    if isinstance(teacher, str):
        check_teacher_path(teacher)
        try:
            from transformers import AutoModel
        except ImportError as err:  # pragma: no cover
            raise ImportError(f"A teacher given by name ({teacher!r}) needs transformers; install it.") from err
        return AutoModel.from_pretrained(teacher, **{"attn_implementation": "sdpa", **dict(from_pretrained or {})})
    raise TypeError(
        f"Expected `teacher` to be a torch.nn.Module or the name/path of a Hugging Face model, but got "
        f"{type(teacher).__name__}."
    )


def looks_like_path(name: str) -> bool:
    """True when ``name`` reads as a file-system path rather than a Hugging Face hub id (``org/model``): it starts
    with ``/``, ``.``, ``~`` or a drive letter, holds a backslash, or has more than one ``/``.

    Example:
        >>> [looks_like_path(n) for n in ("meta-llama/Llama-3.2-1B", "./runs/teacher", "/ckpt/llama", "gpt2")]
        [False, True, True, False]
    """
    return (name.startswith(("/", ".", "~")) or "\\" in name or name.count("/") > 1
            or (len(name) > 2 and name[1] == ":" and name[0].isalpha()))


def check_teacher_path(name: str) -> None:
    """Refuse a teacher name that looks like a path (:func:`looks_like_path`) but names no directory, listing the
    closest entries of the nearest folder that exists (transformers would call it a malformed hub id instead).

    Raises:
        FileNotFoundError: the path does not exist or is not a directory.

    Example:
        >>> check_teacher_path("meta-llama/Llama-3.2-1B")   # a hub id: left to transformers
        >>> check_teacher_path("/no/such/teacher")
        Traceback (most recent call last):
        ...
        FileNotFoundError: Expected `teacher` to be a Hugging Face hub id or a local model directory, but there is \
no such directory: '/no/such/teacher' (the nearest existing folder is '/').
    """
    if not looks_like_path(name):
        return
    path = Path(os.path.expanduser(name))
    if path.is_dir():
        return
    what = "it is a file, not a model directory" if path.exists() else "there is no such directory"
    parent = path.parent
    while not parent.is_dir() and parent != parent.parent:
        parent = parent.parent
    hint = ""
    if parent.is_dir():
        hint = f" (the nearest existing folder is {str(parent)!r}"
        if parent == path.parent:
            entries = sorted(p.name for p in parent.iterdir() if p.is_dir())
            near = difflib.get_close_matches(path.name, entries, n=3)
            hint += f"; closest entries: {near}" if near else ""
        hint += ")"
    raise FileNotFoundError(
        f"Expected `teacher` to be a Hugging Face hub id or a local model directory, but {what}: {name!r}{hint}."
    )


def _tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def _target(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``t`` is borrowed in: ``dtype`` for a floating-point tensor (when given), else its own."""
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


@contextmanager
def borrowed(module: nn.Module, device: torch.device, dtype: torch.dtype | None = None) -> Iterator[None]:
    """Run ``module`` (kept in host memory) on ``device``: inside the block its tensors' data are device copies.

    ``dtype`` also casts the floating-point tensors. The host tensors are put back afterwards without a copy (a
    frozen teacher never changes), which releases the device copies.

    Example:
        >>> layer = nn.Linear(2, 2)
        >>> with borrowed(layer, torch.device("cpu"), torch.float64):
        ...     layer.weight.dtype
        torch.float64
        >>> layer.weight.dtype
        torch.float32
    """

    saved = [(t, t.data) for t in _tensors(module) if t.device != device or t.dtype != _target(t, dtype)]
    try:
        _lend(saved, device, dtype)
        yield
    finally:
        for t, host in saved:
            t.data = host


def _lend(saved: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device, dtype: torch.dtype | None) -> None:
    """Give each tensor of ``saved`` (``(tensor, its host data)``) a device copy of that data, in the dtype it is
    borrowed in (:func:`_target`)."""
    for t, host in saved:
        t.data = host.to(device=device, dtype=_target(t, dtype), non_blocking=True)


def _blocks(module: nn.Module) -> list[nn.Module]:
    """:func:`shard_units` without those inside another one."""
    units = shard_units(module)
    inner = {id(m) for u in units for m in u.modules() if m is not u}
    return [u for u in units if id(u) not in inner]


class _BlockStream:
    """The blocks of one streamed pass (:func:`streamed`): which are on the device, which are running, and the
    copies still in flight. Blocks are numbered in the order of their list.

    Why the CUDA copy ahead is safe with the caching allocator. A block's device copies are allocated on the compute
    stream (the current one), so when they are freed their memory goes back to that stream's pool, and whatever is
    allocated there next is used by work queued after everything before the free. Two orders remain. (1) The memory
    handed out may have been freed by compute work that is still queued (the last block's activations, read by kernels
    not yet run): the copy stream waits for an event recorded on the compute stream after the allocation, so it writes
    only once that work is done. (2) The copy stream writes memory the compute stream owns: the compute stream waits
    for the copy's done-event before the block runs, and before a copy that never ran (a wrong guess, or the end of
    the pass) is given back, so no work queued after the free can touch the memory while the copy still writes it.
    The host tensors are the module's own and outlive the pass. No ``record_stream`` is needed.
    """

    def __init__(self, blocks: list[list[torch.Tensor]], ahead: int, device: torch.device,
                 dtype: torch.dtype | None) -> None:
        self.blocks, self.ahead, self.device, self.dtype = blocks, ahead, device, dtype
        self.copier = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self.held: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # block -> (tensor, its host data)
        self.pending: dict[int, Any] = {}  # block -> the done-event of a copy the compute stream has not waited for
        self.running: dict[int, int] = {}  # block -> the depth of its forward calls now running

    def take(self, i: int, *, early: bool = False) -> None:
        """Borrow block ``i``: now, on the compute stream, or (``early``, on CUDA) copied on the side stream."""
        held = [(t, t.data) for t in self.blocks[i]]
        self.held[i] = held
        if not early or self.copier is None:
            _lend(held, self.device, self.dtype)
            return
        compute = torch.cuda.current_stream(self.device)
        copies = [torch.empty_like(host, device=self.device, dtype=_target(t, self.dtype)) for t, host in held]
        allocated = compute.record_event()
        with torch.cuda.stream(self.copier):
            self.copier.wait_event(allocated)
            for copy, (_, host) in zip(copies, held):
                copy.copy_(host, non_blocking=True)
            self.pending[i] = self.copier.record_event()
        for copy, (t, _) in zip(copies, held):
            t.data = copy

    def ready(self, i: int) -> None:
        """Make the compute stream wait for block ``i``'s copy, if it is still in flight."""
        event = self.pending.pop(i, None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def give_back(self, i: int) -> None:
        self.ready(i)  # (2): a copy that never ran is waited for before its memory can be handed out again
        for t, host in self.held.pop(i):
            t.data = host

    def copy_ahead(self, i: int) -> None:
        """Copy block ``i`` ahead, if there is one, it may run (``<= ahead``) and at most one other is held."""
        if i < len(self.blocks) and i <= self.ahead and i not in self.held and len(self.held) < 2:
            self.take(i, early=True)

    def enter(self, i: int) -> None:
        """Block ``i`` starts (its forward pre-hook)."""
        if i in self.running:  # called again from inside itself
            self.running[i] += 1
            return
        if i not in self.held:  # not the block copied ahead: give that one back, borrow this one now
            for j in [j for j in self.held if j not in self.running]:
                self.give_back(j)
            self.take(i)
        self.ready(i)
        self.running[i] = 1
        self.copy_ahead(i + 1)

    def leave(self, i: int) -> None:
        """Block ``i`` ends, also by an exception (its forward hook, ``always_call``)."""
        depth = self.running.pop(i, 1) - 1
        if depth > 0:
            self.running[i] = depth
        elif i in self.held:
            self.give_back(i)

    def close(self) -> None:
        self.running.clear()
        for i in list(self.held):
            self.give_back(i)


def _output_head(module: nn.Module) -> nn.Module | None:
    """A Hugging Face model's output head (``get_output_embeddings()``, e.g. ``lm_head``), or None: a teacher stopped
    after its deepest paired layer never runs it, so :func:`streamed` borrows what only it holds when it starts, not
    for the whole pass (a head tied to the input embeddings holds nothing of its own)."""
    get = getattr(module, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, nn.Module) else None


@contextmanager
def streamed(module: nn.Module, device: torch.device, dtype: torch.dtype | None = None, *,
             up_to: Iterable[nn.Module] | None = None) -> Iterator[None]:
    """Run ``module`` (kept in host memory) on ``device`` one block at a time: as :func:`borrowed`, but each block's
    tensors (:func:`shard_units`: a Hugging Face model's layers, else its module lists' entries) are on the device
    only while the block runs, and the next block's while they are copied ahead: at most two blocks at once.

    The tensors outside the blocks (embeddings, a final norm, rotary buffers) are borrowed for the whole ``with``
    block, except a Hugging Face model's output head (``get_output_embeddings()``, untied), borrowed when it starts:
    a pass that stops after its deepest paired layer never copies it. A block is borrowed by a forward pre-hook and
    given back by a forward hook, also when its forward raises; when the ``with`` block ends, however the pass ended
    (an early exit, an error), every tensor holds its host data again. On CUDA the next block in list order is copied
    from (pinned) host memory on a side stream while the current one computes; a block that runs out of that order, or
    twice, is borrowed at once instead (the one copied ahead is given back). On other devices every copy is made when
    its block starts. A module without blocks is borrowed whole (:func:`borrowed`).

    Args:
        module: the module, its tensors in host memory.
        device: where it runs.
        dtype: also cast the floating-point tensors to this dtype. Default: ``None`` (keep).
        up_to: the modules the pass stops after (an early exit): no block past the last one holding one of them is
            copied ahead. Default: ``None`` (any block may run).

    Example:
        >>> encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 3,
        ...                                 enable_nested_tensor=False)
        >>> held = []  # the number of borrowed (float64) blocks as each block finishes
        >>> for layer in encoder.layers:
        ...     _ = layer.register_forward_hook(lambda *_: held.append(
        ...         sum(layer.linear1.weight.dtype == torch.float64 for layer in encoder.layers)))
        >>> with torch.no_grad(), streamed(encoder, torch.device("cpu"), torch.float64):
        ...     _ = encoder(torch.randn(1, 4, 8, dtype=torch.float64))
        >>> held, encoder.layers[0].linear1.weight.dtype
        ([2, 2, 1], torch.float32)
    """
    units = _blocks(module)
    inside: dict[int, int] = {}  # module -> the block holding it (-1: several)
    for i, unit in enumerate(units):
        for m in unit.modules():
            inside[id(m)] = i if inside.get(id(m), i) == i else -1
    head = _output_head(module)
    in_head = set() if head is None else {id(m) for m in head.modules()}
    owner: dict[int, int] = {}  # tensor -> the one block whose modules hold it (-1: several, or a module outside)
    head_only: dict[int, bool] = {}  # tensor -> whether only the output head's modules hold it
    tensors: dict[int, torch.Tensor] = {}
    for m in module.modules():
        where = inside.get(id(m), -1)
        for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)):
            owner[id(t)] = where if owner.get(id(t), where) == where else -1
            head_only[id(t)] = head_only.get(id(t), True) and id(m) in in_head
            tensors[id(t)] = t
    moving = [t for t in tensors.values() if t.device != device or t.dtype != _target(t, dtype)]
    blocks: list[list[torch.Tensor]] = [[] for _ in units]
    for t in moving:
        if owner[id(t)] >= 0:
            blocks[owner[id(t)]].append(t)
    kept = [i for i, held in enumerate(blocks) if held]
    if not kept:
        with borrowed(module, device, dtype):
            yield
        return
    ahead = len(kept) - 1
    if up_to is not None:
        last = [inside.get(id(m), -1) for m in up_to]
        if last and -1 not in last:  # (a module outside the blocks, or in several: any block may run)
            ahead = max((n for n, i in enumerate(kept) if i <= max(last)), default=-1)
    stream = _BlockStream([blocks[i] for i in kept], ahead, device, dtype)
    outside = [t for t in moving if owner[id(t)] == -1]
    lazy = [t for t in outside if head_only[id(t)]]
    saved = [(t, t.data) for t in outside if not head_only[id(t)]]
    handles = []

    def borrow_head(*_) -> None:  # the output head, when it runs: once per pass
        held = [(t, t.data) for t in lazy]
        saved.extend(held)
        _lend(held, device, dtype)
        lazy.clear()

    try:
        _lend(saved, device, dtype)
        if lazy:
            handles.append(head.register_forward_pre_hook(borrow_head, prepend=True))
        for n, i in enumerate(kept):
            handles.append(units[i].register_forward_pre_hook(lambda *_, n=n: stream.enter(n), prepend=True))
            handles.append(units[i].register_forward_hook(lambda *_, n=n: stream.leave(n), always_call=True))
        stream.copy_ahead(0)
        yield
    finally:
        for handle in handles:
            handle.remove()
        stream.close()
        for t, host in saved:
            t.data = host


class _TeacherDone(BaseException):
    """Raised from a forward hook once every paired teacher layer has been captured; caught by :func:`stop_after`.

    A ``BaseException``, so that a model's own ``except Exception`` cannot swallow it.
    """


def is_compiled(module: nn.Module) -> bool:
    """True when ``module`` or one of its submodules runs compiled (``module.compile()``, or a ``torch.compile``
    wrapper): a forward hook inside it is traced into the graph, which cannot raise out of itself, so
    :func:`stop_after` cannot stop such a pass.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> is_compiled(model), is_compiled(torch.compile(model, backend="eager"))
        (False, True)
        >>> model[0].compile(backend="eager")
        >>> is_compiled(model)
        True
    """
    return any(isinstance(m, torch._dynamo.eval_frame.OptimizedModule)
               or getattr(m, "_compiled_call_impl", None) is not None for m in module.modules())


@contextmanager
def stop_after(modules: Iterable[nn.Module], done: Callable[[], bool]) -> Iterator[None]:
    """Stop the forward pass run inside the block as soon as one of ``modules`` finishes and ``done()`` is true.

    Later layers (and an output head) then never run; the block ends normally. Hooks are removed afterwards.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
        >>> ran = []
        >>> _ = model[2].register_forward_hook(lambda *_: ran.append("last"))
        >>> with stop_after([model[0]], lambda: True):
        ...     model(torch.ones(1, 2))
        >>> ran
        []
    """

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if done():
            raise _TeacherDone

    handles = [m.register_forward_hook(hook) for m in modules]
    try:
        yield
    except _TeacherDone as stopped:
        # The traceback holds the stopped frames and with them the teacher's activations (the residual stream,
        # the stopped layer's inputs and output). Clear them now rather than whenever the exception object is
        # collected: measured on an H100 (Python 3.12), they otherwise stayed alive through the student's step.
        traceback.clear_frames(stopped.__traceback__)
        stopped.__traceback__ = None  # a cleared frame still holds its function, and a closure its cells
    finally:
        for handle in handles:
            handle.remove()


def _shapes(module: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    return [(n, tuple(t.shape)) for n, t in (*module.named_parameters(), *module.named_buffers())]


def find_copy(teacher: nn.Module, student: nn.Module) -> str | None:
    """The path of the submodule of ``student`` that ``teacher`` is a copy of (same type, parameter and buffer
    names and shapes), or ``None``; the root itself and the teacher object (if the student holds it) never count.

    Example:
        >>> import copy
        >>> student = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4))
        >>> find_copy(copy.deepcopy(student[1]), student)
        '1'
    """
    kind, shapes = type(teacher), None
    for path, module in student.named_modules():
        if not path or module is teacher or type(module) is not kind:
            continue
        shapes = _shapes(teacher) if shapes is None else shapes
        if _shapes(module) == shapes:
            return path
    return None


class InputRecorder:
    """Record the arguments of the last call of ``module`` while :meth:`recording` is open (a forward pre-hook).

    The distiller replays them into a teacher that is a copy of ``module``, so the teacher sees exactly what its
    live counterpart saw, whatever the LightningModule did to the batch first (embeddings, projections).

    Example:
        >>> layer = nn.Linear(2, 2)
        >>> recorder = InputRecorder(layer)
        >>> with recorder.recording():
        ...     _ = layer(torch.ones(1, 2))
        >>> args, kwargs = recorder.take()
        >>> args[0].shape, kwargs, recorder.called
        (torch.Size([1, 2]), {}, False)
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._call: tuple[tuple[Any, ...], dict[str, Any]] | None = None

    @property
    def called(self) -> bool:
        """True when the module ran since the last :meth:`take` or :meth:`clear`."""
        return self._call is not None

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Record the module's calls inside the block (the last one is kept)."""

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._call = (args, dict(kwargs))

        handle = self.module.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()

    def take(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Hand over the recorded ``(args, kwargs)`` and forget them.

        Raises:
            RuntimeError: the module did not run.
        """
        if self._call is None:
            raise RuntimeError(
                f"The teacher is fed the inputs of the student's {type(self.module).__name__}, but it did not run "
                "during this step; set `teacher_inputs='batch'` (and a `teacher_forward`) or run that submodule."
            )
        call, self._call = self._call, None
        return call

    def clear(self) -> None:
        """Forget the recorded call."""
        self._call = None


def shard_units(module: nn.Module) -> list[nn.Module]:
    """The blocks of ``module`` that FSDP shards one by one (each is gathered for its own forward only).

    A Hugging Face model names them in ``_no_split_modules`` (its decoder/encoder layer classes); any other model's
    blocks are the entries of its module lists (``nn.ModuleList``) that hold parameters. The root is not among them.

    Example:
        >>> layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        >>> model = nn.Sequential(nn.Embedding(10, 4), nn.Sequential(*layers))
        >>> model.blocks = layers
        >>> len(shard_units(model))
        3
    """
    names: set[str] = set()
    for m in module.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    if names:
        return [m for m in module.modules() if m is not module and type(m).__name__ in names]
    units: dict[int, nn.Module] = {}
    for m in module.modules():
        if isinstance(m, nn.ModuleList):
            for child in m:
                if child is not module and any(True for _ in child.parameters()):
                    units.setdefault(id(child), child)
    return list(units.values())


def shard_module(module: nn.Module, mesh: Any) -> nn.Module:
    """Shard a frozen ``module`` over ``mesh`` (a 1-D ``DeviceMesh``) with FSDP2 (``fully_shard``): each of
    :func:`shard_units` and then the root; the module keeps its type (an FSDP subclass of it) and its module paths.

    Each process then holds ``1/W`` of the parameters on the mesh's device; a forward pass gathers one block at a
    time and frees it after (``reshard_after_forward``). It is collective: every process of the mesh must run the
    same forward passes (the distiller does, every step).
    """
    from torch.distributed.fsdp import fully_shard

    for unit in shard_units(module):
        fully_shard(unit, mesh=mesh, reshard_after_forward=True)
    fully_shard(module, mesh=mesh, reshard_after_forward=True)
    return module


def is_sharded(module: nn.Module) -> bool:
    """True when ``module`` or one of its submodules is sharded with FSDP2 (``fully_shard``).

    Example:
        >>> is_sharded(nn.Linear(2, 2))
        False
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return any(isinstance(m, FSDPModule) for m in module.modules())


def shard_count(module: nn.Module) -> int:
    """The number of processes ``module``'s parameters are sharded over (the size of the first sharded parameter's
    device mesh); 1 when none is sharded.

    Example:
        >>> shard_count(nn.Linear(2, 2))
        1
    """
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return 1
    for p in module.parameters():
        if isinstance(p, DTensor):
            return int(p.device_mesh.size())
    return 1


def reshard(module: nn.Module) -> None:
    """Free every gathered block of an FSDP2-sharded ``module`` (a forward pass stopped early skips FSDP's own
    post-forward resharding of the block it stopped in, and of the root).

    Example:
        >>> reshard(nn.Linear(2, 2))  # nothing sharded: nothing to do
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


# ------------------------------------------------------------------------------------------ teacher and student apart
def _paths_of(root: nn.Module, module: nn.Module) -> list[str]:
    """Every path under which ``module`` is reachable in ``root`` (``""``: the root itself)."""
    return [name for name, m in root.named_modules(remove_duplicate=False) if m is module]


def _storage_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """``(device, storage address)`` of a tensor with data of its own, else ``None`` (meta, empty, a DTensor, ...)."""
    try:
        if t.is_meta or t.numel() == 0 or type(t) not in (torch.Tensor, nn.Parameter):
            return None
        return (t.device, t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # pragma: no cover - tensor subclasses without storage
        return None


def shared_parameters(teacher: nn.Module, student: nn.Module) -> list[tuple[str, str]]:
    """The parameters the teacher and the student share, as ``(teacher name, student name)``: the same parameter
    (a module assigned to both, ``student.embed = teacher.embed``) or one storage (``nn.Parameter(teacher.w)``).

    A teacher that the student holds whole (a LightningModule with ``self.teacher = ...``) is not sharing: its
    subtree of the student is left out. Freezing the teacher would freeze shared parameters in the student, and
    training the student would move the teacher.

    Example:
        >>> teacher = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4))
        >>> student = nn.Sequential(teacher[0], nn.Linear(4, 2))       # reuses the teacher's embedding
        >>> shared_parameters(teacher, student)
        [('0.weight', '0.weight')]
        >>> holder = nn.ModuleDict({"student": nn.Linear(4, 4), "teacher": teacher})
        >>> shared_parameters(teacher, holder)                          # holding the teacher whole is not sharing
        []
    """
    by_id: dict[int, str] = {}
    by_storage: dict[tuple[Any, ...], str] = {}
    for name, p in teacher.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), name)
        key = _storage_key(p)
        if key is not None:
            by_storage.setdefault(key, name)
    held = [path + "." for path in _paths_of(student, teacher) if path]  # the teacher's own subtree(s) in the student
    found: dict[int, tuple[str, str]] = {}
    for path, module in student.named_modules(remove_duplicate=False):
        if module is teacher or any((path + ".").startswith(h) for h in held):
            continue
        for name, p in module.named_parameters(recurse=False):
            full = f"{path}.{name}" if path else name
            match = by_id.get(id(p))
            if match is None:
                key = _storage_key(p)
                match = by_storage.get(key) if key is not None else None
            if match is not None:
                found.setdefault(id(p), (match, full))
    return list(found.values())


def _shared_modules(teacher: nn.Module, student: nn.Module) -> list[tuple[str, str]]:
    """``(teacher path, student path)`` of the outermost modules the two hold by reference (not the teacher itself)."""
    teacher_paths = {id(m): name for name, m in teacher.named_modules() if name}
    found: list[tuple[str, str]] = []
    for path, module in student.named_modules(remove_duplicate=False):
        if module is teacher or not path or any(path.startswith(s + ".") for _, s in found):
            continue
        if id(module) in teacher_paths:
            found.append((teacher_paths[id(module)], path))
    return found


def check_separate(teacher: nn.Module, student: nn.Module) -> None:
    """Refuse a teacher that is not apart from the student: the student itself, or one that shares parameters with
    it (:func:`shared_parameters`), before the teacher is frozen. A teacher the student holds whole (a
    LightningModule attribute) is apart.

    Raises:
        ValueError: naming the shared modules or parameters and how to give the student its own copy.

    Example:
        >>> teacher = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4))
        >>> check_separate(teacher, nn.Sequential(teacher[0], nn.Linear(4, 2)))
        Traceback (most recent call last):
        ...
        ValueError: The teacher and the student share 1 parameter(s): the student's submodule '0' is the teacher's \
'0' (the same module object). Freezing the teacher would freeze them in the student too, and training the student \
would change the teacher. Give the student its own copy, e.g. `student.<path> = copy.deepcopy(teacher.<path>)`, or \
copy the weights into a module of its own with `load_state_dict(teacher.<path>.state_dict())`.
    """
    if teacher is student:
        raise ValueError("The teacher is the student module itself; pass a separate (e.g. copied) teacher, or "
                         "AdaptersOff() to use the student with its adapters switched off.")
    shared = shared_parameters(teacher, student)
    if not shared:
        return
    modules = _shared_modules(teacher, student)
    if modules:
        listed = ", ".join(f"the student's submodule {s!r} is the teacher's {t!r}" for t, s in modules[:3])
        what = f"{listed}{', ...' if len(modules) > 3 else ''} (the same module object)"
    else:
        listed = ", ".join(f"the student's {s!r} is the teacher's {t!r}" for t, s in shared[:3])
        what = f"{listed}{', ...' if len(shared) > 3 else ''} (the same parameter or storage)"
    raise ValueError(
        f"The teacher and the student share {len(shared)} parameter(s): {what}. Freezing the teacher would freeze "
        "them in the student too, and training the student would change the teacher. Give the student its own copy, "
        "e.g. `student.<path> = copy.deepcopy(teacher.<path>)`, or copy the weights into a module of its own with "
        "`load_state_dict(teacher.<path>.state_dict())`."
    )


class TeacherForwardError(RuntimeError):
    """The teacher's forward pass raised on a batch. The message names the original error; when ``explained`` (the
    cause is known, e.g. token ids outside the teacher's vocabulary) it also says what to change, and the original
    traceback is left out.

    Example:
        >>> TeacherForwardError("The teacher's forward failed on this batch (...)", explained=True).explained
        True
    """

    def __init__(self, message: str, *, explained: bool = False) -> None:
        super().__init__(message)
        self.explained = explained


def _package_dirs() -> tuple[str, ...]:
    import streamkl

    return tuple(str(Path(f).resolve().parent) + os.sep for f in (streamkl.__file__, __file__))


def _own_frame(err: BaseException) -> bool:
    """True when ``err`` was raised by this package or the op (a check of ours, e.g. a refused layer)."""
    tb = traceback.extract_tb(err.__traceback__)
    return bool(tb) and str(Path(tb[-1].filename).resolve()).startswith(_PACKAGE_DIRS)


_PACKAGE_DIRS = _package_dirs()


def _token_ids(data: Any) -> torch.Tensor | None:
    """The integer token ids a batch (or a recorded call's arguments) feeds a model, if any: ``input_ids`` of a
    mapping, else the first integer tensor of a tuple/list, else the batch itself when it is one."""
    if isinstance(data, torch.Tensor):
        return data if not data.is_floating_point() and not data.is_complex() and data.dtype != torch.bool else None
    if isinstance(data, Mapping):
        return _token_ids(data.get("input_ids")) if "input_ids" in data else None
    if isinstance(data, (tuple, list)) and data:
        return _token_ids(data[0])
    return None


def _input_embedding(model: nn.Module) -> nn.Embedding | None:
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            emb = get()
        except (NotImplementedError, AttributeError):
            emb = None
        if isinstance(emb, nn.Embedding):
            return emb
    return next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)


def teacher_failed(err: Exception, teacher: nn.Module, inputs: Any) -> Exception:
    """The error to raise when the teacher's forward pass raised ``err`` on ``inputs``: ``err`` itself when our own
    code raised it (a refused layer, a config check) or the device ran out of memory, else a
    :class:`TeacherForwardError` that says it was the teacher and, when the token ids fall outside the teacher's
    input embedding, their range and the vocabulary size.

    Example:
        >>> teacher = nn.Sequential(nn.Embedding(10, 4))
        >>> ids = torch.tensor([[1, 12]])
        >>> try:
        ...     teacher(ids)
        ... except IndexError as err:
        ...     print(teacher_failed(err, teacher, {"input_ids": ids}))
        The teacher's forward failed on this batch (IndexError: index out of range in self): the batch's token ids \
range over [1, 12], but the teacher's vocabulary has 10 tokens (its input embedding is Embedding(10, 4)). Teacher \
and student must share one tokenizer, or map the ids for the teacher in `teacher_forward`.
    """
    if _own_frame(err) or isinstance(err, torch.OutOfMemoryError):
        return err
    cause = f"{type(err).__name__}: {err}"
    ids, embedding = _token_ids(inputs), _input_embedding(teacher)
    if ids is not None and ids.numel() and embedding is not None:
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= embedding.num_embeddings:
            return TeacherForwardError(
                f"The teacher's forward failed on this batch ({cause}): the batch's token ids range over [{low}, "
                f"{high}], but the teacher's vocabulary has {embedding.num_embeddings} tokens (its input embedding is "
                f"{embedding}). Teacher and student must share one tokenizer, or map the ids for the teacher in "
                "`teacher_forward`.", explained=True
            )
    return TeacherForwardError(
        f"The teacher's forward failed on this batch ({cause}); the traceback above shows where. It ran "
        f"{type(teacher).__name__} on what `teacher_forward` gives it (default: the batch's keys its forward names); "
        "pass a `teacher_forward` to feed it differently."
    )


class FrozenTeacher:
    """A teacher module, frozen (``eval()``, no gradients) and placed for each forward pass.

    Args:
        source: the module, or a Hugging Face model name/path (loaded by :func:`load_teacher` in :meth:`prepare`).
        dtype: ``"auto"`` or ``None`` keeps the teacher's own dtype; ``"float32"``, ``"float16"``,
            ``"bfloat16"``, ``"float64"`` casts it (every floating-point tensor, checked each pass).
        device: ``"student"`` (moved to the device each pass asks for), ``"keep"`` (left where it is),
            ``"offload"`` (kept in host memory, pinned when CUDA is available, and streamed to the device each pass
            asks for one block at a time: :func:`streamed`) or a device name (moved there). A model spread with
            ``device_map`` (``hf_device_map``) is always kept.
        from_pretrained: keyword arguments for loading by name.

    :meth:`shard` shards it instead over the processes of a data-parallel group (FSDP2), in place.

    Example:
        >>> teacher = FrozenTeacher(nn.Linear(2, 2), dtype="float64")
        >>> module = teacher.prepare()
        >>> with teacher.placed(torch.device("cpu")) as device:
        ...     out = module(torch.ones(1, 2, dtype=torch.float64, device=device))
        >>> out.dtype, module.training, module.weight.requires_grad
        (torch.float64, False, False)
    """

    def __init__(self, source: nn.Module | str, *, dtype: str | None = "auto", device: str = "student",
                 from_pretrained: Mapping[str, Any] | None = None) -> None:
        if not isinstance(source, (nn.Module, str)):
            load_teacher(source)  # raises the TypeError
        self.source = source
        self.dtype = None if dtype in (None, "auto") else DTYPES[dtype]
        self.device = device
        self.from_pretrained = dict(from_pretrained or {})
        self.module: nn.Module | None = None
        #: The number of processes the teacher is sharded over (1: whole), by :meth:`shard` or by the user.
        self.shards = 1
        self._fsdp: bool | None = None  # whether the module holds FSDP2 modules (looked up once: :meth:`sharded`)
        self._tensor_list: tuple[nn.Module, list[torch.Tensor]] | None = None  # (:meth:`_listed_tensors`)

    def prepare(self, student: nn.Module | None = None) -> nn.Module:
        """Load (once), check and freeze the teacher; returns the module. Given the ``student``, first check that
        the two are apart (:func:`check_separate`: not the same module, no shared parameters), so that freezing the
        teacher cannot freeze part of the student.

        Raises:
            ValueError: a teacher with parameters or buffers on the meta device (no data), or one that is the
                student or shares parameters with it.
            FileNotFoundError: a teacher path that names no directory (:func:`check_teacher_path`).

        Example:
            >>> teacher = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4))
            >>> student = nn.Sequential(teacher[0], nn.Linear(4, 2))
            >>> FrozenTeacher(teacher).prepare(student)
            Traceback (most recent call last):
            ...
            ValueError: The teacher and the student share 1 parameter(s): ...
            >>> student[0].weight.requires_grad                 # refused before anything was frozen
            True
        """
        module = self.module if self.module is not None else self.source
        if student is not None and isinstance(module, nn.Module):
            check_separate(module, student)
        if self.module is not None:
            return self.module
        teacher = load_teacher(self.source, self.from_pretrained)
        on_meta = [name for name, t in (*teacher.named_parameters(), *teacher.named_buffers()) if t.is_meta]
        if on_meta:
            raise ValueError(
                f"The teacher has {len(on_meta)} parameters/buffers on the meta device (no data), e.g. {on_meta[0]!r}; "
                "load or materialise its weights (e.g. `to_empty()` then `load_state_dict()`) before training."
            )
        teacher.eval()
        teacher.requires_grad_(False)
        if self.offload and is_sharded(teacher):  # before any move: a DTensor cannot be moved or pinned as a whole
            self.module = teacher
            self._check_placement("pass the teacher unsharded")
        if self.offload:
            teacher.to("cpu")
            _keep_on_host(teacher, self.dtype)
        self.module = teacher
        return teacher

    def shard(self, mesh: Any) -> nn.Module:
        """Shard the (prepared, frozen) teacher over ``mesh``, a 1-D ``DeviceMesh`` of the data-parallel processes,
        with FSDP2 (:func:`shard_module`); cast to ``dtype`` first. Idempotent, and a teacher the user sharded with
        ``fully_shard`` already is left as it is (:meth:`sharded`).

        Raises:
            ValueError: with ``device="offload"`` or a named device, or a model spread with ``device_map`` (a sharded
                teacher lives on each process's own device), or a mesh that is not 1-D.
        """
        module = self.prepare()
        if self.sharded():
            return module
        self._check_placement("teacher_sharding='replicate'")
        if getattr(mesh, "ndim", 1) != 1:
            raise ValueError(f"Expected a 1-D device mesh to shard the teacher over, but got {mesh}.")
        if self.dtype is not None:
            module.to(dtype=self.dtype)
        shard_module(module, mesh)
        self.shards = int(mesh.size())
        self._fsdp = True
        return module

    def sharded(self) -> bool:
        """True when the teacher holds FSDP2 modules: sharded by :meth:`shard`, or by the user (``fully_shard``)
        before passing it. Looked up once, at the first call. A teacher sharded by the user then has :attr:`shards`
        read from its parameters' mesh, and is set to reshard after every forward pass, its root included (FSDP2 keeps
        the root's parameters gathered for the backward by default; a frozen teacher has none): each pass gathers one
        block at a time, and frees what it gathered also when it stops early (:meth:`placed`).

        Raises:
            ValueError: a teacher sharded by the user, with ``device="offload"``, a named device or a ``device_map``.

        Example:
            >>> FrozenTeacher(nn.Linear(2, 2)).sharded()
            False
        """
        if self._fsdp is None:
            module = self.prepare()
            self._fsdp = is_sharded(module)
            if self._fsdp:
                self._check_placement("pass the teacher unsharded")
                self.shards = shard_count(module)
                _reshard_after_forward(module)
        return self._fsdp

    def _check_placement(self, alternative: str) -> None:
        if self.spread or self.device not in ("student", "keep"):
            what = "a device_map" if self.spread and not self.offload else f"teacher_device={self.device!r}"
            raise ValueError(
                f"A sharded teacher lives on each process's own device, which {what} contradicts; use "
                f"teacher_device='student' (the default), or {alternative}."
            )

    def _listed_tensors(self, module: nn.Module) -> list[torch.Tensor]:
        """The module's parameters and buffers, listed once and again after each move: walking a BERT-base
        teacher's modules cost milliseconds of host time per pass. A move by someone else shows on the listed
        parameters (``to`` keeps them) or on the old buffers (left where they were), either way as misplaced."""
        if self._tensor_list is None or self._tensor_list[0] is not module:
            self._tensor_list = (module, list(_tensors(module)))
        return self._tensor_list[1]

    @property
    def offload(self) -> bool:
        """True for ``device="offload"``: kept in host memory, streamed to the device one block at a time."""
        return self.device == "offload"

    @property
    def spread(self) -> bool:
        """True for a model dispatched over devices with ``device_map`` (never moved)."""
        return bool(getattr(self.module, "hf_device_map", None))

    @contextmanager
    def placed(self, device: torch.device, *, up_to: Iterable[nn.Module] | None = None) -> Iterator[torch.device]:
        """Place the teacher for one forward pass toward ``device`` (the student's); yields the device its inputs
        go to. Cheap when it is already in place: every tensor is checked, so a teacher partly elsewhere (or
        partly cast) is moved whole. An offloaded teacher is streamed (:func:`streamed`); ``up_to``, the modules the
        pass stops after (an early exit), keeps it from copying ahead blocks that will not run."""
        module = self.prepare()
        if self.sharded():  # each process's shards already live on its device
            try:
                yield _input_device(module, device)
            finally:
                reshard(module)
            return
        if self.offload:
            with streamed(module, device, self.dtype, up_to=up_to):
                yield device
            return
        target = None if self.device == "keep" or self.spread else device if self.device == "student" \
            else torch.device(self.device)
        tensors = self._listed_tensors(module)
        misplaced = target is not None and any(t.device != target for t in tensors)
        miscast = self.dtype is not None and any(t.is_floating_point() and t.dtype != self.dtype for t in tensors)
        if misplaced or miscast:
            module.to(device=target, dtype=self.dtype)
            self._tensor_list = None  # `to` replaces the buffers (and, under a torch flag, the parameters)
        if module.training:
            module.eval()
        yield target if target is not None else _input_device(module, device)


def _reshard_after_forward(module: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_reshard_after_forward(True, recurse=False)


def _input_device(module: nn.Module, fallback: torch.device) -> torch.device:
    for t in _tensors(module):
        return t.device
    return fallback


def _keep_on_host(module: nn.Module, dtype: torch.dtype | None) -> None:
    """Ready the host copy of an offloaded teacher: each floating-point tensor wider than ``dtype`` cast to it once
    (each pass then copies half the bytes of an fp32 checkpoint run in bf16; a narrower tensor stays as it is and is
    cast on the device, so the copy never grows), and every tensor pinned when CUDA is available (copies that overlap
    the teacher's compute)."""
    pin = torch.cuda.is_available()
    for t in _tensors(module):
        if dtype is not None and t.is_floating_point() and t.element_size() > dtype.itemsize:
            t.data = t.data.to(dtype)
        if pin and t.device.type == "cpu" and not t.is_pinned():
            t.data = t.data.pin_memory()


# ------------------------------------------------------------------------------------------ the student as teacher
class AdaptersOff:
    """A teacher that is the student itself with its adapters (LoRA, ...) switched off: the base model, for free.

    Pass it where a teacher goes (``StreamKLDistillation(AdaptersOff(), pairs=...)``,
    ``AttentionDistiller(AdaptersOff(), config)``, the mixin). At each step the student's adapter-carrying
    submodule runs once more, under ``no_grad``, in ``eval()`` mode, inside its ``disable_adapter()`` context (PEFT's
    ``PeftModel``; ``disable_adapters()``/``enable_adapters()`` of a transformers model with adapters loaded also
    work): no copy of the weights is made, and the student is left as it was (adapters on, training mode, gradients).
    Importing this class never imports peft.

    Args:
        module: the path of the submodule of the student (the LightningModule, or the module given to the engine)
            that carries the adapters; ``None`` finds it: the outermost submodule with a ``disable_adapter()``
            context manager, else with ``disable_adapters()``/``enable_adapters()`` methods.

    Example:
        >>> AdaptersOff("model")
        AdaptersOff(module='model')
        >>> AdaptersOff(3)
        Traceback (most recent call last):
        ...
        TypeError: Expected `module` to be a submodule path (str) or None, but got 3.
    """

    def __init__(self, module: str | None = None) -> None:
        if module is not None and not isinstance(module, str):
            raise TypeError(f"Expected `module` to be a submodule path (str) or None, but got {module!r}.")
        self.module = module

    def __repr__(self) -> str:
        return f"AdaptersOff(module={self.module!r})"


def _switchable(module: nn.Module) -> bool:
    if callable(getattr(module, "disable_adapter", None)):
        return True
    if not getattr(module, "_hf_peft_config_loaded", True):  # a transformers model has the methods, maybe no adapter
        return False
    return callable(getattr(module, "disable_adapters", None)) and callable(getattr(module, "enable_adapters", None))


def find_adapter_module(student: nn.Module, path: str | None = None) -> str:
    """The path of the submodule of ``student`` whose adapters can be switched off (``""``: ``student`` itself).

    Raises:
        ValueError: ``path`` is not a submodule of ``student`` or cannot switch adapters off, or (``path=None``) no
            submodule can.

    Example:
        >>> class Peft(nn.Module):                      # what PEFT's PeftModel offers
        ...     def disable_adapter(self): ...
        >>> find_adapter_module(nn.Sequential(nn.Linear(1, 1), Peft()))
        '1'
        >>> find_adapter_module(nn.Linear(1, 1))
        Traceback (most recent call last):
        ...
        ValueError: AdaptersOff: no submodule of Linear can switch its adapters off (PEFT's `disable_adapter()`, or \
`disable_adapters()`/`enable_adapters()`); wrap the model with peft.get_peft_model(...) first.
    """
    if path is not None:
        try:
            module = student.get_submodule(path)
        except AttributeError:
            raise ValueError(f"Expected AdaptersOff(module={path!r}) to name a submodule of {type(student).__name__}, "
                             "but it has none of that name.") from None
        if not _switchable(module):
            raise ValueError(
                f"Expected AdaptersOff(module={path!r}) to be a module whose adapters can be switched off (PEFT's "
                f"`disable_adapter()`, or `disable_adapters()`/`enable_adapters()`), but {type(module).__name__} has "
                "neither."
            )
        return path
    for name, module in student.named_modules():
        if _switchable(module):
            return name
    raise ValueError(
        f"AdaptersOff: no submodule of {type(student).__name__} can switch its adapters off (PEFT's "
        "`disable_adapter()`, or `disable_adapters()`/`enable_adapters()`); wrap the model with "
        "peft.get_peft_model(...) first."
    )


@contextmanager
def adapters_disabled(module: nn.Module) -> Iterator[None]:
    """Run ``module`` with its adapters off inside the block (PEFT's ``disable_adapter()``, else
    ``disable_adapters()``/``enable_adapters()``); they are back on afterwards, also when the block raises.

    Example:
        >>> class Toggle(nn.Module):
        ...     on = True
        ...     def disable_adapters(self): self.on = False
        ...     def enable_adapters(self): self.on = True
        >>> m = Toggle()
        >>> with adapters_disabled(m):
        ...     m.on
        False
        >>> m.on
        True
    """
    disable = getattr(module, "disable_adapter", None)
    if callable(disable):
        with disable():
            yield
        return
    module.disable_adapters()
    try:
        yield
    finally:
        module.enable_adapters()


class SelfTeacher:
    """The teacher of :class:`AdaptersOff`: a submodule of the student run with its adapters off; the same
    interface as :class:`FrozenTeacher` (:meth:`prepare`, :meth:`placed`, :attr:`module`).

    Nothing is frozen, copied, moved or cast: for each teacher pass (the engine runs it under ``no_grad``) the
    module is put in ``eval()`` mode with its adapters off, and every submodule's training flag is restored
    afterwards.

    Args:
        spec: the :class:`AdaptersOff` marker.

    Example:
        >>> class Toggle(nn.Linear):
        ...     on = True
        ...     def disable_adapters(self): self.on = False
        ...     def enable_adapters(self): self.on = True
        >>> student = nn.Sequential(Toggle(2, 2))
        >>> teacher = SelfTeacher(AdaptersOff())
        >>> teacher.bind(student)
        '0'
        >>> with teacher.placed(torch.device("cpu")):
        ...     student[0].on, student[0].training
        (False, False)
        >>> student[0].on, student[0].training, student[0].weight.requires_grad
        (True, True, True)
    """

    #: Never sharded on its own: it is the student, laid out by the strategy.
    shards = 1

    def __init__(self, spec: AdaptersOff) -> None:
        self.spec = spec
        self.path: str | None = None
        self.module: nn.Module | None = None

    def bind(self, student: nn.Module) -> str:
        """Find the adapter-carrying submodule of ``student``; returns its path (``""``: the student itself)."""
        self.path = find_adapter_module(student, self.spec.module)
        self.module = student.get_submodule(self.path) if self.path else student
        return self.path

    def prepare(self) -> nn.Module:
        """The bound module.

        Raises:
            RuntimeError: :meth:`bind` has not run (the student is not known yet).
        """
        if self.module is None:
            raise RuntimeError("AdaptersOff: the teacher is the student with its adapters off, so it exists only once "
                               "the student is known; call AttentionDistiller.setup(student) first.")
        return self.module

    @property
    def spread(self) -> bool:
        """Never moved (it is the student)."""
        return True

    @contextmanager
    def placed(self, device: torch.device, *, up_to: Iterable[nn.Module] | None = None) -> Iterator[torch.device]:
        """Adapters off and ``eval()`` inside the block; yields the device of the module's first tensor (``up_to``
        is :meth:`FrozenTeacher.placed`'s, unused: the student is never moved)."""
        module = self.prepare()
        modes = [(m, m.training) for m in module.modules()]
        module.eval()
        try:
            with adapters_disabled(module):
                yield _input_device(module, device)
        finally:
            for m, mode in modes:
                m.training = mode
