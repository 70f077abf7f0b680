r"""
streamkl-distill
^^^^^^^^^^^^^^^^

The command-line entry point, a :class:`~lightning.pytorch.cli.LightningCLI` whose ``fit`` runs the whole
:class:`~lightning_streamkl.jobs.DistillationJob` (teacher, student with and without attention KL, evaluation,
report). It uses LightningCLI's public API only (``subcommands``, ``add_arguments_to_parser``, a method named after
the subcommand, ``instantiate_classes``, ``config``/``config_init``/``parser``)::

    streamkl-distill                                   # the built-in default: a CPU run of ~2 minutes
    streamkl-distill fit --config my.yaml              # overrides on top of the default
    streamkl-distill fit --config gpu_long             # a built-in config by name (see CONFIGS)
    streamkl-distill fit --trainer.max_steps 500 --distillation.weight 2.0
    streamkl-distill fit --print_config                # the resolved config

Configs are YAML with omegaconf interpolation (``${model.init_args.num_heads}``), resolved after merging the
default, the ``--config`` files and the command line. Sections: ``trainer`` (the students' Trainer; the
teacher's is the same with ``job.teacher_steps``), ``model`` (the student), ``teacher``, ``data``,
``distillation`` (the :class:`~lightning_streamkl.StreamKLDistillation` arguments except the teacher) and
``job`` (:class:`~lightning_streamkl.jobs.JobConfig`).
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch import LightningDataModule, LightningModule, Trainer

try:
    from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
except ImportError as err:  # pragma: no cover - jsonargparse missing
    raise ImportError(
        "streamkl-distill needs jsonargparse: pip install 'lightning-streamkl[cli]' "
        "(or 'jsonargparse[signatures,omegaconf]')."
    ) from err

from lightning_streamkl import StreamKLDistillation
from lightning_streamkl.cli import asks_to_print_config, check_sections, without_print_config

from .distill import DistillationJob, JobConfig

#: Folder of the built-in configs.
CONFIG_DIR = Path(__file__).resolve().parent / "configs"
#: The config every run starts from.
DEFAULT_CONFIG = CONFIG_DIR / "default.yaml"


def builtin_configs() -> dict[str, Path]:
    """The built-in configs by name (``--config <name>`` selects one).

    Example:
        >>> sorted(builtin_configs())[:2]
        ['default', 'gpu_long']
    """
    return {p.stem: p for p in sorted(CONFIG_DIR.glob("*.yaml"))}


_DESCRIPTION = (
    "Attention distillation with StreamKL: train a teacher, then a student with and a student without attention "
    "KL (same initial weights, seed, data and steps), evaluate them at several context lengths and write a run "
    "directory with metrics, plots and report.md. `streamkl-distill` alone runs the built-in default (a CPU run of "
    "about two minutes)."
)
_FIT_DESCRIPTION = (
    "Run the distillation job. The built-in default config is loaded first; --config files and --section.key "
    "arguments override it; YAML values may use omegaconf interpolation (${model.init_args.num_heads})."
)


class StreamKLCLI(LightningCLI):
    """LightningCLI for the distillation job: ``fit`` trains teacher and students and writes the report.

    Adds the ``teacher`` (a LightningModule, like ``model``), ``distillation`` and ``job`` sections, links
    ``data.vocab_size`` into both models, and loads :data:`DEFAULT_CONFIG` before any other config. After a
    run, :attr:`results` holds what ``<run_dir>/results.json`` holds.

    Example:
        >>> sorted(StreamKLCLI.subcommands()["fit"])
        ['datamodule', 'model', 'train_dataloaders', 'val_dataloaders']
    """

    def __init__(self, args: Any = None, run: bool = True, **kwargs: Any) -> None:
        from jsonargparse import set_parsing_settings

        # ${model.init_args.num_heads} is written from the root of a config; under the `fit` subcommand the root
        # is `fit`, so let omegaconf+ read absolute interpolation paths relative to the subcommand.
        set_parsing_settings(omegaconf_absolute_to_relative_paths=True)
        self.results: dict[str, Any] | None = None
        mode = {"parser_mode": "omegaconf+"}
        names = ", ".join(builtin_configs())
        parser_kwargs = {
            **mode, "description": _DESCRIPTION + f" Built-in configs (--config NAME): {names}.",
            "fit": {**mode, "default_config_files": [str(DEFAULT_CONFIG)], "description": _FIT_DESCRIPTION},
            **kwargs.pop("parser_kwargs", {}),
        }
        super().__init__(
            LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
            save_config_callback=None, auto_configure_optimizers=False, parser_kwargs=parser_kwargs,
            args=args, run=run, load_from_checkpoint_support=False, **kwargs,
        )

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """Only ``fit`` (the job)."""
        return {"fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"}}

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_subclass_arguments(LightningModule, "teacher", required=True,
                                      help="The teacher (a LightningModule, trained by the job first).")
        parser.add_class_arguments(StreamKLDistillation, "distillation", skip={"teacher", "teacher_forward"},
                                   instantiate=False, sub_configs=True)
        parser.add_class_arguments(JobConfig, "job")
        parser.link_arguments("data.vocab_size", "model.init_args.vocab_size", apply_on="instantiate")
        parser.link_arguments("data.vocab_size", "teacher.init_args.vocab_size", apply_on="instantiate")

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse as LightningCLI does; with ``--print_config``, the StreamKL sections (``distillation`` and any
        callback in ``trainer.callbacks``) are checked first, as a run checks them, so a bad value is not printed as
        if it were valid."""
        argv = sys.argv[1:] if args is None else args
        if isinstance(argv, (list, tuple)) and asks_to_print_config(argv):
            config = parser.parse_args(without_print_config([str(a) for a in argv]))
            try:
                check_sections(config, [f"{config.subcommand}.distillation"])
            except (ValueError, TypeError) as err:
                raise _config_error(err) from None
        super().parse_arguments(parser, args)

    def instantiate_classes(self) -> None:
        """Instantiate the config's classes; an error raised by a class's own validation (e.g. a LightningCLI union
        wrapping it) is re-raised as that error, so its message comes first."""
        try:
            super().instantiate_classes()
        except Exception as err:
            raise _config_error(_root_cause(err)) from None

    def fit(self, model: LightningModule, datamodule: LightningDataModule | None = None, **_: Any) -> None:
        """Run the job (replaces ``Trainer.fit`` for this CLI)."""
        cfg = self.config_init[self.subcommand]
        config_text = yaml.safe_dump(yaml.safe_load(self.parser.dump(self.config))[self.subcommand], sort_keys=False)
        try:
            job = DistillationJob(
                teacher=cfg["teacher"], student=model, datamodule=datamodule,
                distillation=_as_dict(cfg["distillation"]), config=cfg["job"],
                trainer_factory=self._make_trainer, seed=_seed(cfg.get("seed_everything")), config_text=config_text,
            )
        except (ValueError, TypeError) as err:
            raise _config_error(err) from None
        self.results = job.run()

    def _make_trainer(self, **overrides: Any) -> Trainer:
        """A fresh Trainer from the ``trainer`` section; the section's callbacks are copied for each run."""
        base = self.config_init[self.subcommand].get("trainer") or {}
        callbacks = [copy.deepcopy(c) for c in (base.get("callbacks") or [])]
        overrides["callbacks"] = callbacks + list(overrides.get("callbacks", []))
        return self.trainer_class(**{**base, **overrides})


def _as_dict(value: Any) -> dict[str, Any]:
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    return dict(value)


def _seed(value: Any) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else 0


def _normalise_args(argv: list[str]) -> list[str]:
    """Insert the ``fit`` subcommand when it is left out, and turn ``--config <builtin name>`` into its path.

    Example:
        >>> _normalise_args([])
        ['fit']
        >>> _normalise_args(["--config", "gpu_long"])[:2], _normalise_args(["--config", "gpu_long"])[2].endswith(
        ...     "configs/gpu_long.yaml")
        (['fit', '--config'], True)
        >>> _normalise_args(["--help"])
        ['--help']
    """
    argv = list(argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv.insert(0, "fit")
    known = builtin_configs()
    for i, arg in enumerate(argv):
        value, prefix = None, ""
        if arg in ("-c", "--config") and i + 1 < len(argv):
            value, target = argv[i + 1], i + 1
        elif arg.startswith("--config="):
            value, target, prefix = arg.split("=", 1)[1], i, "--config="
        if value is not None and not Path(value).exists():
            name = value[:-5] if value.endswith(".yaml") else value
            if name in known:
                argv[target] = prefix + str(known[name])
    return argv


def main(args: list[str] | None = None) -> StreamKLCLI:
    """Entry point of ``streamkl-distill`` (``args``: the command line without the program name).

    Example:
        >>> import contextlib, io, sys
        >>> argv, sys.argv = sys.argv, ["streamkl-distill"]  # LightningCLI warns when both hold arguments
        >>> with contextlib.redirect_stdout(io.StringIO()) as printed, contextlib.suppress(SystemExit):
        ...     _ = main(["--job.teacher_steps=5", "--print_config"])
        >>> sys.argv = argv
        >>> "teacher_steps: 5" in printed.getvalue()
        True
    """
    if args is None:
        sys.argv[1:] = _normalise_args(sys.argv[1:])
        return StreamKLCLI()
    return StreamKLCLI(args=_normalise_args(args))


def _root_cause(err: BaseException) -> BaseException:
    """The innermost cause of ``err`` that our own code raised (a config value error), else ``err``.

    Example:
        >>> try:
        ...     try:
        ...         raise ValueError("Expected `temperature` to be a finite number > 0, but got -2.0.")
        ...     except ValueError as inner:
        ...         raise ValueError("Does not validate against any of the Union subtypes") from inner
        ... except ValueError as outer:
        ...     print(_root_cause(outer))
        Expected `temperature` to be a finite number > 0, but got -2.0.
    """
    seen = err
    while seen.__cause__ is not None:
        seen = seen.__cause__
    return seen if isinstance(seen, (ValueError, TypeError)) else err


def _config_error(err: BaseException) -> BaseException:
    """Mark ``err`` as an error in the config (raised before anything ran), for :func:`run`."""
    err._streamkl_config_error = True  # type: ignore[attr-defined]
    return err


def run() -> None:
    """The ``streamkl-distill`` console script: :func:`main` on ``sys.argv``, exit status 0 when the job finishes.

    A config error (a bad value or key, from the YAML or the command line) is printed as one line, ``error: ...``,
    with exit status 2, as for the parser's own errors; ``STREAMKL_DEBUG=1`` shows the traceback instead. (A
    console script exits with its function's return value, and :func:`main` returns the CLI object.)

    Example:
        >>> import contextlib, io, sys
        >>> argv, sys.argv = sys.argv, ["streamkl-distill", "--distillation.temperature=0", "--trainer.logger=false"]
        >>> with contextlib.redirect_stderr(io.StringIO()) as err, contextlib.suppress(SystemExit):
        ...     run()                    # fails before anything is trained
        >>> sys.argv = argv
        >>> err.getvalue().strip().splitlines()[-1]
        'streamkl-distill: error: Expected `temperature` to be a finite number > 0, but got 0.0.'
    """
    try:
        main()
    except (ValueError, TypeError) as err:
        if not getattr(err, "_streamkl_config_error", False) or os.environ.get("STREAMKL_DEBUG"):
            raise
        print(f"streamkl-distill: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":  # pragma: no cover
    run()
