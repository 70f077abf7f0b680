r"""
StreamKL distillation
^^^^^^^^^^^^^^^^^^^^^

Attention distillation as one callback: a frozen teacher runs on every batch, the queries and keys of the
configured teacher and student layers are captured, and the weighted sum of per-pair
:func:`streamkl.attention_kl` terms is added to the loss that ``training_step`` returns. No attention map is
ever materialised.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import nn
from typing_extensions import override

from . import _hooks
from ._distiller import Distiller
from .config import LayerPair, StreamKLConfig, load_config, validate_config
from .metrics import AttentionKLDivergence

log = logging.getLogger(__name__)

_STATE_VERSION = 2  # 2: the training metric's epoch-so-far state


class StreamKLDistillation(Callback):
    r"""Add attention-KL distillation terms to a LightningModule's training loss, with no change to the module.

    On every training batch the callback runs the teacher (frozen: ``eval()``, no grad, moved to the student's
    device and dtype) on the same batch, captures ``(q, k)`` at the paired teacher and student layers, and adds

    .. math::

        \mathrm{weight} \cdot \mathrm{ramp}(t) \cdot \sum_p w_p \, \overline{\mathrm{KL}}_p

    to the loss returned by ``training_step`` (a tensor, or the ``"loss"`` entry of a dict; ``None`` skips the
    batch), where :math:`\overline{\mathrm{KL}}_p` is the mean over non-padded query rows and heads of
    :func:`streamkl.attention_kl` for pair :math:`p`, and :math:`\mathrm{ramp}` the optional linear warm-up.

    How the loss is changed: callback hooks cannot change the loss, so in ``setup`` the callback shadows the
    module's ``training_step`` (and ``validation_step``) with an instance attribute that wraps the original
    and restores it in ``teardown``. The term is part of the value ``training_step`` returns, so gradient
    accumulation, 16-mixed loss scaling, bf16-mixed autocast and DDP all see one loss and one backward.
    Validation batches log the KL but leave the returned value alone.

    Logs (``<name>`` is the config's ``name``, default ``attn_kl``): ``train/<name>/<pair>`` and
    ``train/<name>/total`` (:math:`\sum_p w_p \overline{\mathrm{KL}}_p`) per step and, at epoch end, the
    row-weighted epoch values from :class:`~lightning_streamkl.AttentionKLDivergence` (synced across
    processes) under the same keys; ``val/<name>/...`` at the end of each validation run.

    Args:
        teacher: the teacher: any ``nn.Module`` (a Hugging Face model, a LightningModule, ...), or the name or
            local path of a Hugging Face model (loaded with ``AutoModel.from_pretrained``).
        pairs: the layer pairs: :class:`~lightning_streamkl.LayerPair` objects, mappings with its fields, or
            ``[teacher, student]`` lists. Layers are module paths (the student's relative to the
            LightningModule) or indices into each model's attention layers (negative from the end).
        weight, warmup_steps, temperature, direction, causal, head_map, teacher_capture, student_capture,
        teacher_dtype, mask_key, mask_queries, validation, log_on_step, prog_bar, name, backend:
            see :class:`~lightning_streamkl.StreamKLConfig`.
        teacher_forward: ``fn(teacher, batch)`` that runs the teacher; default: mapping batches pass the keys
            the teacher's ``forward`` names (except ``labels``), tuple batches pass ``batch[0]``. Subclasses can
            override :meth:`teacher_forward` instead.

    Attributes:
        config: the validated :class:`~lightning_streamkl.StreamKLConfig`.
        train_metric: the training :class:`~lightning_streamkl.AttentionKLDivergence` (reset every epoch).
        val_metric: the validation one.

    Raises:
        TypeError: a config value of the wrong type, or a teacher that is neither a module nor a string.
        ValueError: a bad config value or key (the message names it), or, in ``setup``, an unknown layer
            (the message lists the closest layer names).
        MisconfigurationException: in ``setup``, an unsupported strategy (FSDP, DeepSpeed, model parallel),
            manual optimization, a ``dataloader_iter`` training step, or two instances with the same ``name``.

    Example::

        >>> from lightning_streamkl import StreamKLDistillation
        >>> from torch import nn
        >>> teacher = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, batch_first=True), 2,
        ...                                 enable_nested_tensor=False)
        >>> callback = StreamKLDistillation(teacher, pairs=[{"teacher": -1, "student": -1, "name": "last"}],
        ...                                 temperature=2.0)
        >>> callback.state_key
        "StreamKLDistillation{'name': 'attn_kl', 'pairs': ('last',)}"

        then ``Trainer(callbacks=[callback]).fit(student_module)``.

    .. tip:: The callback's ``state_dict`` (step counters, the pair names and the training metric's epoch-so-far
        sums, over all processes) is saved in checkpoints under :attr:`state_key`, so a run resumed with
        ``ckpt_path`` continues with the same warm-up step and logs the same epoch values; the
        teacher itself is not saved (it is frozen, pass it again). Give each instance its own ``name`` to use
        several at once (e.g. two teachers).
    """

    def __init__(
        self,
        teacher: nn.Module | str,
        pairs: Sequence[LayerPair | Mapping[str, Any] | Sequence[Any]],
        *,
        weight: float = 1.0,
        warmup_steps: int = 0,
        temperature: float = 1.0,
        direction: str = "forward",
        causal: bool | None = None,
        head_map: str = "error",
        teacher_capture: str = "auto",
        student_capture: str = "auto",
        teacher_dtype: str | None = "auto",
        mask_key: str | None = "attention_mask",
        mask_queries: bool = True,
        validation: bool = True,
        log_on_step: bool = True,
        prog_bar: bool = False,
        name: str = "attn_kl",
        backend: str = "auto",
        teacher_forward: Callable[[nn.Module, Any], Any] | None = None,
    ) -> None:
        super().__init__()
        options = {k: v for k, v in locals().items() if k not in ("self", "teacher", "teacher_forward", "__class__")}
        self._init(teacher, validate_config(options), teacher_forward)

    def _init(self, teacher: nn.Module | str, config: StreamKLConfig,
              teacher_forward: Callable[[nn.Module, Any], Any] | None) -> None:
        self.config = config
        forward = teacher_forward
        if forward is None and type(self).teacher_forward is not StreamKLDistillation.teacher_forward:
            forward = self.teacher_forward
        self._distiller = Distiller(teacher, config, forward, self.padding_mask)
        self.train_metric: AttentionKLDivergence = self._distiller.make_metric()
        self.val_metric: AttentionKLDivergence = self._distiller.make_metric()
        self._train_batches = 0
        self._val_batches = 0
        self._module: LightningModule | None = None
        self._wrapped: list[str] = []

    @classmethod
    def from_config(cls, teacher: nn.Module | str, config: StreamKLConfig | Mapping[str, Any] | str,
                    *, teacher_forward: Callable[[nn.Module, Any], Any] | None = None) -> StreamKLDistillation:
        """Build from a :class:`~lightning_streamkl.StreamKLConfig`, a mapping, or a YAML path/text.

        Example:
            >>> from torch import nn
            >>> cb = StreamKLDistillation.from_config(nn.MultiheadAttention(8, 2), "pairs: [[0, 0]]\\nweight: 0.5")
            >>> cb.config.weight, cb.config.pairs[0].label
            (0.5, 't0_s0')
        """
        cfg = load_config(config) if isinstance(config, str) else validate_config(config)
        self = cls.__new__(cls)
        Callback.__init__(self)
        self._init(teacher, cfg, teacher_forward)
        return self

    # ------------------------------------------------------------------------------------------ overridables
    def teacher_forward(self, teacher: nn.Module, batch: Any) -> Any:
        """Run the teacher on ``batch`` (override in a subclass to feed it differently)."""
        from ._distiller import default_teacher_forward

        return default_teacher_forward(teacher, batch)

    def padding_mask(self, batch: Any) -> torch.Tensor | None:
        """The ``[B, N]`` bool padding mask (True = real token) of ``batch``; default: ``batch[mask_key]``."""
        from ._distiller import padding_mask_from_batch

        return padding_mask_from_batch(batch, self.config.mask_key)

    @property
    def teacher(self) -> nn.Module | None:
        """The (loaded, frozen) teacher module, once ``setup`` ran."""
        return self._distiller.teacher

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(name=self.config.name, pairs=tuple(self._distiller.loss.pair_names))

    # ------------------------------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage not in ("fit", "validate"):
            return
        self._check_trainer(trainer, pl_module, stage)
        self._distiller.setup(pl_module)
        self._module = pl_module
        methods = [("training_step", "train")] if stage == "fit" else []
        if self.config.validation and stage in ("fit", "validate") and is_overridden("validation_step", pl_module):
            methods.append(("validation_step", "val"))
        for method, step_stage in methods:
            _hooks.install(pl_module, method, step_stage, self)
            self._wrapped.append(method)
        rank_zero_info(
            f"StreamKL {self.config.name!r}: distilling {len(self._distiller.resolved)} layer pair(s): "
            + ", ".join(f"{t} -> {s}" for t, s in self._distiller.resolved)
        )

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for method in self._wrapped:
            _hooks.uninstall(pl_module, method, self)
        self._wrapped = []
        self._distiller.clear()
        self._module = None

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # a run that raises skips `teardown`: restore the module's step methods anyway, so the module can be trained
        # again (with or without this callback) after the crash
        self.teardown(trainer, pl_module, trainer.state.fn or "fit")

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._log_epoch(pl_module, self.train_metric, "train")

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._log_epoch(pl_module, self.val_metric, "val")

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "name": self.config.name,
            "pairs": list(self._distiller.loss.pair_names),
            "train_batches": self._train_batches,
            "val_batches": self._val_batches,
            "train_metric": metric_state(self.train_metric, getattr(self._module, "_trainer", None)),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._train_batches = int(state_dict.get("train_batches", 0))
        self._val_batches = int(state_dict.get("val_batches", 0))
        saved = state_dict.get("pairs")
        if saved is not None and list(saved) != list(self._distiller.loss.pair_names):
            rank_zero_warn(
                f"StreamKL {self.config.name!r}: the checkpoint was written with pairs {list(saved)}, this run "
                f"distils {self._distiller.loss.pair_names}."
            )
        elif state_dict.get("train_metric") is not None:
            load_metric_state(self.train_metric, state_dict["train_metric"], getattr(self._module, "_trainer", None))

    # ------------------------------------------------------------------------------------------ internals
    def _check_trainer(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        check_trainer(self, trainer, pl_module, stage, alternative="AttentionDistillationMixin")

    def _step_begin(self, stage: str, batch: Any) -> bool:
        module = self._module
        assert module is not None
        if stage == "val" and (module.trainer.sanity_checking or not self.config.validation):
            return False
        self._distiller.place_teacher(module.device, module)
        self._distiller.run_teacher(batch)
        return True

    def _student_recording(self) -> AbstractContextManager[None]:
        return self._distiller.student_recording()

    def _step_end(self, stage: str, batch: Any, output: Any) -> Any:
        module = self._module
        assert module is not None
        if output is None and stage == "train":
            return output  # the user skipped this batch
        terms = self._distiller.compute(batch)
        metric = self.train_metric if stage == "train" else self.val_metric
        metric.to(terms.rows.device)
        metric.update(terms.kl_sums, terms.rows)
        if stage == "train":
            self._train_batches += 1
            scale = self._distiller.weight_at(module.trainer.global_step)
            output = _add_to_loss(output, terms.total * scale)
            if self.config.log_on_step:
                name = self.config.name
                values = {f"train/{name}/{k}": v.detach() for k, v in terms.per_pair.items()}
                module.log_dict(values, on_step=True, on_epoch=False)
                module.log(f"train/{name}/total", terms.total.detach(), on_step=True, on_epoch=False,
                           prog_bar=self.config.prog_bar)
        else:
            self._val_batches += 1
        return output

    def _step_cleanup(self) -> None:
        self._distiller.clear()

    def _log_epoch(self, pl_module: LightningModule, metric: AttentionKLDivergence, stage: str) -> None:
        log_epoch(pl_module, metric, stage, prog_bar=self.config.prog_bar)


def check_trainer(callback: Callback, trainer: Trainer, pl_module: LightningModule, stage: str, *,
                  alternative: str | None = None) -> None:
    """The checks every loss-adding StreamKL callback makes in ``setup`` (``callback.config.name`` is its name).

    ``alternative`` is named in the manual-optimization and ``dataloader_iter`` messages as what to use instead.
    """
    who = type(callback).__name__
    strategy = type(trainer.strategy).__name__
    unsupported = ("FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy", "XLAFSDPStrategy")
    if any(cls.__name__ in unsupported for cls in type(trainer.strategy).__mro__):
        raise MisconfigurationException(
            f"{who} does not support the {strategy} strategy (the teacher is not sharded and the "
            "captured queries/keys of sharded layers are untested); use 'ddp' or a single device."
        )
    if stage == "fit" and not pl_module.automatic_optimization:
        hint = (f"; with `automatic_optimization = False` use {alternative} and add "
                "`self.attention_distillation_loss()` to the loss you backpropagate") if alternative else ""
        raise MisconfigurationException(
            f"{who} adds its term to the loss returned by training_step, which manual optimization ignores{hint}."
        )
    if stage == "fit" and is_param_in_hook_signature(pl_module.training_step, "dataloader_iter", explicit=True):
        hint = f" Use {alternative} instead." if alternative else ""
        raise MisconfigurationException(
            f"{who} needs the batch passed to training_step; a `dataloader_iter` training_step hides it.{hint}"
        )
    name = callback.config.name
    for method in ("training_step", "validation_step"):
        for other in _hooks.runners(pl_module, method):
            other_config = getattr(other, "config", None)
            if other is not callback and other_config is not None and other_config.name == name:
                kinds = who if type(other) is type(callback) else f"{type(other).__name__} and {who}"
                raise MisconfigurationException(
                    f"Two {kinds} callbacks use the name {name!r}; their logs and checkpoint state would collide. "
                    "Give each a distinct `name`."
                )


def log_epoch(pl_module: LightningModule, metric: AttentionKLDivergence, stage: str, *, prog_bar: bool) -> None:
    """Log ``metric``'s epoch values under ``<stage>/...`` (synced across processes) and reset it."""
    if metric.update_count == 0:
        return
    values = {f"{stage}/{k}": v for k, v in metric.compute().items()}
    pl_module.log_dict(values, on_step=False, on_epoch=True, sync_dist=True, prog_bar=prog_bar and stage == "val")
    metric.reset()


def metric_state(metric: AttentionKLDivergence, trainer: Trainer | None) -> dict[str, Any]:
    """The epoch-so-far state of ``metric`` for a checkpoint, summed over processes.

    Under DDP every process calls ``state_dict`` while a checkpoint is written (Lightning's ``save_checkpoint``
    must run on all of them), so the sum is one collective; the checkpoint then holds the whole group's state.
    """
    state = torch.stack([metric.kl_sum, metric.rows]).detach()
    updates = int(metric.update_count)
    if trainer is not None and trainer.training and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
        # written after the epoch's last batch but before its end hooks: a run resumed from here starts the next
        # epoch (Lightning does not run the rest of this one), so nothing of this epoch may be carried over
        state, updates = torch.zeros_like(state), 0
    if trainer is not None and trainer.world_size > 1:
        state = trainer.strategy.reduce(state.to(trainer.strategy.root_device), reduce_op="sum")
    return {"kl_sum": state[0].cpu(), "rows": state[1].cpu(), "updates": updates}


def load_metric_state(metric: AttentionKLDivergence, state: Mapping[str, Any], trainer: Trainer | None) -> None:
    """Restore what :func:`metric_state` saved: global rank 0 takes the group's sums, the other ranks start from 0,
    so the synced value over the rest of the epoch is the uninterrupted run's."""
    kl_sum, rows = state["kl_sum"], state["rows"]
    if tuple(kl_sum.shape) != tuple(metric.kl_sum.shape):
        return
    metric.reset()
    rank = trainer.global_rank if trainer is not None else 0
    if rank == 0:
        metric.kl_sum = kl_sum.to(metric.kl_sum)
        metric.rows = rows.to(metric.rows)
    metric._update_count = int(state.get("updates", 0))  # non-zero on every rank: all of them log the epoch


def _add_to_loss(output: Any, term: torch.Tensor, who: str = "StreamKLDistillation") -> Any:
    if isinstance(output, torch.Tensor):
        return output + term
    if isinstance(output, Mapping) and "loss" in output:
        return {**output, "loss": output["loss"] + term}
    what = "a mapping without a 'loss' key" if isinstance(output, Mapping) else type(output).__name__
    raise MisconfigurationException(
        f"{who} adds its term to the loss returned by training_step, but it returned {what}; "
        "return the loss tensor or a dict with a 'loss' entry."
    )
