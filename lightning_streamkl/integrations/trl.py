r"""
Attention KL in TRL's trainers
^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^

:class:`AttentionKLMixin` adds the attention KL of :class:`~lightning_streamkl.engine.AttentionDistiller` to TRL's
trainers (``SFTTrainer``, with or without padding-free packing; ``DistillationTrainer``; the experimental
``GKDTrainer``) and to any ``transformers.Trainer``: put it first among the bases of a subclass, and pass the
distillation's config (and, for a trainer without a teacher of its own, the teacher)::

    class SFTWithAttentionKL(AttentionKLMixin, SFTTrainer):
        pass

    trainer = SFTWithAttentionKL(model=student, args=SFTConfig(...), train_dataset=data,
                                 attention_teacher=teacher, attention_kl={"pairs": [[-1, -1]], "weight": 1.0})

Why a mixin, not a ``TrainerCallback``: a callback sees the step's events, never its loss, so it cannot add a term
to it; TRL 1.x's own way to change a trainer's loss is to subclass the trainer and override ``compute_loss`` (it
deprecates ``compute_loss_func`` in favour of that). The mixin overrides ``compute_loss`` around the trainer's own
(whatever that computes: SFT's cross-entropy, GKD's generalised JSD, ...) and ``log``, and nothing else, so it
composes with any trainer that keeps ``transformers.Trainer``'s signatures of the two.

What a step does:

- a trainer without a teacher of its own (``SFTTrainer``): the engine runs the teacher on the batch, up to its deepest
  paired layer, then the trainer's ``compute_loss`` runs the student, whose paired layers are recorded;
- a trainer that runs the same teacher itself (``GKDTrainer``, ``DistillationTrainer``: ``attention_teacher`` left
  out, or their ``teacher_model``): the engine records the teacher's paired layers during the trainer's own teacher
  forward (to the end: the trainer needs its logits), and the teacher runs once per step;
- then ``weight · ramp(global_step) · Σ_p w_p · KL_p`` is added to the trainer's loss, divided by the gradient
  accumulation steps when the trainer's loss is already normalised over the accumulated batch (as
  ``Trainer.training_step`` decides it), so the term keeps its weight at any accumulation;
- per-pair KL (row-weighted over the logging interval, synced across processes) is logged next to the trainer's
  metrics, as ``attn_kl/<pair>`` and ``attn_kl/total`` (``eval_attn_kl/...`` in evaluation; the prefix is the
  config's ``name``).

Masks come from each attention call, as everywhere in this package: a padded batch counts real tokens only, and a
padding-free batch (one row of documents with restarting ``position_ids``, and ``cu_seq_lens_*`` under
flash-attention) gives the per-document KL. The teacher of an ``SFTTrainer`` gets the batch's ``position_ids`` and
packed-sequence keys too (:func:`~lightning_streamkl.engine.default_teacher_forward`).

This module never imports ``trl``: it relies only on what ``transformers.Trainer`` and TRL's trainers share
(``compute_loss``, ``log``, ``accelerator``, and ``teacher_model`` where the trainer has a teacher), and
``import lightning_streamkl`` never imports it.
Tested with TRL 1.14.2, 1.15.0 and 1.16.0 and transformers 5.23 (the ``trl`` extra, ``trl>=1.14,<1.17``:
``pip install "lightning-streamkl[trl]"``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import torch
from torch import nn

from ..capture import AttentionCapture
from ..config import StreamKLConfig, validate_config
from ..engine import AttentionDistiller, DistillationMetrics
from ..teacher import AdaptersOff

log = logging.getLogger(__name__)

__all__ = ["AttentionKLMixin"]


class AttentionKLMixin:
    r"""Add attention KL to a ``transformers.Trainer`` or one of TRL's trainers: put it first among the bases.

    Args:
        attention_kl: the distillation: a :class:`~lightning_streamkl.StreamKLConfig` or a mapping of its fields
            (``pairs``, ``weight``, ``warmup_steps``, ``head_map``, ...).
        attention_teacher: the teacher whose attention the student learns: a module, a Hugging Face model name or
            path, or :class:`~lightning_streamkl.AdaptersOff`. Default: the trainer's own ``teacher_model`` (a
            logit-distillation trainer), whose forward pass the trainer runs: the engine then records it instead of
            running the teacher again. Passing that same model does the same.
        attention_teacher_forward: ``fn(teacher, batch)`` that runs a teacher the engine runs itself on the trainer's
            batch; default :func:`~lightning_streamkl.engine.default_teacher_forward`.
        *args, **kwargs: the trainer's own arguments.

    Attributes:
        attention_distiller: the :class:`~lightning_streamkl.engine.AttentionDistiller` (teacher, captures, loss).
        attention_kl_metrics: the :class:`~lightning_streamkl.engine.DistillationMetrics` logged by :meth:`log`.

    Raises:
        ValueError: no ``attention_teacher`` and the trainer has no ``teacher_model``; the trainer runs under
            DeepSpeed; and what :class:`~lightning_streamkl.engine.AttentionDistiller` raises (an unknown layer, a bad
            config value), naming the argument.

    Example:
        Any ``transformers.Trainer`` (here a tiny Llama; TRL's trainers take the mixin the same way):

        >>> import tempfile
        >>> from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
        >>> def llama(seed):
        ...     torch.manual_seed(seed)
        ...     return LlamaForCausalLM(LlamaConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        ...         num_key_value_heads=1, intermediate_size=32, vocab_size=32, attn_implementation="sdpa"))
        >>> class DistillingTrainer(AttentionKLMixin, Trainer):
        ...     pass
        >>> args = TrainingArguments(tempfile.mkdtemp(), use_cpu=True, report_to=[], max_steps=1)
        >>> trainer = DistillingTrainer(model=llama(1), args=args, attention_teacher=llama(0),
        ...                             attention_kl={"pairs": [[-1, -1]], "weight": 2.0})
        >>> ids = torch.randint(0, 32, (2, 6))
        >>> loss = trainer.compute_loss(trainer.model, {"input_ids": ids, "labels": ids})
        >>> loss.requires_grad, sorted(trainer.attention_kl_metrics.train.compute())
        (True, ['attn_kl/t-1_s-1', 'attn_kl/total'])
    """

    attention_distiller: AttentionDistiller
    attention_kl_metrics: DistillationMetrics

    def __init__(self, *args: Any, attention_kl: StreamKLConfig | Mapping[str, Any],
                 attention_teacher: nn.Module | str | AdaptersOff | None = None,
                 attention_teacher_forward: Callable[[nn.Module, Any], Any] | None = None, **kwargs: Any) -> None:
        config = validate_config(attention_kl)  # a bad config fails before the trainer loads anything
        super().__init__(*args, **kwargs)
        if getattr(self, "is_deepspeed_enabled", False):
            raise ValueError("AttentionKLMixin does not support DeepSpeed (ZeRO partitions the models' weights outside "
                             "the modules the captures read); train with DDP instead.")
        own = getattr(self, "teacher_model", None)
        own = self.accelerator.unwrap_model(own) if isinstance(own, nn.Module) else None
        if attention_teacher is None and own is None:
            raise ValueError(
                f"Expected `attention_teacher` (the teacher whose attention the student learns), since "
                f"{type(self).__name__} has no `teacher_model` of its own."
            )
        shared = attention_teacher is None or attention_teacher is own \
            or attention_teacher is getattr(self, "teacher_model", None)
        teacher = own if shared else attention_teacher
        #: True when the trainer runs the teacher itself (its ``teacher_model``): the engine records that pass.
        self.trainer_runs_teacher = own is not None and teacher is own
        self.attention_distiller = AttentionDistiller(teacher, config, student=self.model,
                                                      teacher_forward=attention_teacher_forward)
        self.attention_kl_metrics = self.attention_distiller.metrics()
        self._teacher_fallback_warned = False

    # ------------------------------------------------------------------------------------------ the loss
    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> Any:
        """The trainer's own loss plus ``weight · ramp(global_step) · Σ_p w_p · KL_p`` (see the module)."""
        distiller = self.attention_distiller
        with ExitStack() as stack:
            if self.trainer_runs_teacher:
                distiller.clear()
                stack.enter_context(distiller.teacher_recording())
            else:
                distiller.begin_step(inputs)
            stack.enter_context(distiller.student_recording())
            stack.enter_context(_grad_free_calls_unrecorded(distiller.student, distiller.student_capture))
            try:
                result = super().compute_loss(model, inputs, return_outputs=return_outputs,  # type: ignore[misc]
                                              num_items_in_batch=num_items_in_batch)
            except BaseException:
                distiller.clear()
                raise
        if self.trainer_runs_teacher and not distiller.teacher_recorded and not self._teacher_fallback_warned:
            self._teacher_fallback_warned = True
            log.warning("%s.compute_loss did not run its teacher_model's paired layers in this step; the attention "
                        "distiller ran the teacher itself.", type(self).__name__)
        terms = distiller.end_step(inputs)
        stage = "train" if self.model.training else "val"
        self.attention_kl_metrics.update(stage, terms)
        kd = terms.total * (distiller.weight_at(self.state.global_step) * self._attention_kl_scale(num_items_in_batch))
        if return_outputs:
            loss, outputs = result
            return loss + kd.to(loss.dtype), outputs
        return result + kd.to(result.dtype)

    def _attention_kl_scale(self, num_items_in_batch: torch.Tensor | int | None) -> float:
        """``1 / gradient accumulation steps`` when ``Trainer.training_step`` will not divide the loss by them (it is
        normalised over the accumulated batch already), else 1: the term then weighs the same at any accumulation."""
        if not self.model.training:
            return 1.0
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:
            scaled = bool(getattr(self, "model_accepts_loss_kwargs", False) and num_items_in_batch is not None) \
                or getattr(self, "compute_loss_func", None) is not None
        steps = getattr(self, "current_gradient_accumulation_steps", None) or self.args.gradient_accumulation_steps
        return 1.0 / steps if scaled else 1.0

    # ------------------------------------------------------------------------------------------ logging
    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Add the per-pair KL since the last log (``attn_kl/<pair>``, ``attn_kl/total``; ``eval_`` first in
        evaluation) to ``logs``, then log as the trainer does."""
        stage = "train" if self.model.training else "val"
        metric = self.attention_kl_metrics[stage]
        if metric.update_count:
            prefix = "" if stage == "train" else "eval_"
            logs.update({prefix + key: float(value) for key, value in metric.compute().items()})
            metric.reset()
        super().log(logs, *args, **kwargs)  # type: ignore[misc]


@contextmanager
def _grad_free_calls_unrecorded(module: nn.Module | None, capture: AttentionCapture | None) -> Iterator[None]:
    """Inside the block, a forward call of ``module`` made under ``no_grad`` while gradients were on at the start is
    not recorded. TRL's ``SFTTrainer`` runs the student a second time without gradients, for its metrics, when label
    smoothing or a ``compute_loss_func`` is set: that call must not replace the records of the pass the loss
    backpropagates through."""
    if module is None or capture is None or not torch.is_grad_enabled():
        yield
        return
    pauses: list[AbstractContextManager[None] | None] = []

    def before(m: nn.Module, args: Any) -> None:
        pause = None if torch.is_grad_enabled() else capture.paused()
        if pause is not None:
            pause.__enter__()
        pauses.append(pause)

    def after(m: nn.Module, args: Any, output: Any) -> None:
        pause = pauses.pop() if pauses else None
        if pause is not None:
            pause.__exit__(None, None, None)

    handles = [module.register_forward_pre_hook(before), module.register_forward_hook(after, always_call=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        while pauses:
            pause = pauses.pop()
            if pause is not None:
                pause.__exit__(None, None, None)
