"""Sequence-sharded attention KL (``streamkl.sharded``) against the unsharded op.

Exactness is checked three ways: the cut of a shard's problem reproduces the global mask entry by entry (brute
force over small geometries); the sharded forward and every gradient equal :func:`streamkl.attention_kl` on the
concatenated keys in float64 (random shapes, shard splits with empty shards, every mask, GQA, both directions,
soft-caps, sinks, query blocks of a larger problem), on the reference and, through Triton's interpreter, the Triton
kernels; and :func:`context_parallel_attention_kl` on 2 gloo processes equals the single-process op, forward and
gradients (``test_context_parallel_on_two_gloo_processes``).
"""

from __future__ import annotations

import itertools
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from streamkl import attention_kl, reference
from streamkl.sharded import (
    KLPartial,
    _shard_window,
    attention_kl_partial,
    attention_kl_partial_backward,
    context_parallel_attention_kl,
    merge_partials,
    sharded_attention_kl,
)
from tests._helpers import assert_close


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    monkeypatch.setattr(reference, "DEFAULT_CHUNK_SIZE", 8)


def _allowed(n_q: int, n_k: int, offset: int, left: int, right: int) -> torch.Tensor:
    """The window rule on a dense grid: row i sees key j iff offset - left <= j - i <= offset + right."""
    d = torch.arange(n_k)[None, :] - torch.arange(n_q)[:, None]
    ok = torch.ones(n_q, n_k, dtype=torch.bool)
    if left >= 0:
        ok &= d >= offset - left
    if right >= 0:
        ok &= d <= offset + right
    return ok


def test_the_cut_of_a_shard_reproduces_the_global_mask_entry_by_entry():
    """Every small geometry: the rows and keys the cut keeps, under the kernels' bottom-right rule with the cut's
    window, allow exactly the pairs the global rule allows; what is cut off is allowed nowhere."""
    checked = 0
    for n_q in range(0, 5):
        for n_k in range(0, 6):
            for align in range(-7, 8):
                for left in (-1, 0, 1, 3):
                    for right in (-1, 0, 2):
                        want = _allowed(n_q, n_k, align, left, right)
                        cut = _shard_window(n_q, n_k, align, left, right)
                        got = torch.zeros(n_q, n_k, dtype=torch.bool)
                        if cut is not None:
                            rows, keys, l_cut, r_cut = cut
                            assert l_cut >= -1 and r_cut >= -1 and (l_cut == -1) == (left == -1)
                            got[:rows, :keys] = _allowed(rows, keys, keys - rows, l_cut, r_cut)
                        assert torch.equal(got, want), (n_q, n_k, align, left, right, cut)
                        checked += 1
    assert checked == 5 * 6 * 15 * 4 * 3


def _inputs(b=2, h=4, h_kt=2, h_ks=4, n_q=13, n_k=13, d_t=8, d_s=6, dtype=torch.float64, teacher_grad=False,
            layout="bhnd", seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(heads, n, d, grad):
        x = torch.randn(b, heads, n, d, generator=g, dtype=torch.float64)
        x = (x if layout == "bhnd" else x.transpose(1, 2).contiguous()).to(dtype)
        return x.requires_grad_(grad)

    return (rand(h, n_q, d_t, teacher_grad), rand(h_kt, n_k, d_t, teacher_grad), rand(h, n_q, d_s, True),
            rand(h_ks, n_k, d_s, True))


def _split(x: torch.Tensor, cuts: list[int], dim: int) -> list[torch.Tensor]:
    bounds = [0, *cuts, x.shape[dim]]
    return [x.narrow(dim, a, b - a) for a, b in itertools.pairwise(bounds)]


def _compare(tensors, cuts, *, rows=None, tol=1e-10, **options):
    """sharded_attention_kl over the key shards ``cuts`` (and the query rows ``rows`` of the problem) against
    attention_kl on all keys: per-row KL and the gradients of every tensor that requires grad."""
    q_t, k_t, q_s, k_s = tensors
    layout = options.get("layout", "bhnd")
    seq = 1 if layout == "bnhd" else 2
    n_q = q_t.shape[seq]
    r0, r1 = rows or (0, n_q)
    weights = torch.rand(q_t.shape[0], q_t.shape[1 if layout == "bhnd" else 2], n_q, dtype=torch.float64)
    full = attention_kl(q_t, k_t, q_s, k_s, reduction="none", **options)
    (full[:, :, r0:r1] * weights[:, :, r0:r1]).sum().backward()
    leaves = [x for x in (*tensors, options.get("sinks_t"), options.get("sinks_s")) if x is not None
              and x.requires_grad]
    expected = [x.grad.clone() for x in leaves]
    for x in leaves:
        x.grad = None
    local = {}
    for name in ("query_mask", "attn_mask"):
        if options.get(name) is not None:
            local[name] = options[name][:, r0:r1] if name == "query_mask" else options[name][:, :, r0:r1]
    sharded = sharded_attention_kl(q_t.narrow(seq, r0, r1 - r0), _split(k_t, cuts, seq),
                                   q_s.narrow(seq, r0, r1 - r0), _split(k_s, cuts, seq), query_start=r0,
                                   total_q=n_q, reduction="none", **{**options, **local})
    assert_close(sharded, full[:, :, r0:r1], tol, "kl")
    (sharded * weights[:, :, r0:r1]).sum().backward()
    for x, want in zip(leaves, expected):
        assert_close(x.grad, want, tol, f"grad {tuple(x.shape)}")
    return full


CASES = [
    dict(cuts=[5], options=dict(causal=True)),
    dict(cuts=[0, 4, 4, 9], options=dict(causal=True)),  # empty shards anywhere
    dict(cuts=[7], options=dict(causal=True), rows=(7, 13)),  # the second half of the rows: one shard in the past
    dict(cuts=[3, 8], options=dict(causal=True), rows=(2, 6)),  # a row block with a shard entirely in its future
    dict(cuts=[6], options=dict(window=(3, 0)), rows=(4, 11)),
    dict(cuts=[2, 9], options=dict(window=(2, 3))),  # a window open to the right
    dict(cuts=[5], options=dict(causal=True, direction="reverse"), teacher_grad=True),
    dict(cuts=[4, 10], options=dict(causal=True, softcap_t=2.0, softcap_s=3.0, temperature=2.0)),
    dict(cuts=[6], options=dict(causal=True, layout="bnhd"), layout="bnhd"),
    dict(cuts=[6], options=dict(causal=False), n_k=19),  # N_q != N_k, no mask
    dict(cuts=[9], options=dict(causal=True), n_k=19, rows=(3, 10)),  # N_q != N_k: bottom-right alignment
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['options']}-{c['cuts']}-{c.get('rows')}")
def test_sharded_equals_the_op_on_all_keys(case):
    tensors = _inputs(n_k=case.get("n_k", 13), teacher_grad=case.get("teacher_grad", False),
                      layout=case.get("layout", "bhnd"))
    _compare(tensors, case["cuts"], rows=case.get("rows"), **case["options"])


def test_sharded_with_every_mask_and_sinks_in_both_directions():
    g = torch.Generator().manual_seed(3)
    for direction in ("forward", "reverse"):
        tensors = _inputs(teacher_grad=True, seed=4)
        kpm = torch.rand(2, 13, generator=g) > 0.3
        kpm[1, :7] = False  # batch row 1: no real key in the first shard
        qm = torch.rand(2, 13, generator=g) > 0.2
        am = torch.rand(2, 4, 13, 13, generator=g) > 0.2
        sinks_t = torch.randn(4, dtype=torch.float64, generator=g).requires_grad_(True)
        sinks_s = torch.randn(4, dtype=torch.float64, generator=g).requires_grad_(True)
        full = _compare(tensors, [7], rows=(3, 12), causal=True, key_padding_mask=kpm, query_mask=qm, attn_mask=am,
                        sinks_t=sinks_t, sinks_s=sinks_s, direction=direction)
        assert bool((full == 0).any())  # some rows have no key or are excluded


def test_rows_without_any_key_are_zero_with_zero_gradient_and_are_not_counted():
    q_t, k_t, q_s, k_s = _inputs()
    kpm = torch.zeros(2, 13, dtype=torch.bool)
    kpm[0, 9:] = True  # batch row 0: keys only in the last shard; rows before 9 see nothing (causal)
    out = sharded_attention_kl(q_t, _split(k_t, [4, 9], 2), q_s, _split(k_s, [4, 9], 2), causal=True,
                               key_padding_mask=kpm, reduction="none", sinks_t=torch.zeros(4, dtype=torch.float64),
                               sinks_s=torch.ones(4, dtype=torch.float64))
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(out[0, :, :9], torch.zeros(4, 9,
                                                                                                   dtype=out.dtype))
    out.sum().backward()
    assert torch.equal(q_s.grad[1], torch.zeros_like(q_s.grad[1]))
    mean = sharded_attention_kl(q_t, _split(k_t, [4, 9], 2), q_s, _split(k_s, [4, 9], 2), causal=True,
                                key_padding_mask=kpm)
    full = attention_kl(q_t, k_t, q_s, k_s, causal=True, key_padding_mask=kpm)
    assert_close(mean, full, 1e-12, "mean over counted rows")


def test_empty_batch_and_all_empty_shards():
    q_t, k_t, q_s, k_s = _inputs(b=0)
    out = sharded_attention_kl(q_t, [k_t], q_s, [k_s], causal=True)
    assert float(out.detach()) == 0.0
    q_t, k_t, q_s, k_s = _inputs(n_k=0)
    out = sharded_attention_kl(q_t, [k_t, k_t], q_s, [k_s, k_s], reduction="none")
    assert torch.equal(out, torch.zeros(2, 4, 13, dtype=torch.float64))
    out.sum().backward()
    assert torch.equal(q_s.grad, torch.zeros_like(q_s))


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    n_q=st.integers(1, 12), n_k=st.integers(1, 12), n_shards=st.integers(1, 4), data=st.data(),
    causal=st.booleans(), left=st.integers(-1, 4), direction=st.sampled_from(["forward", "reverse"]),
)
def test_sharded_matches_the_op_property(n_q, n_k, n_shards, data, causal, left, direction):
    cuts = sorted(data.draw(st.lists(st.integers(0, n_k), min_size=n_shards - 1, max_size=n_shards - 1)))
    r0 = data.draw(st.integers(0, n_q - 1))
    r1 = data.draw(st.integers(r0 + 1, n_q))
    tensors = _inputs(b=1, h=2, h_kt=1, h_ks=2, n_q=n_q, n_k=n_k, teacher_grad=direction == "reverse")
    window = (left, 0 if causal else -1)
    kpm = torch.rand(1, n_k) > 0.2
    _compare(tensors, cuts, rows=(r0, r1), window=window, key_padding_mask=kpm, direction=direction)


def test_parts_partial_merge_and_backward_equal_the_op():
    """The low-level API a ring uses: partials per shard, merged; each shard's backward from the merged stats."""
    q_t, k_t, q_s, k_s = _inputs(teacher_grad=True)
    kpm = torch.rand(2, 13) > 0.25
    bounds = [(0, 3), (3, 3), (3, 10), (10, 13)]
    opts = dict(total_q=13, total_k=13, causal=True, direction="reverse")
    parts = [attention_kl_partial(q_t, k_t[:, :, a:b], q_s, k_s[:, :, a:b], key_start=a,
                                  key_padding_mask=kpm[:, a:b], **opts) for a, b in bounds]
    merged = merge_partials(parts)
    assert merge_partials([merge_partials(parts[:2]), merge_partials(parts[2:])]).kl.allclose(merged.kl, atol=1e-12)
    full = attention_kl(q_t, k_t, q_s, k_s, causal=True, direction="reverse", key_padding_mask=kpm, reduction="none")
    assert_close(merged.kl, full, 1e-12, "merged kl")
    grad = torch.rand(2, 4, 13, dtype=torch.float64)
    (full * grad).sum().backward()
    grads = [attention_kl_partial_backward(grad, q_t, k_t[:, :, a:b], q_s, k_s[:, :, a:b], merged, key_start=a,
                                           key_padding_mask=kpm[:, a:b], teacher_grads=True, **opts)
             for a, b in bounds]
    assert_close(sum(g[0] for g in grads), q_t.grad, 1e-10, "dq_t")
    assert_close(torch.cat([g[1] for g in grads], 2), k_t.grad, 1e-10, "dk_t")
    assert_close(sum(g[2] for g in grads), q_s.grad, 1e-10, "dq_s")
    assert_close(torch.cat([g[3] for g in grads], 2), k_s.grad, 1e-10, "dk_s")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_on_cut_shards(dtype):
    """The Triton kernels (interpreter on CPU) take the cut, strided shard problems: float32 close to the op."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q_t, k_t, q_s, k_s = (x.detach().to(device).requires_grad_(x.requires_grad) for x in _inputs(
        b=1, h=2, h_kt=1, h_ks=2, n_q=20, n_k=20, d_t=16, d_s=16, dtype=dtype))
    kpm = torch.rand(1, 20, device=device) > 0.2
    opts = dict(causal=True, key_padding_mask=kpm, backend="triton", reduction="none")
    rows = slice(6, 20)
    full = attention_kl(q_t, k_t, q_s, k_s, **opts)
    full[:, :, rows].sum().backward()
    want = q_s.grad.clone(), k_s.grad.clone()
    q_s.grad = k_s.grad = None
    out = sharded_attention_kl(q_t[:, :, rows], _split(k_t, [6, 13], 2), q_s[:, :, rows], _split(k_s, [6, 13], 2),
                               query_start=6, total_q=20, **opts)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert_close(out, full[:, :, rows], tol, "kl")
    out.sum().backward()
    assert_close(q_s.grad, want[0], tol, "dq_s")
    assert_close(k_s.grad, want[1], tol, "dk_s")


def test_errors_name_the_argument():
    q_t, k_t, q_s, k_s = _inputs()
    with pytest.raises(ValueError, match=r"Expected `total_q` and `total_k`.*causal"):
        attention_kl_partial(q_t, k_t, q_s, k_s, key_start=13, causal=True)
    with pytest.raises(ValueError, match=r"key_start \+ N_k <= total_k.*key_start=4, N_k=13, total_k=13"):
        attention_kl_partial(q_t, k_t, q_s, k_s, key_start=4, total_q=13, total_k=13)
    with pytest.raises(TypeError, match=r"`query_start` to be an int >= 0, but got -1"):
        attention_kl_partial(q_t, k_t, q_s, k_s, query_start=-1)
    with pytest.raises(TypeError, match=r"`k_t` to be a non-empty sequence of key shards.*got Tensor"):
        sharded_attention_kl(q_t, k_t, q_s, [k_s])
    with pytest.raises(ValueError, match=r"same number of shards, but got 1 and 2"):
        sharded_attention_kl(q_t, [k_t], q_s, [k_s, k_s])
    with pytest.raises(ValueError, match=r"`key_padding_mask` to span all 13 keys.*\(2, 12\)"):
        sharded_attention_kl(q_t, [k_t], q_s, [k_s], key_padding_mask=torch.ones(2, 12, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"'bhnd' or 'bnhd' for a sharded KL, but got 'thd'"):
        sharded_attention_kl(q_t, [k_t], q_s, [k_s], layout="thd")
    with pytest.raises(ValueError, match=r"`reduction` to be one of"):
        sharded_attention_kl(q_t, [k_t], q_s, [k_s], reduction="avg")
    with pytest.raises(TypeError, match=r"non-empty sequence of KLPartial, but got list \(empty\)"):
        merge_partials([])
    part = KLPartial(torch.zeros(1, 2, 3), torch.zeros(1, 2, 3), torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match=r"shape \(1, 2, 3\).*partials\[1\].kl has shape \(1, 2, 4\)"):
        merge_partials([part, KLPartial(torch.zeros(1, 2, 4), torch.zeros(1, 2, 4), torch.zeros(1, 2, 4))])
    with pytest.raises(ValueError, match=r"`merged.kl` to be a tensor of shape \(B, H, N_q\) = \(2, 4, 13\)"):
        attention_kl_partial_backward(torch.ones(2, 4, 13), q_t, k_t, q_s, k_s, part)
    merged = merge_partials([attention_kl_partial(q_t, k_t, q_s, k_s)])
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'casual'"):
        attention_kl_partial_backward(torch.ones(2, 4, 13), q_t, k_t, q_s, k_s, merged, casual=True)
    with pytest.raises(RuntimeError, match=r"needs torch.distributed initialised"):
        context_parallel_attention_kl(q_t, k_t, q_s, k_s)


# ---------------------------------------------------------------------------------------------- 2 processes (gloo)
WORLD = 2
CP_CASES = {
    "causal+padding": dict(causal=True, key_padding_mask="kpm"),
    "window+query_mask+reverse": dict(window=(5, 0), query_mask="qm", direction="reverse"),
    "bnhd+sinks+softcap": dict(causal=True, layout="bnhd", sinks=True, softcap_t=3.0),
}


def _cp_inputs(name: str):
    """The whole problem of a case (identical in every process): tensors, options, mask tensors."""
    opts = dict(CP_CASES[name])
    layout = opts.get("layout", "bhnd")
    g = torch.Generator().manual_seed(7)
    tensors = _inputs(b=2, h=4, h_kt=2, h_ks=1, n_q=14, n_k=14, teacher_grad=True, layout=layout, seed=11)
    if opts.pop("key_padding_mask", None):
        kpm = torch.rand(2, 14, generator=g) > 0.3
        kpm[1, :7] = False  # rank 0's keys of batch row 1 are all padding
        opts["key_padding_mask"] = kpm
    if opts.pop("query_mask", None):
        opts["query_mask"] = torch.rand(2, 14, generator=g) > 0.3
    if opts.pop("sinks", False):
        opts["sinks_t"] = torch.randn(4, generator=g, dtype=torch.float64).requires_grad_(True)
        opts["sinks_s"] = torch.randn(4, generator=g, dtype=torch.float64).requires_grad_(True)
    return tensors, opts


def _cp_worker(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        results = {}
        for name in CP_CASES:
            tensors, opts = _cp_inputs(name)
            seq = 1 if opts.get("layout") == "bnhd" else 2
            n = tensors[0].shape[seq] // WORLD
            local = [x.detach().narrow(seq, rank * n, n).clone().requires_grad_(x.requires_grad) for x in tensors]
            for key in ("key_padding_mask", "query_mask"):
                if key in opts:
                    opts[key] = opts[key][:, rank * n:(rank + 1) * n]
            per_row = context_parallel_attention_kl(*local, reduction="none", **opts)
            weights = torch.rand(per_row.shape, generator=torch.Generator().manual_seed(rank), dtype=per_row.dtype)
            (per_row * weights).sum().backward()
            sinks = [opts[k].grad for k in ("sinks_t", "sinks_s") if k in opts]
            results[name] = dict(kl=per_row.detach(), weights=weights, grads=[x.grad for x in local], sinks=sinks)
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_context_parallel_on_two_gloo_processes():
    """Each of 2 processes holds half of the sequence (queries, keys, masks); the per-row KL, the gradients of the
    local q/k of teacher and student (keys: reduced onto their owner) and the sinks' gradients (summed over
    ranks) equal attention_kl on the whole sequence in one process, float64 to 1e-10."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_cp_worker, args=(os.path.join(tmp, "store"), tmp), nprocs=WORLD, start_method="spawn")
        ranks = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(WORLD)]
    for name in CP_CASES:
        tensors, opts = _cp_inputs(name)
        seq = 1 if opts.get("layout") == "bnhd" else 2
        full = attention_kl(*tensors, reduction="none", **opts)
        weights = torch.cat([r[name]["weights"] for r in ranks], 2)
        (full * weights).sum().backward()
        assert_close(torch.cat([r[name]["kl"] for r in ranks], 2), full, 1e-10, f"{name}: kl")
        for i, x in enumerate(tensors):
            got = torch.cat([r[name]["grads"][i] for r in ranks], seq)
            assert_close(got, x.grad, 1e-10, f"{name}: grad of input {i}")
        for i, key in enumerate(k for k in ("sinks_t", "sinks_s") if k in opts):
            assert_close(sum(r[name]["sinks"][i] for r in ranks), opts[key].grad, 1e-10, f"{name}: {key}")


def test_the_example_runs(monkeypatch):
    """examples/context_parallel_kl.py as shipped: the parts in one process, then 2 gloo processes, each asserting
    its loss and gradients against the op on the whole sequence."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "examples"))
    import context_parallel_kl

    assert context_parallel_kl.parts() < 1e-12
    context_parallel_kl.main()  # raises if a process fails its checks
