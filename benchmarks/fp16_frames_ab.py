"""fp16 training call (B=4 H=16 N=8192 causal, D 64/128), this tree against another kernels/streamkl, paired rounds:

    PYTHONPATH=kernels:. python benchmarks/fp16_frames_ab.py OTHER/kernels/streamkl results.json
"""

import json
import sys

import common
import torch
from common import Shape, make_inputs

import streamkl


def training_call(pkg, inputs, leaves):
    def run():
        loss = pkg.attention_kl(*inputs, causal=True)
        torch.autograd.grad(loss, leaves)
    return run


def main(other: str, out_path: str) -> None:
    base = common.load_package(other, "streamkl_base")
    out = {}
    for d in (64, 128):
        inputs = make_inputs(Shape(4, 16, 8192, d, True, dtype="float16"), "cuda", seed=0)
        leaves = [t for t in inputs if t.requires_grad]
        calls = {"new": training_call(streamkl, inputs, leaves), "base": training_call(base, inputs, leaves)}
        for fn in calls.values():
            fn()
        runs = common.paired_rounds(calls, 7, lambda fn: common.do_bench_ms(fn, rep=100, warmup=25))
        name = f"fp16 B4 H16 N8192 D{d} causal fwd+bwd"
        out[name] = {**common.compare(runs["new"], runs["base"]), "new_ms": runs["new"], "base_ms": runs["base"]}
        print(name, out[name]["ratio"], out[name]["verdict"], flush=True)
    with open(out_path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "cases": out}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
