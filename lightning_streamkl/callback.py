r"""
StreamKL distillation
^^^^^^^^^^^^^^^^^^^^^

Attention distillation as one callback: a frozen teacher runs on every batch, the queries and keys of the
configured teacher and student layers are captured, and the weighted sum of per-pair
:func:`streamkl.attention_kl` terms is added to the loss that ``training_step`` returns. No attention map is
ever materialised. The callback is a thin Lightning adapter over :class:`~lightning_streamkl.engine.AttentionDistiller`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from .adapter import EngineCallback, LossTermCallback
from .config import LayerPair, StreamKLConfig, load_config, validate_config
from .engine import AttentionDistiller, default_teacher_forward, padding_mask_from_batch
from .loss import LossOutput
from .options import signature_from_fields
from .teacher import AdaptersOff

__all__ = ["StreamKLDistillation"]

_STATE_VERSION = 2  # 2: the training metric's epoch-so-far state


class StreamKLDistillation(EngineCallback):
    r"""Add attention-KL distillation terms to a LightningModule's training loss, with no change to the module.

    On every training batch the callback runs the teacher (frozen: ``eval()``, no grad, on the student's device
    unless ``teacher_device`` says otherwise, stopping after the deepest paired layer) on the same batch, captures
    ``(q, k)`` at the paired teacher and student layers, and adds

    .. math::

        \mathrm{weight} \cdot \mathrm{ramp}(t) \cdot \sum_p w_p \, \overline{\mathrm{KL}}_p

    to the loss returned by ``training_step`` (a tensor, or the ``"loss"`` entry of a dict; ``None`` skips the
    batch), where :math:`\overline{\mathrm{KL}}_p` is the mean over non-padded query rows and heads of
    :func:`streamkl.attention_kl` for pair :math:`p`, and :math:`\mathrm{ramp}` the optional linear warm-up.

    How the loss is changed: callback hooks cannot change the loss, so in ``setup`` the callback shadows the
    module's ``training_step`` (and ``validation_step``) with an instance attribute that wraps the original
    and restores it in ``teardown`` (:class:`~lightning_streamkl.adapter.LossTermCallback`). The term is part of
    the value ``training_step`` returns, so gradient accumulation, 16-mixed loss scaling, bf16-mixed autocast and
    DDP all see one loss and one backward. Validation batches log the KL but leave the returned value alone.

    Logs (``<name>`` is the config's ``name``, default ``attn_kl``): ``train/<name>/<pair>`` and
    ``train/<name>/total`` (:math:`\sum_p w_p \overline{\mathrm{KL}}_p`) per step and, at epoch end, the
    row-weighted epoch values from :class:`~lightning_streamkl.AttentionKLDivergence` (synced across
    processes) under the same keys; ``val/<name>/...`` at the end of each validation run.

    Args:
        teacher: the teacher: any ``nn.Module`` (a Hugging Face model, a LightningModule, ...), the name or
            local path of a Hugging Face model (loaded with ``AutoModel.from_pretrained``), or ``AdaptersOff()``,
            the student itself with its adapters (LoRA, ...) switched off (:class:`~lightning_streamkl.AdaptersOff`).
        pairs: the layer pairs: :class:`~lightning_streamkl.LayerPair` objects, mappings with its fields, or
            ``[teacher, student]`` lists. Layers are module paths (the student's relative to the
            LightningModule) or indices into each model's attention layers (negative from the end).
        options: every other field of :class:`~lightning_streamkl.StreamKLConfig` (``weight``, ``temperature``,
            ``direction``, ``teacher_dtype``, ``teacher_device``, ...), as keyword arguments; the signature lists
            them, derived from the config.
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
        MisconfigurationException: in ``setup``, an unsupported strategy (DeepSpeed, XLA's FSDP, tensor
            parallelism), manual optimization, a ``dataloader_iter`` training step, or two instances with the same
            ``name``.

    Under ``FSDPStrategy`` and ``ModelParallelStrategy`` (FSDP2 in ``configure_model``) the student is sharded as
    you configure it and the teacher is sharded over the same processes with FSDP2 (``teacher_sharding``); layer
    paths are the unwrapped model's. A module that overrides ``configure_model`` has its layers resolved when the
    fit (or validation) starts, after the model is built.

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

    alternative = "AttentionDistillationMixin"
    sharding = True
    describe_at_setup = False  # the engine logs the pairing line, with each pair's precision, after the first step
    state_version = _STATE_VERSION

    @signature_from_fields(StreamKLConfig, skip=("pairs",))
    def __init__(
        self,
        teacher: nn.Module | str | AdaptersOff,
        pairs: Sequence[LayerPair | Mapping[str, Any] | Sequence[Any]],
        *,
        teacher_forward: Callable[[nn.Module, Any], Any] | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        self._init(teacher, validate_config({**options, "pairs": pairs}), teacher_forward)

    def _init(self, teacher: nn.Module | str | AdaptersOff, config: StreamKLConfig,
              teacher_forward: Callable[[nn.Module, Any], Any] | None) -> None:
        self.config = config
        forward = teacher_forward
        if forward is None and type(self).teacher_forward is not StreamKLDistillation.teacher_forward:
            forward = self.teacher_forward
        self._distiller = AttentionDistiller(teacher, config, teacher_forward=forward, padding_mask=self.padding_mask)
        self._state = self._distiller.metrics()
        self._train_batches = 0
        self._val_batches = 0

    @classmethod
    def from_config(cls, teacher: nn.Module | str | AdaptersOff, config: StreamKLConfig | Mapping[str, Any] | str,
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
        LossTermCallback.__init__(self)
        self._init(teacher, cfg, teacher_forward)
        return self

    # ------------------------------------------------------------------------------------------ overridables
    def teacher_forward(self, teacher: nn.Module, batch: Any) -> Any:
        """Run the teacher on ``batch`` (override in a subclass to feed it differently)."""
        return default_teacher_forward(teacher, batch)

    def padding_mask(self, batch: Any) -> torch.Tensor | None:
        """The ``[B, N]`` bool padding mask (True = real token) of ``batch``; default: ``batch[mask_key]``."""
        return padding_mask_from_batch(batch, self.config.mask_key)

    # ------------------------------------------------------------------------------------------ public
    @property
    def teacher(self) -> nn.Module | None:
        """The (loaded, frozen) teacher module, once ``setup`` ran."""
        return self._distiller.teacher_module

    @property
    def distiller(self) -> AttentionDistiller:
        """The engine this callback adapts (teacher, captures, loss)."""
        return self._distiller

    # ------------------------------------------------------------------------------------------ the engine
    def _names(self) -> list[str]:
        return list(self._distiller.loss.pair_names)

    def _terms(self, stage: str, batch: Any, step: int) -> tuple[LossOutput, None]:
        return self._distiller.end_step(batch), None

    # ------------------------------------------------------------------------------------------ the step
    def _step_begin(self, stage: str, batch: Any) -> bool:
        if not self._takes_part(stage):
            return False
        self._distiller.begin_step(batch)
        return True

    def _student_recording(self) -> AbstractContextManager[None]:
        return self._distiller.student_recording()

