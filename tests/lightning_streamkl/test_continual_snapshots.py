"""What continual-learning practice needs from the regulariser's snapshots: they stop at the deepest regularised layer
and hold nothing past it (no head, no logits), layers can be weighed, and what a snapshot holds is measured."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_streamkl import ContinualAttentionRegularizer
from lightning_streamkl.continual.snapshots import FirstPass, tensor_bytes

from ._models import Regressor, trainer


class WithForward(Regressor):
    """The Regressor (two post-norm nn.TransformerEncoderLayer, a linear head) with a forward: a whole-module
    snapshot (``module=""``) then carries the head."""

    def forward(self, x):
        return self.head(self.encoder(x))


def data(seed: int, n: int = 16):
    g = torch.Generator().manual_seed(seed)
    dataset = torch.utils.data.TensorDataset(torch.randn(n, 6, 16, generator=g), torch.randn(n, 6, generator=g))
    return torch.utils.data.DataLoader(dataset, batch_size=8)


def two_tasks(model, reg, steps=(2, 3)):
    """One fit per task; the step losses of each."""
    losses = []
    for task, n in enumerate(steps):
        start = len(model.step_losses)
        trainer(max_steps=n, callbacks=[reg]).fit(model, data(task))
        losses.append(model.step_losses[start:])
    return losses


def test_the_snapshot_stops_at_the_deepest_regularised_layer_and_drops_what_lies_past_it():
    model = WithForward("mha", seed=0)
    reg = ContinualAttentionRegularizer(module="", layers=[0], keep=2)  # keep=2: task 0's snapshot stays
    trainer(max_steps=2, callbacks=[reg]).fit(model, data(0))
    snap = reg.snapshots[0]
    whole = tensor_bytes(snap.parameters(), snap.buffers())
    assert reg.snapshot_memory() == [{"task": 0, "bytes": whole, "trimmed_tensors": 0, "trimmed_bytes": 0}]
    calls = []
    for name in ("head", "encoder.layers.1", "encoder.layers.0.norm1", "encoder.layers.0.self_attn"):
        snap.get_submodule(name).register_forward_hook(lambda *_, name=name: calls.append(name))

    trainer(max_steps=3, callbacks=[reg]).fit(model, data(1))
    # every pass of the snapshot ran the regularised attention layer and nothing after it: no head, no logits
    assert calls == ["encoder.layers.0.self_attn"] * 3
    kept = {k for k, v in snap.state_dict().items() if v.numel() > 0}
    assert kept == {f"encoder.layers.0.self_attn.{n}" for n in ("in_proj_weight", "in_proj_bias", "out_proj.weight",
                                                                 "out_proj.bias")}  # out_proj is read, never called
    held = sum(v.numel() * v.element_size() for k, v in snap.state_dict().items() if k in kept)
    assert reg.snapshot_memory()[0] == {"task": 0, "bytes": {"cpu": held}, "trimmed_bytes": whole["cpu"] - held,
                                        "trimmed_tensors": len(snap.state_dict()) - len(kept)}
    with pytest.raises(RuntimeError, match=r"Snapshot module 'encoder.layers.0.norm1' .* was trimmed .*snapshot_trim"):
        snap(torch.randn(2, 6, 16))


def test_trimming_changes_no_loss_and_the_offloaded_snapshot_holds_the_same_bytes():
    """The trimmed snapshot computes exactly what the whole one does; on this CPU machine "cpu" offload holds its
    bytes where "same" does (a GPU run would hold them in host memory instead of device memory)."""
    runs = {}
    for trim, device in ((True, "same"), (False, "same"), (True, "cpu")):
        model = WithForward("mha", seed=0)
        reg = ContinualAttentionRegularizer(module="", weight=5.0, snapshot_trim=trim, snapshot_device=device)
        runs[trim, device] = (two_tasks(model, reg), reg.snapshot_memory())
    # the same up to float rounding (the watched first pass takes nn.MultiheadAttention's slow path, later ones its
    # fused one)
    flat = {k: [x for task in v[0] for x in task] for k, v in runs.items()}
    assert flat[True, "same"] == pytest.approx(flat[False, "same"], rel=1e-6)
    assert flat[True, "cpu"] == pytest.approx(flat[False, "same"], rel=1e-6)
    (trimmed,), (whole,), (offloaded,) = (runs[k][1] for k in ((True, "same"), (False, "same"), (True, "cpu")))
    # the snapshot of task 1 has not run yet (it closes the last fit): nothing dropped from it so far
    assert trimmed == whole == offloaded and whole["trimmed_tensors"] == 0 and set(whole["bytes"]) == {"cpu"}


def test_a_trimmed_snapshot_survives_a_checkpoint_without_its_dropped_weights():
    model = WithForward("mha", seed=0)
    reg = ContinualAttentionRegularizer(module="", layers=[0], keep=2)
    two_tasks(model, reg, steps=(2, 2))
    state = reg.state_dict()
    old, new = state["snapshots"]
    assert old["trimmed"] and "head.weight" in old["trimmed"] and "head.weight" not in old["state_dict"]
    assert "trimmed" not in new and "head.weight" in new["state_dict"]  # task 1's snapshot has not run yet

    restored = ContinualAttentionRegularizer(module="", layers=[0], keep=2)
    restored.load_state_dict(state)
    with _no_warning():
        restored._materialise(WithForward("mha", seed=3))
    rebuilt = restored.snapshots[0].state_dict()
    assert {k for k, v in rebuilt.items() if v.numel() == 0} == set(old["trimmed"])
    assert all(torch.equal(rebuilt[k], v) for k, v in old["state_dict"].items())
    assert restored.snapshot_memory()[0]["bytes"] == reg.snapshot_memory()[0]["bytes"]
    with pytest.raises(RuntimeError, match="was trimmed"):
        restored.snapshots[0](torch.randn(1, 6, 16))


class _no_warning:
    """A block in which no warning may be raised (a rebuilt trimmed snapshot must not warn about missing weights)."""

    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings(record=True)
        self.caught = self._catch.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self._catch.__exit__(*exc)
        assert not [str(w.message) for w in self.caught if "no weights" in str(w.message)]


def test_the_first_pass_keeps_weights_read_without_a_module_call():
    """nn.MultiheadAttention passes out_proj's weight to a function and never calls out_proj: it is kept."""
    layer = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    first = FirstPass(layer)
    x = torch.randn(1, 3, 8)
    with torch.no_grad(), first.watching():
        layer(x, x, x)
    assert first.unused() == []
    assert FirstPass(layer).unused() == []  # a module that never ran is never trimmed


def test_layer_weights_weigh_the_layers_and_a_zero_weight_layer_is_not_regularised():
    class Logged(WithForward):
        def __init__(self):
            super().__init__("mha", seed=0)
            self.logged = []

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.logged.append({k.split("/")[-1].removesuffix("_step"): float(v)
                                for k, v in self.trainer.callback_metrics.items()
                                if k.startswith("train/continual_kl/") and k.endswith("_step")})

    model = Logged()
    reg = ContinualAttentionRegularizer(layer_weights=[1.0, 3.0], weight=2.0)
    two_tasks(model, reg)
    assert [p.weight for p in reg._pairs] == [0.25, 0.75]
    for logged in model.logged[2:]:
        assert logged["total"] == pytest.approx(0.25 * logged["layer0"] + 0.75 * logged["layer1"], rel=1e-5, abs=1e-8)
    assert model.logged[-1]["layer0"] > 0 and model.logged[-1]["layer1"] > 0

    model = Logged()
    only_first = ContinualAttentionRegularizer(layer_weights=[2.0, 0.0], keep=2)
    two_tasks(model, only_first)
    assert only_first.pair_names == ["layer0"] and set(model.logged[-1]) == {"layer0", "total", "weight"}
    # the deepest regularised layer is now layer 0: task 0's snapshot (of `encoder`) stopped there, without layer 1
    assert only_first.root == "encoder"
    assert {n for n in only_first._snapshots[0].trimmed if n.startswith("layers.1.")} == {
        f"layers.1.{k}" for k in model.encoder.layers[1].state_dict()}


@pytest.mark.parametrize(("options", "error", "message"), [
    ({"layer_weights": [0.0, 0.0]}, ValueError, "at least one of `layer_weights` to be > 0"),
    ({"layer_weights": [1.0]}, ValueError, "one weight per regularised layer, but WithForward has 2"),
    ({"layers": [0, 1], "layer_weights": [1.0]}, ValueError, "one weight per layer of `layers` \\(2\\)"),
    ({"layer_weights": [-1.0]}, ValueError, "`layer_weights\\[0\\]` to be a finite number >= 0"),
    ({"layer_weights": 1.0}, TypeError, "a non-empty list of numbers >= 0 \\(one per regularised layer\\)"),
    ({"snapshot_trim": "yes"}, TypeError, "`snapshot_trim` to be a bool"),
])
def test_bad_layer_weights_and_trim_options_fail_with_a_message(options, error, message):
    with pytest.raises(error, match=message):
        reg = ContinualAttentionRegularizer(**options)
        reg.snapshot(WithForward("mha", seed=0))  # a length that needs the model fails when layers are resolved
