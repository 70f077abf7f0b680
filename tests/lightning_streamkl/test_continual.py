"""ContinualAttentionRegularizer in real Trainer runs: one fit per task, on tiny CPU models (no downloads)."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

pytest.importorskip("transformers")

from lightning_streamkl import ContinualAttentionRegularizer, HFAttentionCapture, StreamKLDistillation
from lightning_streamkl.continual import validate_continual_config
from lightning_streamkl.teacher import borrowed
from streamkl import attention_kl

from ._models import CausalLM, Regressor, loader, tiny_llama, trainer

LAYERS = ["model.layers.0.self_attn", "model.layers.1.self_attn"]


def make_student(seed: int = 1, lr: float = 0.05, optimizer: str = "adam") -> CausalLM:
    return CausalLM(tiny_llama(hidden=16, heads=4, kv_heads=1, layers=2, seed=seed), lr=lr, optimizer=optimizer)


class Recorder(L.Callback):
    """Collects the regulariser's per-step values (``train/<name>/<key>_step``) after every training batch."""

    def __init__(self, name: str = "continual_kl") -> None:
        self.prefix, self.values = f"train/{name}/", []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append({k[len(self.prefix):].removesuffix("_step"): float(v)
                            for k, v in trainer.callback_metrics.items()
                            if k.startswith(self.prefix) and k.endswith("_step")})


def fit(student, reg, data, *extra, **kwargs):
    """One task: one fit call."""
    kwargs.setdefault("max_steps", 3)
    t = trainer(callbacks=[reg, *extra], log_every_n_steps=1, **kwargs)
    t.fit(student, data)
    return t


def snapshot_kl(snapshot, lm, batch, layers=LAYERS):
    """The mean over layers of the mean attention KL(snapshot ‖ model), computed by hand."""
    t_cap, s_cap = HFAttentionCapture(snapshot), HFAttentionCapture(lm)
    with torch.no_grad(), t_cap.recording():
        snapshot(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    with torch.no_grad(), s_cap.recording():
        lm(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    mask = batch["attention_mask"].bool()
    kls = []
    for layer in layers:
        t, s = t_cap.records[layer], s_cap.records[layer]
        kls.append(attention_kl(t.q, t.k, s.q, s.k, causal=True, scale_t=t.scale, scale_s=s.scale,
                                key_padding_mask=mask, query_mask=mask))
    return sum(kls) / len(kls)


# ------------------------------------------------------------------------------------------------ semantics
def test_no_penalty_in_the_first_task_then_a_frozen_snapshot_regularises_the_next():
    student = make_student()
    reg = ContinualAttentionRegularizer(weight=3.0)
    rec = Recorder()
    fit(student, reg, loader(12, 4, seed=0), rec)
    assert student.step_losses == student.task_losses  # first task: nothing added
    assert rec.values == [{}] * 3 and reg.task == 1 and reg.snapshot_tasks == [0]
    assert reg.root == "model" and reg.pair_names == ["layer0", "layer1"]

    snap = reg.snapshots[0]
    assert type(snap).__name__ == "LlamaForCausalLM" and snap is not student.model
    assert not snap.training and not any(p.requires_grad for p in snap.parameters())
    frozen = {k: v.clone() for k, v in snap.state_dict().items()}
    live = {k: v.clone() for k, v in student.model.state_dict().items()}
    assert all(torch.equal(frozen[k], live[k]) for k in frozen)  # a copy of the model at the boundary

    fit(student, reg, loader(12, 4, seed=1), rec, max_steps=4)
    added = [s - t for s, t in zip(student.step_losses[3:], student.task_losses[3:])]
    assert added[0] == 0.0  # the model still equals its snapshot at the first step of the new task
    assert all(a > 0 for a in added[1:])
    for a, logged in zip(added, rec.values[3:]):
        assert a == pytest.approx(3.0 * logged["total"], rel=1e-5, abs=1e-7)
        assert logged["weight"] == 3.0
        assert logged["total"] == pytest.approx((logged["layer0"] + logged["layer1"]) / 2, rel=1e-5, abs=1e-7)
    # the snapshot took no gradient and did not change; the module's step was restored
    assert all(p.grad is None for p in snap.parameters())
    # its forward pass stopped at the last attention layer: what lies past it was dropped, the rest is unchanged
    past = {"model.layers.1.post_attention_layernorm.weight", "model.layers.1.mlp.gate_proj.weight",
            "model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.down_proj.weight", "model.norm.weight",
            "lm_head.weight"}
    assert {k for k, v in snap.state_dict().items() if v.numel() == 0} == past
    assert all(torch.equal(frozen[k], v) for k, v in snap.state_dict().items() if k not in past)
    assert any(not torch.equal(live[k], v) for k, v in student.model.state_dict().items())
    assert "training_step" not in student.__dict__
    assert reg.task == 2 and reg.snapshot_tasks == [1]  # keep=1: the newest only
    assert snap.config._attn_implementation == student.model.config._attn_implementation == "sdpa"


def test_the_added_term_is_the_mean_layer_kl_against_the_snapshot():
    student = make_student(lr=0.0, optimizer="sgd")  # lr 0: the weights seen at each step are known
    # snapshot_trim=False: the check below runs the whole snapshot by hand, head included
    reg = ContinualAttentionRegularizer(weight=0.5, temperature=1.0, snapshot_trim=False)
    snap = reg.snapshot(student)  # an explicit boundary before any fit (e.g. a pretrained model)
    with torch.no_grad():
        for p in student.model.model.layers[0].self_attn.q_proj.parameters():
            p.add_(0.3 * torch.randn_like(p))
    rec = Recorder()
    data = loader(8, 4)
    fit(student, reg, data, rec, max_steps=2)
    for batch, logged, task, step in zip(data, rec.values, student.task_losses, student.step_losses):
        expected = snapshot_kl(snap, student.model, batch)
        assert logged["total"] == pytest.approx(float(expected), rel=1e-5)
        assert step == pytest.approx(task + 0.5 * float(expected), rel=1e-5)
    assert rec.values[0]["layer0"] > 0 and rec.values[0]["layer1"] > 0


def test_weight_schedule_warmup_per_task_and_layer_selection():
    calls = []

    def weight(task, step):
        calls.append((task, step))
        return 2.0 * task

    student = make_student()
    reg = ContinualAttentionRegularizer(weight=weight, warmup_steps=2, layers=[-1])
    assert reg.weight_at(3, 0) == 0.0 and reg.weight_at(3, 1) == 3.0 and reg.weight_at(3, 5) == 6.0
    calls.clear()
    rec = Recorder()
    t = fit(student, reg, loader(12, 4), rec, max_steps=3)
    assert calls == [] and reg.pair_names == ["layer1"]
    # the same Trainer for the next task: global_step goes on, the task's own step count restarts
    t.fit_loop.epoch_loop.max_steps = 6
    t.fit(student, loader(12, 4, seed=2))
    assert calls == [(1, 0), (1, 1), (1, 2)]
    assert [v["weight"] for v in rec.values[3:]] == [0.0, 1.0, 2.0]
    assert set(rec.values[-1]) == {"layer1", "total", "weight"}


def test_several_snapshots_with_weights():
    student = make_student()
    reg = ContinualAttentionRegularizer(keep=2, snapshot_weights=[0.75, 0.25])
    rec = Recorder()
    for task in range(3):
        fit(student, reg, loader(12, 4, seed=task), rec, max_steps=2)
    assert reg.snapshot_tasks == [1, 2] and reg.task == 3
    assert reg.snapshots[0] is not reg.snapshots[1]
    # task 2 was regularised toward the snapshots of tasks 0 (0.25, older) and 1 (0.75, newer)
    for logged in rec.values[4:]:
        assert logged["total"] == pytest.approx(0.75 * logged["task1"] + 0.25 * logged["task0"], rel=1e-5, abs=1e-7)
    assert rec.values[5]["task0"] > 0 and rec.values[5]["task1"] > 0

    keep_all = ContinualAttentionRegularizer(keep=None)
    for _ in range(3):
        keep_all.snapshot(student)
    assert keep_all.snapshot_tasks == [0, 1, 2]


def test_borrowed_copy_puts_the_host_tensors_back():
    """The offload mechanism: converted copies inside the block (float64 here, where a GPU run moves to the device),
    the very same host tensors afterwards."""
    module = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).eval()  # a snapshot is in eval mode
    host = {name: (t.data_ptr(), t.clone()) for name, t in module.state_dict().items()}
    with borrowed(module, torch.device("cpu"), torch.float64):
        x = module(torch.randn(5, 3, dtype=torch.float64))
        assert x.dtype == torch.float64 and module[0].weight.dtype == torch.float64
        assert module[1].num_batches_tracked.dtype == torch.long  # integer buffers keep their dtype
    for name, t in module.state_dict().items():
        assert t.data_ptr() == host[name][0] and torch.equal(t, host[name][1])
    assert module[0].weight.dtype == torch.float32


# ------------------------------------------------------------------------------------------------ checkpoints
def test_checkpoint_round_trip_and_resume_mid_task(tmp_path):
    def run(max_epochs, ckpt=None, *, first_task=True, save_dir=None):
        torch.manual_seed(0)
        student = make_student(lr=0.01)
        reg = ContinualAttentionRegularizer(weight=2.0, warmup_steps=3)
        if first_task:
            fit(student, reg, loader(8, 4, seed=5), max_steps=2)
        extra = dict(max_epochs=max_epochs, max_steps=-1)
        callbacks = []
        if save_dir is not None:
            callbacks.append(ModelCheckpoint(dirpath=save_dir, save_top_k=-1, every_n_epochs=1))
            extra["enable_checkpointing"] = True
        t = trainer(callbacks=[reg, *callbacks], **extra)
        start = len(student.step_losses)
        t.fit(student, loader(4, 2), ckpt_path=ckpt)
        return student.step_losses[start:], reg

    full, _ = run(3)
    first, reg = run(1, save_dir=tmp_path)
    assert first == full[:2]
    path = tmp_path / "epoch=0-step=2.ckpt"
    state = torch.load(path, weights_only=True)["callbacks"][reg.state_key]
    assert {k: v for k, v in state.items() if k != "snapshots"} == {
        "version": 1, "name": "continual_kl", "module": "model", "layers": ["layer0", "layer1"], "task": 1,
        "task_start_step": 0, "train_batches": 2}
    [saved] = state["snapshots"]
    assert saved["task"] == 0

    # a fresh process: new model, new callback, no first task; everything comes from the checkpoint
    resumed, reg2 = run(3, ckpt=str(path), first_task=False)
    assert len(resumed) == 4
    assert resumed == pytest.approx(full[2:], rel=1e-6, abs=1e-7)
    assert reg2.task == 2 and reg2.snapshot_tasks == [1]  # task 1 finished: its own snapshot replaced task 0's

    # the round trip itself: load the saved state, rebuild the snapshot from the live module's structure
    reg3 = ContinualAttentionRegularizer()
    reg3.load_state_dict(state)
    assert reg3.snapshots == [] and reg3.snapshot_tasks == [0]
    assert reg3.state_dict()["snapshots"][0]["state_dict"].keys() == saved["state_dict"].keys()
    reg3._materialise(make_student(seed=7))
    rebuilt = reg3.snapshots[0].state_dict()
    assert all(torch.equal(rebuilt[k], v) for k, v in saved["state_dict"].items())
    assert not any(p.requires_grad for p in reg3.snapshots[0].parameters())


# ------------------------------------------------------------------------------------------------ plain PyTorch
def regression_data(seed: int):
    g = torch.Generator().manual_seed(seed)
    data = torch.utils.data.TensorDataset(torch.randn(24, 6, 16, generator=g), torch.randn(24, 6, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=8)


@pytest.mark.parametrize("kind", ["mha", "recorder"])
def test_plain_pytorch_models(kind):
    model = Regressor(kind, seed=0)
    layers = None if kind == "mha" else ["encoder.0", "1"]  # paths relative to the LightningModule or to `module`
    reg = ContinualAttentionRegularizer(layers=layers, module=None if kind == "mha" else "encoder")
    fit(model, reg, regression_data(0))
    fit(model, reg, regression_data(1), max_steps=4)
    assert reg.root == "encoder" and reg._probe.kind == kind
    assert reg.pair_names == (["layer0", "layer1"] if kind == "mha" else ["encoder.0", "encoder.1"])
    added = [s - t for s, t in zip(model.step_losses[3:], model.task_losses[3:])]
    assert added[0] == pytest.approx(0.0, abs=1e-7) and all(a > 0 for a in added[1:])


def test_whole_lightning_module_snapshot_with_forward():
    class WithForward(Regressor):
        def forward(self, x):
            return self.head(self.encoder(x))

    model = WithForward("mha", seed=0)
    reg = ContinualAttentionRegularizer(module="")
    fit(model, reg, regression_data(0), max_steps=2)
    snap = reg.snapshots[0]
    assert type(snap) is WithForward and snap._trainer is None and "training_step" not in snap.__dict__
    fit(model, reg, regression_data(1), max_steps=3)
    assert model.step_losses[-1] > model.task_losses[-1]


def test_validation_logs_the_divergence_from_the_snapshot():
    student = make_student()
    reg = ContinualAttentionRegularizer(log_on_step=False)
    fit(student, reg, loader(8, 4), max_steps=2)
    t = trainer(max_steps=2, limit_val_batches=None, callbacks=[reg])
    t.fit(student, loader(8, 4, seed=1), loader(8, 4, seed=3))
    assert {"val/continual_kl/layer0", "val/continual_kl/total", "train/continual_kl/total_epoch"} <= \
        set(t.callback_metrics)
    assert float(t.callback_metrics["val/continual_kl/total"]) > 0
    before = reg.task
    trainer(limit_val_batches=None, callbacks=[reg]).validate(student, loader(8, 4, seed=3), verbose=False)
    assert reg.task == before  # validate is no task boundary


def test_coexists_with_a_distillation_callback():
    student = make_student()
    reg = ContinualAttentionRegularizer(weight=2.0)
    fit(student, reg, loader(8, 4), max_steps=2)
    teacher = tiny_llama(hidden=32, heads=4, kv_heads=2, layers=2, seed=0, init=0.3)
    distill = StreamKLDistillation(teacher, pairs=[[-1, -1]])
    rec, rec_d = Recorder(), Recorder("attn_kl")
    fit(student, reg, loader(8, 4, seed=1), distill, rec, rec_d, max_steps=3)
    for task, step, a, b in zip(student.task_losses[2:], student.step_losses[2:], rec.values, rec_d.values):
        assert step == pytest.approx(task + 2.0 * a["total"] + b["total"], rel=1e-5)


# ------------------------------------------------------------------------------------------------ errors
def test_a_model_whose_attention_cannot_be_captured_fails_in_setup():
    with pytest.raises(ValueError, match=r"found no attention layer it can capture in Regressor.*record\(self, q, k"):
        fit(Regressor("custom", report=False, seed=0), ContinualAttentionRegularizer(), regression_data(0))


def test_layers_that_never_record_fail_at_the_first_step_of_the_first_task():
    reg = ContinualAttentionRegularizer(layers=["encoder.0", "encoder.1"])
    with pytest.raises(ValueError, match=r"layers \['encoder.0', 'encoder.1'\] recorded no queries and keys during the "
                                         r"first training step \(recorded: \[\]\)"):
        fit(Regressor("custom", report=False, seed=0), reg, regression_data(0))
    assert reg.task == 0  # no boundary after a failed fit


def test_unknown_layers_and_modules_fail_with_close_matches():
    with pytest.raises(ValueError, match=r"Unknown layer layers\[0\].*Closest: \['model.model.layers.0.self_attn'"):
        ContinualAttentionRegularizer(layers=["model.model.layer.0.self_attn"]).snapshot(make_student())
    with pytest.raises(ValueError, match=r"index 5 is out of range"):
        ContinualAttentionRegularizer(layers=[5]).snapshot(make_student())
    with pytest.raises(ValueError, match=r"no 'modle'\. Closest: \['model'"):
        ContinualAttentionRegularizer(module="modle").snapshot(make_student())
    with pytest.raises(ValueError, match=r"module=''.*defines no forward\(\)"):
        ContinualAttentionRegularizer(module="").snapshot(make_student())
    with pytest.raises(ValueError, match=r"outside the snapshotted submodule 'model.lm_head'"):
        ContinualAttentionRegularizer(module="model.lm_head").snapshot(make_student())


@pytest.mark.parametrize(("options", "error", "message"), [
    ({"keep": 0}, ValueError, r"Expected `keep` to be an int >= 1 or None, but got 0\."),
    ({"keep": 1.5}, TypeError, r"Expected `keep` to be an int >= 1 or None"),
    ({"keep": 3, "snapshot_weights": [1.0, 0.5]}, ValueError, r"one weight per kept snapshot \(`keep` = 3\), but got 2"),
    ({"keep": 2, "snapshot_weights": [0, 0]}, ValueError, r"at least one of `snapshot_weights` to be > 0"),
    ({"snapshot_device": "gpu"}, ValueError, r"`snapshot_device` to be one of \('same', 'cpu'\), but got 'gpu'"),
    ({"weight": -1.0}, ValueError, r"`weight` to be a finite number >= 0, but got -1\.0"),
    ({"temperature": 0}, ValueError, r"`temperature` to be a finite number > 0"),
    ({"layers": [0, 0]}, ValueError, r"`layers` to name each layer once"),
    ({"layers": [1.5]}, TypeError, r"`layers\[0\]` to be a layer index"),
    ({"capture": "flash"}, ValueError, r"`capture` to be one of \('auto', 'hf', 'mha', 'recorder'\), but got 'flash'"),
])
def test_bad_options_fail_in_the_constructor_and_from_yaml(options, error, message):
    with pytest.raises(error, match=message):
        ContinualAttentionRegularizer(**options)
    if error is ValueError:
        import yaml

        with pytest.raises(error, match=message):
            ContinualAttentionRegularizer.from_config(yaml.safe_dump(options))


def test_config_round_trip_and_unknown_keys():
    cfg = validate_continual_config("keep: 2\nsnapshot_weights: [0.5, 0.5]\nsnapshot_device: cpu\nlayers: [0, -1]")
    assert ContinualAttentionRegularizer.from_config(cfg).config == cfg
    with pytest.raises(ValueError, match=r"Unknown key `snapshot_weight`.*Did you mean `snapshot_weights`"):
        validate_continual_config({"snapshot_weight": [1.0]})
    with pytest.raises(ValueError, match=r"`weight\(1, 0\)` to return a finite number >= 0, but got nan"):
        ContinualAttentionRegularizer(weight=lambda task, step: float("nan")).weight_at(1, 0)


def test_trainer_conflicts_and_misuse_are_rejected():
    """With Lightning's real strategies (FSDP needs CUDA to run, so its real object is handed to ``setup``)."""
    from lightning.pytorch.strategies import FSDPStrategy

    reg = ContinualAttentionRegularizer()
    spawn = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", logger=False, enable_progress_bar=False)
    with pytest.raises(MisconfigurationException, match=r"spawning strategy \(DDPStrategy, e.g. 'ddp_spawn'\).*"
                                                        r"strategy='ddp'"):
        reg.setup(spawn, make_student(), "fit")
    with pytest.raises(MisconfigurationException, match="ContinualAttentionRegularizer does not support the FSDPStrategy"):
        reg.setup(SimpleNamespace(strategy=FSDPStrategy()), make_student(), "fit")

    class Manual(CausalLM):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            self.manual_backward(self.model(**batch).loss)

    with pytest.raises(MisconfigurationException, match=r"adds its term to the loss returned by training_step, which "
                                                        r"manual optimization ignores\.$"):
        fit(Manual(), ContinualAttentionRegularizer(), loader(4, 4))
    clash = [ContinualAttentionRegularizer(), ContinualAttentionRegularizer()]
    with pytest.raises(RuntimeError, match="state_key` must be unique"):  # the name is the state key
        trainer(max_steps=1, callbacks=clash)

    class SnapshotInsideTheStep(CausalLM):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            reg.snapshot(self)
            return loss

    reg = ContinualAttentionRegularizer()
    with pytest.raises(RuntimeError, match=r"snapshot\(\) was called while attention is being captured"):
        fit(SnapshotInsideTheStep(), reg, loader(4, 4))


# ------------------------------------------------------------------------------------------------ docs
def test_the_guide_quick_start_runs(capsys):
    """The quick-start block of docs/guides/continual.md runs as written and prints what its comment says."""
    import pathlib
    import re

    guide = pathlib.Path(__file__).parents[2] / "docs" / "guides" / "continual.md"
    text = guide.read_text()
    marker = "<!-- tested: tests/lightning_streamkl/test_continual.py::test_the_guide_quick_start_runs -->"
    code = re.search(re.escape(marker) + r"\s*```python\n(.*?)```", text, re.S).group(1)
    exec(compile(code, str(guide), "exec"), {"__name__": "guide"})
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    expected = re.search(r"print\(.*\)\s*#\s*(.*)", code).group(1).strip()
    assert printed == expected


# ------------------------------------------------------------------------------------------------ snapshot inputs
class Embedded(L.LightningModule):
    """The LightningModule embeds (token ids) or projects (floats) before the submodule that holds the attention
    layers; at lr = 0 the model equals its snapshot, so the regulariser's KL must be 0."""

    def __init__(self, front: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.front = nn.Embedding(50, 16) if front == "embedding" else nn.Linear(16, 16)
        layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 1)
        with torch.no_grad():  # peaked attention, so that feeding the snapshot the wrong input shows in the KL
            for p in self.encoder.parameters():
                p.mul_(4.0)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.head(self.encoder(self.front(x))).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize("front", ["embedding", "projection"])
def test_the_snapshot_sees_what_its_live_counterpart_sees(front):
    """The snapshot (here the `encoder` submodule) used to be fed `batch[0]`, the raw input of the LightningModule:
    with token ids in front of an embedding it crashed ("mat1 and mat2 must have the same dtype"), behind a float
    projection it was silently wrong (KL 2.25 and 0.22 at lr = 0). It now gets exactly the inputs the live encoder
    receives in the step, so at lr = 0 the logged KL is 0."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 50, (16, 6), generator=g) if front == "embedding" else torch.randn(16, 6, 16, generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.randn(16, 6, generator=g)),
                                       batch_size=4)
    model, reg, rec = Embedded(front), ContinualAttentionRegularizer(), Recorder()
    fit(model, reg, data, max_steps=2)
    fit(model, reg, data, rec, max_steps=4)
    assert reg.root == "encoder" and len(rec.values) == 4
    for logged in rec.values:
        assert logged["total"] <= 1e-6 and logged["layer0"] <= 1e-6 and logged["layer1"] <= 1e-6, logged
