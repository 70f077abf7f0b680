"""The documented ways in (callback, mixin, LightningCLI YAML; outside the Trainer: plain PyTorch, Fabric, a Hugging
Face Trainer) run as shipped, and the code shown in the README and the guides is the code of those example files."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("jsonargparse")

from lightning_streamkl import StreamKLDistillation

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
QUIET = dict(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
             enable_model_summary=False)


@pytest.fixture(autouse=True)
def _examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.setattr("sys.argv", ["lightning_cli.py"])  # LightningCLI(args=...) warns about pytest's own argv


def test_callback_example():
    import lightning_callback

    metrics = lightning_callback.main(max_steps=6, limit_train_batches=3, limit_val_batches=1, **QUIET)
    assert {"train/attn_kl/first_step", "train/attn_kl/first_epoch", "train/attn_kl/last_epoch",
            "train/attn_kl/total_epoch", "val/attn_kl/first", "val/attn_kl/total", "train/task_loss"} <= set(metrics)
    # both pairs have weight 1: the logged total is their sum, at every stage
    for key in ("train/attn_kl/{}_step", "train/attn_kl/{}_epoch", "val/attn_kl/{}"):
        total, first, last = (metrics[key.format(p)] for p in ("total", "first", "last"))
        assert total == pytest.approx(first + last)


def test_mixin_example():
    import lightning_mixin

    metrics = lightning_mixin.main(max_steps=6, limit_train_batches=3, limit_val_batches=1, **QUIET)
    assert {"train/attn_kl/first_step", "train/attn_kl/first_epoch", "val/attn_kl/first", "train/task_loss"} <= set(metrics)


def test_plain_pytorch_example():
    import plain_pytorch

    out = plain_pytorch.main(max_steps=12)
    assert out["steps"] == 12 and out["attn_kl_last"] < out["attn_kl_first"]  # the student's attention moved


def test_fabric_example():
    import fabric_loop

    out = fabric_loop.main(max_steps=12)
    assert out["weight"] == 5.0 and out["attn_kl_last"] < out["attn_kl_first"]  # the warm-up ended at step 10


def test_hf_trainer_example(tmp_path):
    pytest.importorskip("accelerate")  # transformers.Trainer needs it
    import hf_trainer

    out = hf_trainer.main(max_steps=12, output_dir=str(tmp_path))
    assert out["steps"] == 12 and out["attn_kl_last"] < out["attn_kl_first"]


def test_trl_sft_example(tmp_path):
    pytest.importorskip("trl")
    import trl_sft

    out = trl_sft.main(max_steps=12, output_dir=str(tmp_path))  # padding-free packing
    assert out["steps"] == 12 and out["attn_kl_last"] < out["attn_kl_first"]


@pytest.mark.parametrize("trainer", ["gkd", "distillation"])
def test_trl_gkd_example(tmp_path, trainer):
    pytest.importorskip("trl")
    import trl_gkd

    out = trl_gkd.main(trainer, max_steps=6, output_dir=str(tmp_path))
    assert out["steps"] == 6 and out["attn_kl_last"] < out["attn_kl_first"]


def test_lightning_cli_yaml(tmp_path):
    import lightning_cli

    cli = lightning_cli.main(["fit", "--config", str(EXAMPLES / "lightning_cli.yaml"), "--trainer.max_steps=4",
                              f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false",
                              "--trainer.enable_model_summary=false", "--trainer.limit_val_batches=1",
                              "--trainer.limit_train_batches=2"])
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, StreamKLDistillation)]
    assert callback.config.weight == 5.0 and [p.label for p in callback.config.pairs] == ["first", "last"]
    assert callback.config.pairs[1].weight == 0.5
    assert type(callback.teacher).__name__ == "LlamaForCausalLM" and not callback.teacher.training
    assert {"train/attn_kl/first_step", "train/attn_kl/last_epoch", "val/attn_kl/total"} <= set(cli.trainer.callback_metrics)
    assert (tmp_path / "config.yaml").exists()  # the CLI saved the resolved config, callback included


CLI_TRIALS = {  # issue 34's trials: (change to examples/lightning_cli.yaml, the one line printed)
    "value": (("temperature: 1.0", "temperature: -2"),
              "error: Expected `temperature` to be a finite number > 0, but got -2.0."),
    "choice": (("temperature: 1.0", "temperature: 1.0\n        head_map: grouped"),
               "error: Expected `head_map` to be one of ('error', 'group'), but got 'grouped'."),
    "type": (("temperature: 1.0", "temperature: hot"),
             "error: Expected `temperature` to be a finite number > 0, but got 'hot'."),
    "typo": (("        weight: 5.0", "        wieght: 5.0"),
             "error: Unknown key `wieght` in the StreamKLDistillation arguments. Did you mean `weight`? Valid keys: "),
    "pair typo": (("name: last, weight: 0.5", "name: last, wieght: 0.5"),
                  "error: Unknown key `pairs[1].wieght` in the StreamKL config. Did you mean `pairs[1].weight`?"),
}


@pytest.mark.parametrize("print_config", [False, True], ids=["run", "print_config"])
@pytest.mark.parametrize("trial", sorted(CLI_TRIALS))
def test_lightning_cli_reports_bad_values_with_the_config_message_alone(tmp_path, capsys, trial, print_config):
    """Under plain LightningCLI these gave 60 lines of usage and a union error, or a 99-line chained traceback ending
    in a Namespace dump, and `--print_config` printed `temperature: -2` and exited 0. DistillationCLI prints the
    library's message alone, the same for a run and for `--print_config`."""
    import lightning_cli

    (old, new), expected = CLI_TRIALS[trial]
    text = (EXAMPLES / "lightning_cli.yaml").read_text()
    assert old in text
    (tmp_path / "bad.yaml").write_text(text.replace(old, new))
    args = ["fit", "--config", str(tmp_path / "bad.yaml"), f"--trainer.default_root_dir={tmp_path}"]
    with pytest.raises(SystemExit) as info:
        lightning_cli.main([*args, "--print_config"] if print_config else args)
    captured = capsys.readouterr()
    assert info.value.code == 2 and not captured.out
    assert captured.err.count("\n") == 1 and captured.err.startswith(expected), captured.err


def test_lightning_cli_print_config_prints_a_good_config(capsys):
    import lightning_cli

    with pytest.raises(SystemExit) as info:
        lightning_cli.main(["fit", "--config", str(EXAMPLES / "lightning_cli.yaml"), "--print_config"])
    assert info.value.code in (0, None)
    assert "lightning_streamkl.StreamKLDistillation" in capsys.readouterr().out


def test_lightning_cli_reports_a_constructor_error_of_another_streamkl_class(tmp_path, capsys):
    """Errors raised while the classes are instantiated (classes not checked at parse time) come out the same way."""
    import lightning_cli

    with pytest.raises(SystemExit) as info:
        lightning_cli.main(["fit", "--config", str(EXAMPLES / "lightning_cli.yaml"), "--trainer.max_steps=1",
                            "--trainer.callbacks+=lightning_streamkl.ContinualAttentionRegularizer",
                            "--trainer.callbacks.weight=-1", f"--trainer.default_root_dir={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and err[-1] == "error: Expected `weight` to be a finite number >= 0, but got -1.0."
    assert "Traceback" not in "\n".join(err)


def _blocks(path: Path) -> list[tuple[str, list[str]]]:
    """(example file, code lines) for every code block preceded by an ``<!-- example: FILE -->`` marker."""
    text = path.read_text()
    found = re.findall(r"<!-- example: (\S+) -->\s*```(?:python|yaml)\n(.*?)```", text, flags=re.S)
    return [(f, code.strip("\n").splitlines()) for f, code in found]


@pytest.mark.parametrize("doc", ["docs/guides/lightning.md", "docs/guides/recipes.md", "docs/guides/trl.md"])
def test_documented_code_is_the_example_code(doc):
    """Every line of a marked block is a line of the example file, in the same order (excerpts may skip lines)."""
    blocks = _blocks(ROOT / doc)
    assert blocks, f"{doc} shows no example code"
    for file, lines in blocks:
        source = iter(line.strip() for line in (ROOT / file).read_text().splitlines())
        for shown in (line.strip() for line in lines if line.strip()):
            assert any(line == shown for line in source), f"{doc}: {shown!r} is not (in order) in {file}"


def test_callback_example_with_its_student_model_compiled_logs_the_eager_values():
    """The callback under a ``Trainer`` with the student's Hugging Face model compiled in place (``model.compile()``,
    what ``docs/reliability.md`` advises: Lightning cannot compile a whole module whose ``training_step`` logs): every
    logged value of three steps is the eager run's, and the compiled model's graph does not break."""
    import lightning as L
    import torch
    from lightning_tiny import CausalLMModule, TokenDataModule, tiny_teacher
    from torch._dynamo.utils import counters

    from lightning_streamkl import LayerPair

    def run(compiled: bool) -> dict[str, float]:
        L.seed_everything(0)
        student = CausalLMModule()
        if compiled:
            student.model.compile(backend="aot_eager")
        distill = StreamKLDistillation(tiny_teacher(), pairs=[LayerPair(0, 0, name="first"),
                                                              LayerPair(-1, -1, name="last")], weight=5.0)
        trainer = L.Trainer(max_steps=3, callbacks=[distill], limit_val_batches=0, **QUIET)
        trainer.fit(student, datamodule=TokenDataModule())
        return {k: float(v) for k, v in trainer.callback_metrics.items()}

    eager = run(False)
    torch._dynamo.reset()
    counters.clear()
    compiled = run(True)
    assert dict(counters["graph_break"]) == {} and counters["stats"]["unique_graphs"] >= 1
    assert "train/attn_kl/total_step" in eager and compiled.keys() == eager.keys()
    for key, value in eager.items():
        assert compiled[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
