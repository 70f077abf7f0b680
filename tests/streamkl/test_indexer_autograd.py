"""Autograd wiring of indexer_kl: the eager Function and the torch.library custom op agree, opcheck passes, and
torch.compile(fullgraph=True) traces an indexer + the loss + backward without graph breaks."""

from __future__ import annotations

import pytest
import torch

from streamkl import indexer_kl
from streamkl.indexer_autograd import IndexerKLFunction, indexer_kl_fwd_op
from tests._helpers import assert_close

BACKENDS = ["reference", "triton"]  # triton runs under the CPU interpreter without a GPU
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs():
    g = torch.Generator().manual_seed(1)
    shapes = [(2, 4, 13, 16), (2, 2, 13, 16), (2, 3, 13, 8), (2, 13, 8), (2, 13, 3)]
    xs = [torch.randn(*s, generator=g).to(DEVICE) for s in shapes]
    for x in xs[2:]:
        x.requires_grad_(True)
    topk = torch.stack([torch.randperm(13, generator=g)[:5] for _ in range(26)]).view(2, 13, 5).to(DEVICE)
    return xs, topk


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_custom_op_and_function_agree(backend, sparse):
    grads, outs = [], []
    for fn in (IndexerKLFunction.apply, indexer_kl_fwd_op):
        xs, topk = _inputs()
        kl, _lse_h, lse_index, psum = fn(*xs, None, topk if sparse else None, None, True, 0.25, backend)
        (kl * torch.arange(kl.numel(), device=DEVICE).view_as(kl)).sum().backward()
        outs.append((kl, lse_index, psum))
        grads.append([x.grad for x in xs[2:]])
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    for a, b in zip(*grads):  # the kernels add dk_idx with atomics: equal up to the summation order
        assert_close(a, b, 1e-6, "grad")


def test_custom_op_passes_opcheck():
    xs, topk = _inputs()
    torch.library.opcheck(indexer_kl_fwd_op, (*xs, None, topk, None, True, 0.25, "reference"))
    lse = torch.randn(2, 4, 13, device=DEVICE)
    torch.library.opcheck(indexer_kl_fwd_op, (*xs, lse, None, None, False, 0.25, "reference"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_fullgraph_matches_eager(backend):
    torch._dynamo.reset()
    proj_q = torch.nn.Linear(16, 3 * 8).to(DEVICE)
    proj_k = torch.nn.Linear(16, 8).to(DEVICE)
    proj_w = torch.nn.Linear(16, 3).to(DEVICE)
    params = [*proj_q.parameters(), *proj_k.parameters(), *proj_w.parameters()]

    def step(x, q, k):
        # an indexer on detached hidden states, trained against the main attention's q and k
        q_idx = proj_q(x).unflatten(-1, (3, 8))  # [B, N, H_I, D_I] ("bnhd")
        return indexer_kl(q, k, q_idx, proj_k(x), proj_w(x), layout="bnhd", backend=backend)

    x = torch.randn(2, 19, 16, device=DEVICE)
    q, k = torch.randn(2, 19, 4, 16, device=DEVICE), torch.randn(2, 19, 1, 16, device=DEVICE)
    eager = step(x, q, k)
    eager.backward()
    expected = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    out = torch.compile(step, fullgraph=True, backend="aot_eager")(x, q, k)
    out.backward()
    assert_close(out, eager, 1e-6, "loss")
    for g, p in zip(expected, params):
        assert_close(p.grad, g, 1e-5, "grad")
