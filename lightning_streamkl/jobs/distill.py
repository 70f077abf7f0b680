r"""
The distillation job
^^^^^^^^^^^^^^^^^^^^

What ``streamkl-distill fit`` runs: train a teacher, then two students from the same initialisation, seed,
data and step budget, one with :class:`~lightning_streamkl.StreamKLDistillation` and one without; evaluate all
three on held-out sequences at several context lengths, measure how far each student's attention is from the
teacher's, and write a run directory with metrics, plots and a short report. With a target accuracy
(``job.target_accuracy``), a student that has not reached it when the step budget runs out keeps training until it
does or until ``job.target_max_steps``, so the report can say how many steps (and seconds) each student needed;
the step-matched comparison still uses the weights each student had at the budget.

The job works with any teacher/student LightningModules and data module that follow a small protocol (the
built-in :mod:`lightning_streamkl.tasks.recall` task does):

- the data module's ``train_dataloader()`` feeds both the teacher's and the students' training;
  ``eval_batches(seq_len, num_sequences, batch_size)`` yields held-out batches at a given length; a data module
  for the teacher is made with ``type(dm)(**{**dm.hparams, **teacher_data})``;
- the modules' ``count_correct(batch)`` returns ``(correct, scored)``, and the teacher and student can both be
  called as ``module(**inputs)`` on a batch (the callback's default teacher forward).
"""

from __future__ import annotations

import copy
import json
import logging
import platform
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_streamkl import AttentionDistiller, StreamKLConfig, StreamKLDistillation, validate_config
from lightning_streamkl.capture import build_capture
from lightning_streamkl.engine import default_teacher_forward

from .report import LABELS, WINDOW, first_step_reaching, write_outputs

log = logging.getLogger(__name__)


@dataclass
class JobConfig:
    """Everything the job does around the three trainings (the ``job:`` section of a config).

    Args:
        run_dir: where metrics, plots and the report go (created; files in it are overwritten).
        teacher_steps: optimizer steps of the teacher's training (the students' come from ``trainer.max_steps``).
        teacher_data: constructor arguments of the data module that differ for the teacher's training
            (e.g. ``{batch_size: 32}``, or several ``seq_len`` values).
        teacher_checkpoint: load the teacher's weights from this file (a Lightning checkpoint or a state dict)
            instead of training it.
        save_teacher: save the trained teacher to ``<run_dir>/teacher.ckpt`` (for ``teacher_checkpoint`` later).
        baseline: also train the student without attention KL (the comparison); ``False`` trains only the
            distilled student.
        eval_lengths: context lengths of the held-out evaluation.
        eval_sequences: held-out sequences per length.
        eval_batch_size: sequences per evaluation batch.
        kl_eval_sequences: held-out sequences (at the students' training length) on which the attention KL of
            each student to the teacher is measured at the end.
        target_accuracy: the training accuracy each student is timed to (the moving average over 20 steps of the
            accuracy on each step's batch, which is fresh data every step); ``None``: no target, every student
            trains exactly the step budget (``trainer.max_steps``). The built-in default config sets ``0.9``.
        target_max_steps: the cap: a student still below the target when the budget runs out keeps training
            until it reaches it or until this many steps (the report then says "not within" the cap).
        plots: write PNG plots (needs matplotlib).

    Example:
        >>> JobConfig(target_accuracy=0.9).target_max_steps
        3000
    """

    run_dir: str = "runs/streamkl-distill"
    teacher_steps: int = 800
    teacher_data: dict[str, Any] = field(default_factory=dict)
    teacher_checkpoint: str | None = None
    save_teacher: bool = False
    baseline: bool = True
    eval_lengths: list[int] = field(default_factory=lambda: [32, 64, 128, 256, 512])
    eval_sequences: int = 256
    eval_batch_size: int = 64
    kl_eval_sequences: int = 64
    target_accuracy: float | None = None
    target_max_steps: int = 3000
    plots: bool = True


class RunStats(Callback):
    """Records, for one training run: per-step wall time and the time since training started, the ``train/...``
    values logged each step, the batch shape, and the peak CUDA memory (``torch.cuda.max_memory_allocated``, reset
    when training starts).

    Example:
        >>> RunStats().summary()["steps"]
        0
    """

    def __init__(self) -> None:
        self.history: list[dict[str, float]] = []
        self.step_times: list[float] = []
        self.batch_shape: tuple[int, ...] | None = None
        self.peak_cuda_bytes: int | None = None
        self.wall_s = 0.0
        self._t0 = self._start = 0.0

    def _sync(self, pl_module: L.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        self._start = time.perf_counter()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.batch_shape is None and isinstance(batch, Mapping) and "input_ids" in batch:
            self.batch_shape = tuple(batch["input_ids"].shape)
        self._sync(pl_module)
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._sync(pl_module)
        dt = time.perf_counter() - self._t0
        self.step_times.append(dt)
        row = {"step": float(trainer.global_step), "time_s": dt, "elapsed_s": time.perf_counter() - self._start}
        for key, value in trainer.callback_metrics.items():
            if key.startswith("train/") and not key.endswith("_epoch") and isinstance(value, torch.Tensor) and \
                    value.numel() == 1:
                row[key.removesuffix("_step")] = float(value)  # the per-step values, under the history's keys
        self.history.append(row)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._sync(pl_module)
        self.wall_s = time.perf_counter() - self._start
        if pl_module.device.type == "cuda":
            self.peak_cuda_bytes = int(torch.cuda.max_memory_allocated(pl_module.device))

    def summary(self) -> dict[str, Any]:
        """Steps, wall time, median step time (after the first 5 steps), peak CUDA memory, batch shape, history."""
        times = sorted(self.step_times[5:] or self.step_times)
        median = times[len(times) // 2] if times else float("nan")
        return {"steps": len(self.step_times), "wall_s": self.wall_s, "step_ms_median": 1e3 * median,
                "peak_cuda_bytes": self.peak_cuda_bytes,
                "batch_shape": list(self.batch_shape) if self.batch_shape else None, "history": self.history}


class UntilTarget(Callback):
    """Keeps a copy of the weights at the step budget (for the step-matched comparison) and stops training once,
    past the budget, the moving average of ``train/acc`` has reached ``target`` (``None``: stop at the budget).

    Example:
        >>> UntilTarget(budget=300, target=0.9).weights_at_budget is None
        True
    """

    def __init__(self, budget: int, target: float | None) -> None:
        self.budget, self.target = budget, target
        self.weights_at_budget: dict[str, torch.Tensor] | None = None
        self._window: deque[float] = deque(maxlen=WINDOW)
        self._reached = False

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        value = trainer.callback_metrics.get("train/acc")
        if value is not None:
            self._window.append(float(value))
            full = len(self._window) == WINDOW
            self._reached |= full and self.target is not None and sum(self._window) / WINDOW >= self.target
        if trainer.global_step == self.budget:
            self.weights_at_budget = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        if trainer.global_step >= self.budget and (self.target is None or self._reached):
            trainer.should_stop = True


class _RunLabel(Callback):
    """Names the run in the TQDM progress bar instead of "Epoch 0/-2" (public API: ``trainer.progress_bar_callback``
    and ``TQDMProgressBar.train_progress_bar``); set after the bar's own epoch start, on the first batch."""

    def __init__(self, label: str) -> None:
        self.label = label

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        bar = trainer.progress_bar_callback
        if batch_idx == 0 and isinstance(bar, TQDMProgressBar) and bar.is_enabled:
            bar.train_progress_bar.set_description(self.label)


def naive_loss_bytes(batch_size: int, heads: Iterable[int], seq_len: int) -> dict[str, int]:
    """Memory the materialised (naive) attention-KL loss needs for the given paired layers.

    Per pair, the naive loss holds the teacher's and the student's ``B·H·N²`` probability maps in fp32 (the
    ``maps`` figure) and, in the backward, at least one more map-sized fp32 gradient (``with_grad``).

    Example:
        >>> naive_loss_bytes(4, [4, 4], 16384)["maps"] / 2**30
        64.0
    """
    per_map = [4 * batch_size * h * seq_len * seq_len for h in heads]
    return {"maps": sum(2 * m for m in per_map), "with_grad": sum(3 * m for m in per_map)}


def _heads_of(module: nn.Module) -> int | None:
    for attr in ("num_heads", "num_attention_heads", "n_heads"):
        value = getattr(module, attr, None)
        if isinstance(value, int):
            return value
    config = getattr(module, "config", None)
    value = getattr(config, "num_attention_heads", None)
    return value if isinstance(value, int) else None


def _clone_datamodule(dm: L.LightningDataModule, overrides: Mapping[str, Any]) -> L.LightningDataModule:
    if not overrides:
        return dm
    hparams = _hparams(dm)
    if not hparams:
        raise ValueError(
            f"`job.teacher_data` needs a data module that saves its constructor arguments (save_hyperparameters()); "
            f"{type(dm).__name__} has none."
        )
    return type(dm)(**{**hparams, **dict(overrides)})


def _autocast(trainer: L.Trainer, device: torch.device):
    precision = str(trainer.precision)
    if device.type == "cuda" and precision in ("bf16-mixed", "16-mixed"):
        return torch.autocast("cuda", dtype=torch.bfloat16 if precision.startswith("bf16") else torch.float16)
    if device.type == "cpu" and precision == "bf16-mixed":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return nullcontext()


class DistillationJob:
    """Teacher, then student with and without attention KL, then evaluation and report.

    Args:
        teacher: the teacher LightningModule (trained by the job unless ``config.teacher_checkpoint`` is set).
        student: the student LightningModule; both students start from a copy of it (same weights).
        datamodule: the data (see the module docstring for the protocol).
        distillation: the :class:`~lightning_streamkl.StreamKLDistillation` options (everything except the
            teacher): a mapping or a :class:`~lightning_streamkl.StreamKLConfig`.
        config: a :class:`JobConfig` (or a mapping of its fields).
        trainer_factory: makes each run's Trainer from keyword arguments (``max_steps``, ``logger``,
            ``callbacks``, ``default_root_dir``); default ``Trainer(**trainer_defaults, **kwargs)``.
        trainer_defaults: Trainer arguments shared by the three runs when no factory is given.
        seed: seeds every run (``seed_everything(seed)`` before each fit), so both students see the same
            batches in the same order.
        config_text: the resolved config, written to ``<run_dir>/config.yaml``.

    Example:
        The arguments (:meth:`run` trains and writes the run directory):

        >>> from lightning_streamkl.jobs import RecallData, RecallModel
        >>> job = DistillationJob(RecallModel(d_model=16, num_heads=2), RecallModel(d_model=16, num_heads=2),
        ...                       RecallData(seq_len=16, batch_size=2), {"pairs": [[-1, -1]]},
        ...                       {"teacher_steps": 3, "eval_lengths": [16]}, trainer_defaults={"max_steps": 3})
        >>> job.config.teacher_steps, [p.label for p in job.distill_config.pairs]
        (3, ['t-1_s-1'])
    """

    def __init__(self, teacher: L.LightningModule, student: L.LightningModule, datamodule: L.LightningDataModule,
                 distillation: StreamKLConfig | Mapping[str, Any], config: JobConfig | Mapping[str, Any] | None = None,
                 *, trainer_factory: Callable[..., L.Trainer] | None = None,
                 trainer_defaults: Mapping[str, Any] | None = None, seed: int = 0,
                 config_text: str | None = None) -> None:
        self.config = config if isinstance(config, JobConfig) else JobConfig(**dict(config or {}))
        self.distill_options = _options(distillation)
        self.distill_config: StreamKLConfig = validate_config(
            {k: v for k, v in self.distill_options.items() if k in StreamKLConfig.__dataclass_fields__})
        self.teacher, self.student, self.datamodule = teacher, student, datamodule
        defaults = dict(trainer_defaults or {})
        self.trainer_factory = trainer_factory or (lambda **kw: L.Trainer(**{**defaults, **kw}))
        self.seed = int(seed)
        self.config_text = config_text
        self.run_dir = Path(self.config.run_dir)
        self.results: dict[str, Any] = {}
        self._trainers_made = 0
        self._last_trainer: L.Trainer | None = None

    # ------------------------------------------------------------------------------------------ running
    def run(self) -> dict[str, Any]:
        """Run the whole job; returns the results (also written to ``<run_dir>/results.json``)."""
        cfg = self.config
        start = time.perf_counter()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.config_text:
            (self.run_dir / "config.yaml").write_text(self.config_text)
        initial_student = copy.deepcopy(self.student)
        n_stages = 4 if cfg.baseline else 3
        runs: dict[str, dict[str, Any]] = {}

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
            # 1. the teacher
            if cfg.teacher_checkpoint:
                _banner(1, n_stages, f"loading the teacher from {cfg.teacher_checkpoint}")
                _load_weights(self.teacher, cfg.teacher_checkpoint)
            else:
                teacher_dm = _clone_datamodule(self.datamodule, cfg.teacher_data)
                _banner(1, n_stages, f"training the teacher: {cfg.teacher_steps} steps, {_data_note(teacher_dm)}")
                trainer, stats = self._fit("teacher", self.teacher, teacher_dm, cfg.teacher_steps, [])
                runs["teacher"] = stats.summary()
                if cfg.save_teacher:
                    trainer.save_checkpoint(self.run_dir / "teacher.ckpt")

            # 2. the student with attention KL
            budget = self._student_budget()
            distill = StreamKLDistillation(self.teacher, **self.distill_options)
            _banner(2, n_stages, "training the student WITH attention KL "
                                 f"({', '.join(p.label for p in self.distill_config.pairs)}; weight "
                                 f"{self.distill_config.weight:g}), {_data_note(self.datamodule)}"
                                 + self._target_note(budget))
            students = {"student_kl": self._fit_student("student_kl", self.student, budget, [distill], runs)}

            # 3. the student without
            if cfg.baseline:
                _banner(3, n_stages, "training the student WITHOUT attention KL (same initial weights, seed, data "
                                     "and steps)" + self._target_note(budget))
                students["student_base"] = self._fit_student("student_base", initial_student, budget, [], runs)

        # 4. evaluation (of the students' weights at the step budget)
        _banner(n_stages, n_stages, f"evaluating on held-out sequences at lengths {list(cfg.eval_lengths)}")
        trainer = self._last_trainer
        device = trainer.strategy.root_device
        models = {"teacher": self.teacher, **students}
        accuracy = {name: self.evaluate_accuracy(m, device, trainer) for name, m in models.items()}
        train_len = _max_len(self.datamodule)
        kl = {name: self.evaluate_attention_kl(m, train_len, device, trainer) for name, m in students.items()}

        self.results = {
            "runs": runs,
            "eval": {"lengths": list(cfg.eval_lengths), "accuracy": accuracy, "attention_kl": kl,
                     "attention_kl_seq_len": train_len, "sequences": cfg.eval_sequences},
            "setup": self._setup_summary(runs),
            "naive_loss": self._naive_summary(runs),
            "environment": {"device": _device_name(device), "torch": torch.__version__,
                            "lightning": L.__version__, "python": platform.python_version(),
                            "threads": torch.get_num_threads()},
            "total_wall_s": time.perf_counter() - start,
        }
        write_outputs(self.results, self.run_dir, plots=cfg.plots)
        self.results["total_wall_s"] = time.perf_counter() - start
        (self.run_dir / "results.json").write_text(json.dumps(self.results, indent=1, default=_json_default))
        print(f"\nDone in {self.results['total_wall_s']:.0f} s. Report: {self.run_dir / 'report.md'}")
        return self.results

    def _fit(self, name: str, module: L.LightningModule, dm: L.LightningDataModule, max_steps: int | None,
             callbacks: list[Callback]) -> tuple[L.Trainer, RunStats]:
        stats = RunStats()
        kwargs: dict[str, Any] = {"logger": CSVLogger(str(self.run_dir), name=name, version=""),
                                  "callbacks": [*callbacks, stats, _RunLabel(LABELS[name])],
                                  "default_root_dir": str(self.run_dir / name)}
        if max_steps is not None:
            kwargs["max_steps"] = max_steps
        trainer = self._trainer(**kwargs)
        L.seed_everything(self.seed, workers=True, verbose=False)
        trainer.fit(module, datamodule=dm)
        self._last_trainer = trainer
        return trainer, stats

    def _trainer(self, **kwargs: Any) -> L.Trainer:
        with _quiet_trainer_banner(self._trainers_made > 0):
            trainer = self.trainer_factory(**kwargs)
        self._trainers_made += 1
        return trainer

    def _student_budget(self) -> int:
        """The students' step budget: the ``max_steps`` of the trainer the factory makes."""
        budget = self._trainer(logger=False, enable_checkpointing=False).max_steps
        if budget is None or budget < 1:
            raise ValueError(f"Expected the students' trainer to have `max_steps` >= 1 (the step budget of the "
                             f"comparison), but got {budget}.")
        return int(budget)

    def _target_note(self, budget: int) -> str:
        target = self.config.target_accuracy
        if target is None or self.config.target_max_steps <= budget:
            return ""
        return (f"; then, until its training accuracy reaches {100 * target:g}% (at most "
                f"{self.config.target_max_steps} steps)")

    def _fit_student(self, name: str, module: L.LightningModule, budget: int, callbacks: list[Callback],
                     runs: dict[str, dict[str, Any]]) -> L.LightningModule:
        """Train one student for the budget (and on to the target, up to the cap); returns the model with its
        weights at the budget (a copy when it trained longer)."""
        target = self.config.target_accuracy
        cap = max(budget, self.config.target_max_steps) if target is not None else budget
        until = UntilTarget(budget, target)
        _, stats = self._fit(name, module, self.datamodule, cap, [*callbacks, until])
        summary = stats.summary()
        reached = first_step_reaching(summary["history"], "train/acc", target, WINDOW) if target is not None else None
        summary["budget"] = budget
        summary["target"] = {"accuracy": target, "max_steps": cap, "window": WINDOW, "step": reached,
                             "elapsed_s": _elapsed_at(summary["history"], reached)}
        runs[name] = summary
        if until.weights_at_budget is None or summary["steps"] == budget:
            return module
        at_budget = copy.deepcopy(module)
        at_budget.load_state_dict(until.weights_at_budget)
        return at_budget

    # ------------------------------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate_accuracy(self, model: L.LightningModule, device: torch.device, trainer: L.Trainer) -> dict[int, float]:
        """Held-out next-token accuracy at every ``eval_lengths`` length: ``{length: accuracy}``."""
        cfg = self.config
        model.to(device).eval()
        out = {}
        with _autocast(trainer, device):
            for n in cfg.eval_lengths:
                correct = total = 0
                for batch in self.datamodule.eval_batches(n, cfg.eval_sequences, cfg.eval_batch_size):
                    c, t = model.count_correct(batch)
                    correct, total = correct + c, total + t
                out[int(n)] = correct / max(total, 1)
        return out

    @torch.no_grad()
    def evaluate_attention_kl(self, student: L.LightningModule, seq_len: int, device: torch.device,
                              trainer: L.Trainer) -> dict[str, float]:
        """Mean attention KL per pair between the teacher and ``student`` on held-out sequences of ``seq_len``."""
        cfg = self.config
        if cfg.kl_eval_sequences <= 0:
            return {}
        distiller = AttentionDistiller(self.teacher, self.distill_config)
        student.to(device).eval()
        distiller.setup(student)
        sums = rows = None
        with _autocast(trainer, device):
            for batch in self.datamodule.eval_batches(seq_len, cfg.kl_eval_sequences, cfg.eval_batch_size, seed=2):
                batch = {k: v.to(device) for k, v in batch.items()}
                distiller.begin_step(batch)
                with distiller.student_recording():
                    default_teacher_forward(student, batch)
                out = distiller.end_step(batch)
                sums = out.kl_sums if sums is None else sums + out.kl_sums
                rows = out.rows if rows is None else rows + out.rows
        assert sums is not None and rows is not None
        return {name: float(s / r) for name, s, r in zip(distiller.loss.pair_names, sums, rows)}

    # ------------------------------------------------------------------------------------------ summaries
    def _setup_summary(self, runs: Mapping[str, Any]) -> dict[str, Any]:
        dm = self.datamodule
        hp = _hparams(dm)
        t_hp = {**hp, **self.config.teacher_data}
        return {
            "job": asdict(self.config),
            "seed": self.seed,
            "student_params": _count(self.student),
            "teacher_params": _count(self.teacher),
            "student_hparams": _plain(_hparams(self.student)),
            "teacher_hparams": _plain(_hparams(self.teacher)),
            "data": _plain(hp),
            "teacher_data": _plain(t_hp),
            "train_seq_len": _max_len(dm),
            "student_steps": runs.get("student_kl", {}).get("budget", runs.get("student_kl", {}).get("steps")),
            "teacher_steps": runs.get("teacher", {}).get("steps", 0),
            "distillation": _plain({k: v for k, v in asdict(self.distill_config).items()}),
            "chance": 1.0 / hp["vocab_size"] if hp.get("vocab_size") else None,
        }

    def _naive_summary(self, runs: Mapping[str, Any]) -> dict[str, Any] | None:
        shape = runs.get("student_kl", {}).get("batch_shape")
        if not shape or len(shape) < 2:
            return None
        capture = build_capture(self.student, self.distill_config.student_capture)
        heads = []
        for pair in self.distill_config.pairs:
            try:
                heads.append(_heads_of(self.student.get_submodule(capture.resolve(pair.student))))
            except (ValueError, AttributeError):
                heads.append(None)
        if any(h is None for h in heads):
            return None
        b, n = int(shape[0]), int(shape[1])
        return {"batch_size": b, "seq_len": n, "heads": heads, "pairs": len(heads), **naive_loss_bytes(b, heads, n)}


# ---------------------------------------------------------------------------------------------- helpers
def _options(distillation: StreamKLConfig | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(distillation, StreamKLConfig):
        return asdict(distillation)
    return {k: _plain(v) for k, v in dict(distillation).items()}


def _plain(value: Any) -> Any:
    """Namespaces, dataclasses and tuples as plain dicts and lists (for JSON and the callback)."""
    if hasattr(value, "as_dict") and callable(value.as_dict):
        value = value.as_dict()
    if hasattr(value, "__dataclass_fields__"):
        value = asdict(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _hparams(obj: Any) -> dict[str, Any]:
    """``obj.hparams`` without the entries LightningCLI adds (``_class_path``, ``_instantiator``)."""
    return {k: v for k, v in dict(getattr(obj, "hparams", {})).items() if not str(k).startswith("_")}


def _max_len(dm: L.LightningDataModule) -> int:
    if hasattr(dm, "max_seq_len"):
        return int(dm.max_seq_len)
    seq_len = _hparams(dm).get("seq_len")
    return int(max(seq_len) if isinstance(seq_len, (list, tuple)) else seq_len)


def _data_note(dm: L.LightningDataModule) -> str:
    hp = _hparams(dm)
    if "seq_len" in hp and "batch_size" in hp:
        return f"batches of {hp['batch_size']} x seq_len {hp['seq_len']}"
    return type(dm).__name__


def _elapsed_at(history: list[dict[str, float]], step: int | None) -> float | None:
    """The time since training started when ``step`` ended (``None`` for no step)."""
    if step is None:
        return None
    return next((row["elapsed_s"] for row in history if int(row["step"]) == step), None)


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _load_weights(module: nn.Module, path: str) -> None:
    state = torch.load(path, map_location="cpu", weights_only=True)
    module.load_state_dict(state.get("state_dict", state) if isinstance(state, dict) else state)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({platform.processor() or platform.machine()})"


class _DropLines(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).lstrip().startswith(self.prefixes)


@contextmanager
def _quiet_trainer_banner(quiet: bool) -> Iterator[None]:
    """Drop the accelerator lines every new Trainer prints, after the first Trainer of a job."""
    if not quiet:
        yield
        return
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    line_filter = _DropLines(("GPU available", "TPU available", "HPU available", "💡"))
    logger.addFilter(line_filter)
    try:
        yield
    finally:
        logger.removeFilter(line_filter)


def _banner(i: int, n: int, text: str) -> None:
    print(f"\n[{i}/{n}] {text}", flush=True)


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return str(value)
