"""The `streamkl-distill` command: argument handling, built-in configs with omegaconf interpolation, errors with the
config's own messages, and a tiny end-to-end job that writes the whole run directory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("jsonargparse")

from lightning_streamkl.jobs.cli import _normalise_args, builtin_configs, main, run

TINY = ["--trainer.max_steps=6", "--job.teacher_steps=6", "--data.init_args.seq_len=32", "--data.init_args.batch_size=4",
        "--job.teacher_data={batch_size: 4, seq_len: [16, 32]}", "--job.eval_lengths=[16, 32]", "--job.eval_sequences=8",
        "--job.eval_batch_size=4", "--job.kl_eval_sequences=4", "--trainer.enable_progress_bar=false",
        "--model.init_args.d_model=16", "--job.target_max_steps=9"]


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch):
    monkeypatch.setattr("sys.argv", ["streamkl-distill"])  # LightningCLI warns when sys.argv has args too


def printed_config(capsys, *args: str) -> dict:
    with pytest.raises(SystemExit) as info:
        main([*args, "--print_config"])
    assert info.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


def test_normalise_args_inserts_fit_and_resolves_builtin_names(tmp_path):
    assert _normalise_args([]) == ["fit"]
    assert _normalise_args(["--trainer.max_steps=3"]) == ["fit", "--trainer.max_steps=3"]
    assert _normalise_args(["fit", "--config=gpu_long"]) == ["fit", f"--config={builtin_configs()['gpu_long']}"]
    assert _normalise_args(["-c", "gpu_long.yaml"])[2] == str(builtin_configs()["gpu_long"])
    own = tmp_path / "gpu_long"  # an existing file wins over the built-in name
    own.write_text("trainer: {max_steps: 1}")
    assert _normalise_args(["--config", str(own)])[2] == str(own)
    assert _normalise_args(["--help"]) == ["--help"]


def test_default_config_is_loaded_and_interpolated(capsys):
    cfg = printed_config(capsys)
    assert cfg["model"]["class_path"] == "lightning_streamkl.jobs.RecallModel"
    assert cfg["teacher"]["init_args"]["num_heads"] == cfg["model"]["init_args"]["num_heads"] == 4
    assert [p["name"] for p in cfg["distillation"]["pairs"]] == ["layer0", "layer1"]
    assert cfg["job"]["teacher_steps"] == 800 and cfg["trainer"]["max_steps"] == 300


def test_interpolation_follows_overrides_from_files_and_command_line(tmp_path, capsys):
    own = tmp_path / "mine.yaml"
    own.write_text("model:\n  init_args:\n    num_heads: 2\n")
    cfg = printed_config(capsys, "fit", "--config", str(own), "--model.init_args.d_model=32")
    assert cfg["teacher"]["init_args"]["num_heads"] == 2  # ${model.init_args.num_heads}, from the second file
    assert cfg["teacher"]["init_args"]["d_model"] == 32  # ... and from the command line


def test_gpu_long_config_is_long_context_and_parses(capsys):
    cfg = printed_config(capsys, "--config", "gpu_long")
    assert cfg["data"]["init_args"]["seq_len"] >= 16384
    assert cfg["trainer"]["accelerator"] == "gpu" and cfg["trainer"]["precision"] == "bf16-mixed"
    assert max(cfg["job"]["teacher_data"]["seq_len"]) >= 16384
    assert cfg["model"]["class_path"] == "lightning_streamkl.jobs.RecallModel"  # the rest comes from the default


def test_bad_distillation_value_fails_before_training_with_the_config_message(tmp_path):
    with pytest.raises(ValueError, match=r"Expected `temperature` to be a finite number > 0, but got -2.0"):
        main([*TINY, "--distillation.temperature=-2.0", f"--job.run_dir={tmp_path}"])
    assert not (tmp_path / "teacher").exists()  # nothing was trained


BAD_CALLBACK = """
trainer:
  callbacks:
    - class_path: lightning_streamkl.StreamKLDistillation
      init_args:
        teacher: {class_path: torch.nn.MultiheadAttention, init_args: {embed_dim: 8, num_heads: 2}}
        pairs: [[0, 0]]
        temperature: -2.0
"""


@pytest.mark.parametrize("where", ["distillation section", "callback in the trainer section"])
def test_a_bad_value_is_reported_first_in_one_line(tmp_path, monkeypatch, capsys, where):
    """A bad value used to come out at the end of an 81-line jsonargparse traceback (a callback's own error wrapped
    in "Does not validate against any of the Union subtypes"); the command now prints the config's message alone."""
    if where == "distillation section":
        args = ["--distillation.temperature=-2.0"]
    else:
        (tmp_path / "bad.yaml").write_text(BAD_CALLBACK)
        args = ["--config", str(tmp_path / "bad.yaml")]
    monkeypatch.setattr("sys.argv", ["streamkl-distill", *args, *TINY, f"--job.run_dir={tmp_path / 'run'}"])
    with pytest.raises(SystemExit) as info:
        run()
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert errors == ["streamkl-distill: error: Expected `temperature` to be a finite number > 0, but got -2.0."]
    assert not (tmp_path / "run" / "teacher").exists()  # nothing was trained


def test_tiny_job_writes_the_run_directory(tmp_path):
    cli = main([*TINY, f"--job.run_dir={tmp_path}"])
    res = cli.results
    for name in ("report.md", "results.json", "eval.csv", "steps.csv", "config.yaml", "accuracy.png", "attn_kl.png",
                 "accuracy_vs_length.png", "student_kl/metrics.csv"):
        assert (tmp_path / name).is_file(), name
    saved = json.loads((tmp_path / "results.json").read_text())
    assert set(saved["runs"]) == {"teacher", "student_kl", "student_base"}
    # the students trained their budget of 6 steps, then on toward 90% training accuracy up to the cap of 9 steps
    # (a tiny model does not get there); the step-matched comparison uses the weights at step 6
    assert saved["runs"]["teacher"]["steps"] == 6 and saved["setup"]["student_steps"] == 6
    for name in ("student_kl", "student_base"):
        assert saved["runs"][name]["steps"] == 9 and saved["runs"][name]["budget"] == 6
        assert saved["runs"][name]["target"] | {"elapsed_s": None} == {"accuracy": 0.9, "step": None, "elapsed_s": None,
                                                                      "max_steps": 9, "window": 20}
    assert "not within 9 steps" in " ".join(res["outcome"]["summary"])
    assert set(saved["eval"]["accuracy"]["student_base"]) == {"16", "32"}
    assert set(saved["eval"]["attention_kl"]["student_kl"]) == {"layer0", "layer1"}
    assert any("train/attn_kl/layer1" in row for row in saved["runs"]["student_kl"]["history"])
    assert not any("train/attn_kl/layer1" in row for row in saved["runs"]["student_base"]["history"])
    assert saved["naive_loss"]["maps"] == 2 * 2 * 4 * 4 * 4 * 32 * 32  # 2 pairs x 2 maps x B·H·N² x 4 bytes
    assert res["outcome"]["verdict"] in ("helped", "hurt", "no clear difference", "teacher failed")
    report = (tmp_path / "report.md").read_text()
    assert "## Held-out accuracy" in report and "| 32 (training length) |" in report
    assert "## Steps to the target" in report and "| student, without | not reached | – | 9 |" in report
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["trainer"]["max_steps"] == 6
    # both students started from the same weights (the job copies the student before training it)
    assert saved["setup"]["student_params"] == saved["setup"]["teacher_params"]


def test_teacher_checkpoint_is_saved_and_reused(tmp_path):
    first = tmp_path / "first"
    main([*TINY, f"--job.run_dir={first}", "--job.save_teacher=true", "--job.baseline=false", "--job.plots=false"])
    assert (first / "teacher.ckpt").is_file()
    second = tmp_path / "second"
    cli = main([*TINY, f"--job.run_dir={second}", f"--job.teacher_checkpoint={first / 'teacher.ckpt'}",
                "--job.baseline=false", "--job.plots=false"])
    assert "teacher" not in cli.results["runs"] and cli.results["outcome"]["verdict"] in ("no baseline",
                                                                                          "teacher failed")
    a = json.loads((first / "results.json").read_text())["eval"]["accuracy"]["teacher"]
    assert cli.results["eval"]["accuracy"]["teacher"] == {int(k): v for k, v in a.items()}  # the same teacher


SCRIPT = Path(sys.executable).parent / "streamkl-distill"


@pytest.mark.skipif(not SCRIPT.exists(), reason="the console script is not installed next to this Python")
def test_console_script_is_installed(tmp_path):
    out = subprocess.run([str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "fit" in out.stdout and "gpu_long" in out.stdout
    # a whole (tiny) job through the script exits with status 0 (the README's first command relies on it)
    out = subprocess.run([str(SCRIPT), *TINY, f"--job.run_dir={tmp_path / 'run'}", "--job.plots=false"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "run" / "report.md").is_file()


@pytest.mark.parametrize("where", ["distillation section", "callback in the trainer section"])
def test_print_config_checks_the_streamkl_sections(tmp_path, monkeypatch, capsys, where):
    """`--print_config` printed a config with `temperature: -2` and exited 0 (issue 34); it now fails as a run does."""
    if where == "distillation section":
        args = ["--distillation.temperature=-2.0"]
    else:
        (tmp_path / "bad.yaml").write_text(BAD_CALLBACK)
        args = ["--config", str(tmp_path / "bad.yaml")]
    monkeypatch.setattr("sys.argv", ["streamkl-distill", *args, "--print_config"])
    with pytest.raises(SystemExit) as info:
        run()
    captured = capsys.readouterr()
    assert info.value.code == 2 and not captured.out
    assert captured.err.strip() == "streamkl-distill: error: Expected `temperature` to be a finite number > 0, but got -2.0."
