"""The callback and the mixin under Lightning's sharded strategies on 2 CPU processes (gloo), against DDP.

Lightning's ``FSDPStrategy`` (FSDP1; :class:`~tests.lightning_streamkl._distributed.CPUFSDPStrategy` only names the
CPU as FSDP's device) and ``ModelParallelStrategy`` (FSDP2 ``fully_shard`` in ``configure_model``) shard the
student; the teacher is sharded over the same processes with FSDP2 (``teacher_sharding="auto"``) or replicated
(``"replicate"``). Every run trains the same student from the same weights on the same global batch; the loss each
process backpropagates, the gradients (unsharded), the parameters after every step, the metric state and the logged
epoch values equal the DDP run's (float32, reduction orders differ). Sharded checkpoints (FSDP ``"sharded"``, the
model-parallel distributed checkpoint) hold the callback's state and resume to the uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader

pytest.importorskip("transformers")

from lightning_streamkl import AttentionDistillationMixin, ContinualAttentionRegularizer, StreamKLDistillation
from lightning_streamkl.adapter import check_strategy, place_teacher

from ._distributed import CPUFSDPStrategy, full_state, run_and_collect
from ._models import tiny_llama
from .test_callback import make_teacher
from .test_ddp import PAIRS, ROWS_PER_PROCESS, STEPS, WORLD, DtypeLossLM, GlobalBatches

RTOL, ATOL = 1e-5, 1e-6


def _student(cls: type = DtypeLossLM, **kwargs) -> L.LightningModule:
    return cls(tiny_llama(hidden=16, heads=4, kv_heads=1, layers=2, seed=1), **{"lr": 0.5, **kwargs})


class FSDP2LM(DtypeLossLM):
    """The student sharded with FSDP2 in ``configure_model``: each decoder layer, then the whole model."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class MixinLM(AttentionDistillationMixin, DtypeLossLM):
    """The same student distilled through the mixin (the term the callback would add, added by hand)."""

    def __init__(self, model, lr):
        super().__init__(model, lr=lr)
        self.configure_attention_distillation(make_teacher(), pairs=PAIRS)

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) + self.attention_distillation_loss()


def _fsdp(accelerator: str = "cpu", **kwargs) -> FSDPStrategy:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    cls = CPUFSDPStrategy if accelerator == "cpu" else FSDPStrategy
    return cls(auto_wrap_policy={LlamaDecoderLayer}, **kwargs)


def _ddp(accelerator: str = "cpu") -> DDPStrategy:
    return DDPStrategy()


def _model_parallel(accelerator: str = "cpu", **kwargs) -> ModelParallelStrategy:
    return ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1, **kwargs)


def user_sharded_teacher() -> torch.nn.Module:
    """The teacher sharded by the user with FSDP2 before the fit, over a process group the user started (as under
    ``torchrun``; Lightning then joins that group)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
    teacher, mesh = make_teacher(), init_device_mesh("cpu", (WORLD,))
    for layer in teacher.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(teacher, mesh=mesh)


#: name -> (strategy factory, student class, callback options or None for the mixin); an option "teacher" is the
#: factory of the teacher (default: :func:`make_teacher`)
VARIANTS = {
    "ddp": (_ddp, DtypeLossLM, {}),
    "ddp+sharded teacher": (_ddp, DtypeLossLM, {"teacher_sharding": "shard"}),
    "fsdp": (_fsdp, DtypeLossLM, {}),
    "fsdp+replicated teacher": (_fsdp, DtypeLossLM, {"teacher_sharding": "replicate"}),
    "fsdp2": (_model_parallel, FSDP2LM, {}),
    "fsdp mixin": (_fsdp, MixinLM, None),
    "fsdp2 mixin": (_model_parallel, type("FSDP2MixinLM", (MixinLM,), {"configure_model": FSDP2LM.configure_model}),
                    None),
    # last: the first of them starts the process group, which the later fits of the same process join
    "ddp+user-sharded teacher": (_ddp, DtypeLossLM, {"teacher": user_sharded_teacher}),
    "fsdp+user-sharded teacher": (_fsdp, DtypeLossLM, {"teacher": user_sharded_teacher}),
}


class Probe(L.Callback):
    """Per step: the loss this process backpropagates, the unsharded gradients and parameters, the local metric
    state; at the end, the logged epoch values and how much of the teacher this process holds."""

    def __init__(self) -> None:
        self.record: dict[str, list] = {"loss": [], "grads": [], "params": [], "metric": []}

    def on_before_backward(self, trainer, pl_module, loss):
        self.record["loss"].append(float(loss.detach()))

    def on_after_backward(self, trainer, pl_module):
        self.record["grads"].append(full_state(trainer, pl_module, grads=True))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from torch.distributed.tensor import DTensor

        self.record["params"].append(full_state(trainer, pl_module, grads=False))
        metric = _metric(trainer, pl_module)
        self.record["metric"].append((float(metric.kl_sum.sum()), float(metric.rows.sum())))
        # a sharded teacher stopped inside its last block (early exit) is resharded: every parameter is a shard again
        params = list(_distiller(trainer, pl_module).teacher_module.parameters())
        self.record.setdefault("teacher_resharded", []).append(all(isinstance(p, DTensor) for p in params))

    def on_train_end(self, trainer, pl_module):
        self.record["logged"] = {k: float(v) for k, v in trainer.callback_metrics.items() if "attn_kl" in k}
        teacher = _distiller(trainer, pl_module).teacher_module
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in teacher.parameters())
        self.record["teacher_share"] = local / sum(p.numel() for p in teacher.parameters())
        self.record["shards"] = _distiller(trainer, pl_module).teacher.shards


def _distiller(trainer, pl_module):
    callback = next((c for c in trainer.callbacks if isinstance(c, StreamKLDistillation)), None)
    return callback.distiller if callback is not None else pl_module._streamkl


def _metric(trainer, pl_module):
    callback = next((c for c in trainer.callbacks if isinstance(c, StreamKLDistillation)), None)
    return callback.train_metric if callback is not None else pl_module.train_attention_kl


def _trainer(strategy, callbacks, **kwargs) -> L.Trainer:
    defaults = dict(accelerator="cpu", devices=WORLD, max_steps=STEPS, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, enable_checkpointing=False)
    return L.Trainer(strategy=strategy, callbacks=callbacks, **{**defaults, **kwargs})


def _fit(name: str, accelerator: str = "cpu", precision: str = "32-true") -> dict:
    make_strategy, cls, options = VARIANTS[name]
    torch.manual_seed(0)
    student = _student(cls)
    probe = Probe()
    if options is not None:
        options = dict(options)
        teacher = options.pop("teacher", make_teacher)()
    callbacks = [probe] if options is None else [StreamKLDistillation(teacher, pairs=PAIRS, **options), probe]
    trainer = _trainer(make_strategy(accelerator), callbacks, accelerator=accelerator, precision=precision)
    trainer.fit(student, DataLoader(GlobalBatches(), batch_size=ROWS_PER_PROCESS))
    return probe.record


def _equivalence_worker(rank: int, out: str, names: list[str], accelerator: str = "cpu",
                        precision: str = "32-true") -> None:
    torch.save({name: _fit(name, accelerator, precision) for name in names}, Path(out) / f"rank{rank}.pt")


def _assert_state_close(a: dict, b: dict, what: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    assert a.keys() == b.keys(), (what, sorted(set(a) ^ set(b)))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{what} {k}: {m}")


def _assert_matches_ddp(ranks: list[dict], name: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    for rank, record in enumerate(ranks):
        ddp, run = record["ddp"], record[name]
        assert run["loss"] == pytest.approx(ddp["loss"], rel=rtol), (name, rank)
        for step in range(STEPS):
            where = f"{name} rank {rank} step {step}"
            _assert_state_close(run["grads"][step], ddp["grads"][step], f"{where} grad", rtol, atol)
            _assert_state_close(run["params"][step], ddp["params"][step], f"{where} param", rtol, atol)
            assert run["metric"][step] == pytest.approx(ddp["metric"][step], rel=rtol), (name, rank, step)
        assert run["logged"].keys() == ddp["logged"].keys() and run["logged"]
        assert run["logged"] == pytest.approx(ddp["logged"], rel=rtol), name


@pytest.mark.timeout(240)
def test_sharded_strategies_match_ddp_on_the_same_global_batch():
    """FSDP (teacher sharded or replicated), FSDP2 through ModelParallelStrategy, the mixin under both, DDP with
    a sharded teacher, and a teacher the user sharded with ``fully_shard`` under DDP and FSDP: loss, gradients,
    parameters after each step, metric and logged values equal DDP's; a sharded teacher holds half of its weights on
    each process, a replicated one all of them, and a sharded one is resharded after every step's early exit."""
    ranks = run_and_collect(_equivalence_worker, WORLD, list(VARIANTS))
    for name in VARIANTS:
        if name != "ddp":
            _assert_matches_ddp(ranks, name)
    for record in ranks:
        shares = {name: record[name]["teacher_share"] for name in VARIANTS}
        assert shares == pytest.approx({"ddp": 1.0, "ddp+sharded teacher": 0.5, "fsdp": 0.5,
                                        "fsdp+replicated teacher": 1.0, "fsdp2": 0.5, "fsdp mixin": 0.5,
                                        "fsdp2 mixin": 0.5, "ddp+user-sharded teacher": 0.5,
                                        "fsdp+user-sharded teacher": 0.5}, abs=0.02), shares
        for name, share in shares.items():
            assert record[name]["teacher_resharded"] == [share < 1] * STEPS, name
            assert record[name]["shards"] == (WORLD if share < 1 else 1), name


@pytest.mark.gpu
@pytest.mark.multi_gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("precision", "rtol"), [("32-true", 1e-4), ("bf16-mixed", 2e-2)])
def test_sharded_strategies_match_ddp_on_two_gpus(capsys, precision, rtol):
    """The same on 2 GPUs (NCCL, Lightning's own FSDPStrategy; the Triton kernels compute the KL): in float32, and in
    ``bf16-mixed``, where the captured queries and keys reach the op in bf16 under every strategy (the tolerance is
    bf16's: the strategies reduce gradients in different orders)."""
    names = ["ddp", "fsdp", "fsdp+replicated teacher", "fsdp2", "fsdp mixin"]
    ranks = run_and_collect(_equivalence_worker, WORLD, names, "gpu", precision, start_method="spawn")
    for name in names[1:]:
        _assert_matches_ddp(ranks, name, rtol=rtol, atol=rtol / 10)
    with capsys.disabled():
        print(f"\nFSDP/FSDP2 vs DDP on 2 GPUs, {precision}: {', '.join(names[1:])} match (rtol {rtol:g}); teacher "
              f"share per GPU { {n: ranks[0][n]['teacher_share'] for n in names} }")


# ---------------------------------------------------------------------------------------------- checkpoints
RESUME_STEPS, EPOCH_STEPS = 4, 2  # 8 rows, 2 per process and step: 2 steps per epoch


def _resume_worker(rank: int, out: str, names: list[str]) -> None:
    """Per strategy: an uninterrupted run writing a sharded checkpoint every step, then a run resumed from the
    checkpoint at the end of the first epoch."""
    result = {}
    for name in names:
        make_strategy, cls, _ = VARIANTS[name]
        strategy_kwargs = {"state_dict_type": "sharded"} if name == "fsdp" else {}
        data = torch.utils.data.Subset(GlobalBatches(), range(EPOCH_STEPS * WORLD * ROWS_PER_PROCESS))
        runs = {}
        for run in ("full", "resumed"):
            torch.manual_seed(0)
            # Adam: FSDP's sharded optimizer checkpoint cannot load an empty optimizer state (plain SGD has none)
            student, probe = _student(cls, lr=0.01, optimizer="adam"), Probe()
            callback = StreamKLDistillation(make_teacher(), pairs=PAIRS)
            ckpt = ModelCheckpoint(dirpath=Path(out) / name, every_n_train_steps=1, save_top_k=-1)
            trainer = _trainer(make_strategy("cpu", **strategy_kwargs), [callback, probe] + ([ckpt] if run == "full" else []),
                               max_steps=RESUME_STEPS, enable_checkpointing=run == "full")
            path = None if run == "full" else next((Path(out) / name).glob(f"*step={EPOCH_STEPS}.ckpt"))
            trainer.fit(student, DataLoader(data, batch_size=ROWS_PER_PROCESS), ckpt_path=path)
            runs[run] = {**probe.record, "batches": callback._train_batches}
        if rank == 0:
            runs["saved"] = {}
            for path in sorted((Path(out) / name).glob("*.ckpt")):
                meta = path / "meta.pt" if path.is_dir() else path
                state = torch.load(meta, weights_only=False)["callbacks"]
                runs["saved"][path.name] = next(v for k, v in state.items() if k.startswith("StreamKLDistillation"))
            runs["kinds"] = sorted("dir" if p.is_dir() else "file" for p in (Path(out) / name).glob("*.ckpt"))
        result[name] = runs
    torch.save(result, Path(out) / f"rank{rank}.pt")


@pytest.mark.timeout(240)
def test_sharded_checkpoints_save_and_resume_with_the_callback_state():
    """FSDP's sharded checkpoint and ModelParallelStrategy's distributed checkpoint (directories) hold the callback's
    state: its batch count, and the metric's epoch-so-far sums over both processes (zero at an epoch's end, as
    under DDP). A run resumed from the first epoch's end reaches the uninterrupted run's parameters and logged
    values, and counts the same batches."""
    ranks = run_and_collect(_resume_worker, WORLD, ["fsdp", "fsdp2"])
    for name in ("fsdp", "fsdp2"):
        saved = ranks[0][name]["saved"]
        assert ranks[0][name]["kinds"] == ["dir"] * RESUME_STEPS, name
        full_metric = [sum(r[name]["full"]["metric"][s][0] for r in ranks) for s in range(RESUME_STEPS)]
        for step in range(1, RESUME_STEPS + 1):
            state = next(v for k, v in saved.items() if f"step={step}.ckpt" in k)
            assert state["train_batches"] == step and state["pairs"] == ["last", "first"]
            expected = 0.0 if step % EPOCH_STEPS == 0 else full_metric[step - 1]
            assert float(state["train_metric"]["kl_sum"].sum()) == pytest.approx(expected, rel=RTOL), (name, step)
        for record in ranks:
            full, resumed = record[name]["full"], record[name]["resumed"]
            assert resumed["batches"] == full["batches"] == RESUME_STEPS
            _assert_state_close(resumed["params"][-1], full["params"][-1], f"{name} resumed params")
            assert resumed["loss"] == pytest.approx(full["loss"][EPOCH_STEPS:], rel=RTOL)
            assert resumed["logged"] == pytest.approx(full["logged"], rel=RTOL)


def _user_sharded_worker(rank: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_streamkl.teacher import FrozenTeacher

    module, result = user_sharded_teacher(), {}
    # as on a machine with a GPU, where offloading pins the host copies: a DTensor cannot be pinned (NotImplementedError
    # from aten.is_pinned); the refusal must come before any move
    torch.cuda.is_available = lambda: True
    for name, kwargs in (("offload", {"device": "offload"}), ("device", {"device": "cpu"})):
        with pytest.raises(ValueError) as info:
            FrozenTeacher(module, **kwargs).sharded()
        result[name] = str(info.value)
    teacher = FrozenTeacher(module)
    result["same"] = teacher.shard(init_device_mesh("cpu", (WORLD,))) is module
    result["shards"] = teacher.shards
    torch.save(result, Path(out) / f"rank{rank}.pt")


def test_a_teacher_the_user_sharded_is_kept_and_refuses_another_placement():
    """A teacher sharded with ``fully_shard`` before it is passed is not sharded again (its process count read from
    its parameters), and refuses ``teacher_device="offload"`` and a named device, which contradict its shards'
    placement."""
    for record in run_and_collect(_user_sharded_worker, WORLD):
        assert record["same"] and record["shards"] == WORLD
        assert "teacher_device='offload' contradicts; use teacher_device='student' (the default), or pass the " \
               "teacher unsharded" in record["offload"]
        assert "teacher_device='cpu' contradicts" in record["device"]


# ---------------------------------------------------------------------------------------------- refusals
def test_deepspeed_and_xla_fsdp_are_rejected_by_every_adapter():
    """DeepSpeed is not installed here, so its strategy is an instance made without its __init__; XLA's FSDP is a
    Fabric strategy (the Trainer has none), recognised by its class name like any subclass."""
    subclass = type("MyDeepSpeed", (DeepSpeedStrategy,), {})
    xla_fsdp = type("XLAFSDPStrategy", (), {})()
    for strategy in (DeepSpeedStrategy.__new__(DeepSpeedStrategy), subclass.__new__(subclass), xla_fsdp):
        name = type(strategy).__name__
        for who, sharding in (("StreamKLDistillation", True), ("MyModule (AttentionDistillationMixin)", True),
                              ("ContinualAttentionRegularizer", False)):
            with pytest.raises(MisconfigurationException, match=rf"{who.split()[0]}.* does not support the {name} "
                                                                r"strategy: DeepSpeed and XLA's FSDP are not tested"):
                check_strategy(who, SimpleNamespace(strategy=strategy), sharding=sharding)


def test_continual_rejects_sharded_strategies_and_tensor_parallelism_is_rejected():
    cb = ContinualAttentionRegularizer()
    for strategy in (FSDPStrategy(), ModelParallelStrategy()):
        with pytest.raises(MisconfigurationException, match=r"copies the student's own modules into snapshots"):
            cb.setup(SimpleNamespace(strategy=strategy), _student(), "fit")
    tensor_parallel = ModelParallelStrategy()
    tensor_parallel._device_mesh = {"tensor_parallel": SimpleNamespace(size=lambda: 2)}
    with pytest.raises(MisconfigurationException, match=r"tensor parallelism \(tensor_parallel_size=2\).*"
                                                        r"tensor_parallel_size=1"):
        check_strategy("StreamKLDistillation", SimpleNamespace(strategy=tensor_parallel), sharding=True)


def test_a_teacher_inside_the_lightning_module_is_not_sharded_on_its_own():
    student = _student()
    student.teacher = make_teacher()
    callback = StreamKLDistillation(student.teacher, pairs=PAIRS)
    callback.distiller.setup(student)
    trainer = SimpleNamespace(world_size=2, strategy=FSDPStrategy())
    with pytest.raises(MisconfigurationException, match=r"is a submodule of DtypeLossLM.*keep it out of the "
                                                        r"LightningModule"):
        place_teacher(trainer, student, callback.distiller)


def test_multi_process_tests_spawn_once_cuda_is_initialised(monkeypatch):
    """A forked process cannot use CUDA once the parent initialised it, which any GPU test earlier in the same pytest
    run does: the processes are then spawned."""
    from ._distributed import start_method_for

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert start_method_for() == "fork" and start_method_for("spawn") == "spawn"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert start_method_for() == "spawn"
