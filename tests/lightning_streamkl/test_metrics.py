"""AttentionKLDivergence: row-weighted per-pair means, checked against the naive op, synced under DDP (gloo)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_streamkl import AttentionKLDivergence
from lightning_streamkl.terms import count_rows
from streamkl import naive_attention_kl


def batch_terms(seed: int, n: int):
    """Per-pair (sum, rows) and per-row KL for two pairs of random layers with padding and causality."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, n - 2:] = False
    sums, rows, per_row = [], [], []
    for heads, causal in ((4, True), (2, False)):
        q_t, k_t, q_s, k_s = (torch.randn(2, heads, n, 8, generator=g, dtype=torch.float64) for _ in range(4))
        kw = dict(causal=causal, key_padding_mask=mask, query_mask=mask)
        sums.append(naive_attention_kl(q_t, k_t, q_s, k_s, reduction="sum", **kw))
        rows.append(count_rows(2, heads, n, n, causal=causal, device=torch.device("cpu"), key_padding_mask=mask,
                               query_mask=mask))
        kl = naive_attention_kl(q_t, k_t, q_s, k_s, reduction="none", **kw)
        per_row.append(kl[mask[:, None, :].expand_as(kl)])
        assert rows[-1] == per_row[-1].numel()
        mean = naive_attention_kl(q_t, k_t, q_s, k_s, reduction="mean", **kw)
        torch.testing.assert_close(sums[-1] / rows[-1], mean)  # count_rows matches the op's "mean" rows
    return torch.stack(sums), torch.stack(rows), per_row


def test_metric_against_the_naive_op():
    metric = AttentionKLDivergence(["deep", "shallow"], weights=[1.0, 0.25])
    all_rows = [[], []]
    for seed, n in ((0, 7), (1, 5)):
        sums, rows, per_row = batch_terms(seed, n)
        metric.update(sums, rows)
        for i in range(2):
            all_rows[i].append(per_row[i])
    out = metric.compute()
    expected = [torch.cat(r).mean() for r in all_rows]
    assert sorted(out) == ["attn_kl/deep", "attn_kl/shallow", "attn_kl/total"]
    torch.testing.assert_close(out["attn_kl/deep"], expected[0].float())
    torch.testing.assert_close(out["attn_kl/shallow"], expected[1].float())
    torch.testing.assert_close(out["attn_kl/total"], (expected[0] + 0.25 * expected[1]).float())
    metric.reset()
    metric.update(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 2.0]))
    assert metric.compute()["attn_kl/deep"] == 0  # no rows: 0, not NaN


def test_metric_contract():
    metric = AttentionKLDivergence(["a"])
    assert not metric.higher_is_better and not metric.full_state_update and metric.state_dict() == {}
    with pytest.raises(ValueError, match=r"Expected `kl_sums` to have shape \(1,\) \(one per pair\), got \(2,\)"):
        metric.update(torch.zeros(2), torch.zeros(1))
    with pytest.raises(ValueError, match="Expected `rows` to be >= 0"):
        metric.update(torch.zeros(1), -torch.ones(1))
    unchecked = AttentionKLDivergence(["a"], validate_args=False)  # the engine's: its rows are the op's counts
    unchecked.update(torch.zeros(1), -torch.ones(1))  # values are not read on the host; shapes still are
    with pytest.raises(ValueError, match=r"Expected `rows` to have shape \(1,\)"):
        unchecked.update(torch.zeros(1), torch.zeros(2))
    with pytest.raises(ValueError, match="Expected `pair_names` to be non-empty and unique"):
        AttentionKLDivergence(["a", "a"])
    with pytest.raises(TypeError, match="Expected `pair_names` to be a sequence of str"):
        AttentionKLDivergence("ab")
    with pytest.raises(ValueError, match=r"Expected `weights` to have 1 entries"):
        AttentionKLDivergence(["a"], weights=[1.0, 2.0])
    import pickle

    assert pickle.loads(pickle.dumps(metric)).pair_names == ["a"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank: int, world: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        metric = AttentionKLDivergence(["deep", "shallow"])
        sums, rows, _ = batch_terms(rank, 7 - 2 * rank)  # different data and row counts per rank
        metric.update(sums, rows)
        queue.put((rank, {k: float(v) for k, v in metric.compute().items()}))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_metric_syncs_across_two_processes_gloo():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(_ddp_worker, args=(2, _free_port(), queue), nprocs=2, join=True, start_method="spawn")
    results = dict(queue.get(timeout=60) for _ in range(2))
    assert results[0] == results[1]
    s0, r0, _ = batch_terms(0, 7)
    s1, r1, _ = batch_terms(1, 5)
    expected = (s0 + s1) / (r0 + r1)  # row-weighted over both processes, not the mean of the two means
    assert results[0]["attn_kl/deep"] == pytest.approx(float(expected[0]), rel=1e-6)
    assert results[0]["attn_kl/shallow"] == pytest.approx(float(expected[1]), rel=1e-6)
    assert results[0]["attn_kl/deep"] != pytest.approx(float((s0[0] / r0[0] + s1[0] / r1[0]) / 2), rel=1e-6)


def test_states_are_float32_on_a_device_without_float64(monkeypatch):
    """MPS has no float64: simulated by declaring the CPU such a device (the states' dtype follows the device type)."""
    from lightning_streamkl import metrics as metrics_module
    from lightning_streamkl.adapter import load_metric_state, metric_state
    from lightning_streamkl.metrics import state_dtype

    assert state_dtype("mps") == torch.float32 and state_dtype("cpu") == state_dtype("cuda:0") == torch.float64
    metric = AttentionKLDivergence(["deep", "shallow"], weights=[1.0, 0.25])
    assert metric.kl_sum.dtype == torch.float64
    monkeypatch.setattr(metrics_module, "FLOAT32_DEVICES", ("cpu",))
    metric.to("cpu")  # what the engine does at every step (DistillationMetrics.update)
    assert metric.kl_sum.dtype == metric.rows.dtype == torch.float32
    metric.update(torch.tensor([2.0, 1.0], dtype=torch.float64), torch.tensor([4.0, 4.0], dtype=torch.float64))
    metric.update(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0]))
    assert metric.kl_sum.dtype == torch.float32
    out = {k: round(float(v), 6) for k, v in metric.compute().items()}
    assert out == {"attn_kl/deep": 0.6, "attn_kl/shallow": 0.25, "attn_kl/total": 0.6625}
    resumed = AttentionKLDivergence(["deep", "shallow"], weights=[1.0, 0.25]).to("cpu")
    load_metric_state(resumed, metric_state(metric, None), None)  # a checkpoint written on "MPS" loads there
    assert resumed.kl_sum.dtype == torch.float32 and resumed.compute()["attn_kl/deep"] == pytest.approx(0.6)
    metric.reset()
    assert metric.kl_sum.dtype == torch.float32 and metric.update_count == 0
    monkeypatch.setattr(metrics_module, "FLOAT32_DEVICES", ("mps",))
    metric.to("cpu")  # back on a device with float64: float64 again
    assert metric.kl_sum.dtype == torch.float64
