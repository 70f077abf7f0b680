"""Compile the attention-KL kernels for a GPU target *without a GPU* and report their resources.

Triton compiles to PTX and cubin on any machine (its wheel bundles ptxas/cuobjdump/nvdisasm), so
registers, spills (stack bytes), shared memory and the SASS instruction mix of each configuration can be
read for free before spending GPU time:

    TRITON_INTERPRET=0 python benchmarks/kernel_resources.py                  # default configs, sm_90
    TRITON_INTERPRET=0 python benchmarks/kernel_resources.py --sweep-forward   # candidate forward tiles
    TRITON_INTERPRET=0 python benchmarks/kernel_resources.py --hopper-key-pass --against <copy of v13's
        kernels/streamkl> --out benchmarks/results   # the Gluon one-warpgroup key pass, this version and v13's

Counts are per kernel (whole SASS), with the instruction classes that matter for this op: MUFU.EX2 (the
exponential unit), HGMMA/HMMA (tensor cores), FFMA/FADD/FMUL/FMNMX (FMA pipe) and local-memory traffic.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from streamkl._triton.backward import _attention_kl_bwd_dk_kernel, _attention_kl_bwd_dq_kernel
from streamkl._triton.forward import _attention_kl_fwd_kernel

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_FLOAT_ARGS = re.compile(r"^(qk_scale|scale|cap_scale|grad_scale)_")


def compile_kernel(fn, pointer_types: dict, constexprs: dict, num_warps: int, num_stages: int, arch: int = 90):
    """``triton.compile`` one specialisation of ``fn`` for ``sm_<arch>``; returns the compiled kernel.

    It mimics the specialisation a real launch on contiguous inputs gets: unit strides (the head-dim
    stride, the mask strides) become the constant 1, and pointers, the other strides and the sequence
    lengths are marked divisible by 16 (true for power-of-two N and head dims >= 16).
    """
    signature, attrs = {}, {}
    constexprs = dict(constexprs)
    for name in fn.arg_names:
        if name.startswith("stride_") and (name.endswith("_d") or name in ("stride_km_n", "stride_qm_n")):
            constexprs.setdefault(name, 1)
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointer_types:
            signature[name] = pointer_types[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif _FLOAT_ARGS.match(name):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name.startswith("stride_") or name in ("N_Q", "N_K"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    consts = {(fn.arg_names.index(k),): v for k, v in constexprs.items()}
    src = ASTSource(fn, signature=signature, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def resources(compiled) -> dict:
    """Registers, stack (spill) bytes, shared memory and an instruction histogram from the cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
        path = f.name
    try:
        usage = subprocess.run([os.path.join(_BIN, "cuobjdump"), "--dump-resource-usage", path],
                               capture_output=True, text=True).stdout
        sass = subprocess.run([os.path.join(_BIN, "cuobjdump"), "--dump-sass", path],
                              capture_output=True, text=True).stdout
    finally:
        os.unlink(path)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", usage)
    ops = collections.Counter()
    for line in sass.splitlines():
        hit = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
        if hit:
            ops[hit.group(1).split(".")[0]] += 1
    return {
        "regs": int(m.group(1)) if m else None,
        "stack": int(m.group(2)) if m else None,
        "shared": compiled.metadata.shared,
        "MUFU": ops["MUFU"], "HGMMA": ops["HGMMA"], "HMMA": ops["HMMA"],
        "FFMA": ops["FFMA"], "FMUL": ops["FMUL"], "FADD": ops["FADD"], "FMNMX": ops["FMNMX"],
        "LDL/STL": ops["LDL"] + ops["STL"], "total": sum(ops.values()),
    }


def _pointers(dtype: str, names_in: list[str], names_fp32: list[str], masks: list[str]) -> dict:
    out = {n: f"*{dtype}" for n in names_in}
    out.update({n: "*fp32" for n in names_fp32})
    out.update({n: "*u8" for n in masks})
    return out


def _flags(causal: bool, dtype: str) -> dict:
    """The constexpr flags of a dense problem without masks, sinks or soft-caps."""
    return dict(WIDE=False, HAS_LEFT=False, HAS_RIGHT=causal, HAS_KEY_MASK=False, HAS_QUERY_MASK=False,
                IS_VARLEN=False, SOFTCAP_A=False, SOFTCAP_B=False, DOT_PRECISION_A="tf32", DOT_PRECISION_B="tf32",
                INTERPRET=False, CU_Q=None, CU_K=None, HAS_ATTN_MASK=False, ATTN_MASK=None)


def forward_resources(d: int, block_m: int, block_n: int, warps: int, stages: int, causal: bool = False,
                      dtype: str = "bf16", fused_dq: bool = False) -> dict:
    """``fused_dq``: the forward that also accumulates side b's query gradient."""
    ptrs = _pointers(dtype, ["Q_A", "K_A", "Q_B", "K_B"], ["KL", "LSE_A", "LSE_B", "DQ_B"],
                     ["KEY_MASK", "QUERY_MASK"])
    cx = dict(_flags(causal, dtype), D_A=d, D_B=d, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_DA=d, BLOCK_DB=d,
              HAS_SINKS=False, SINK_A=None, SINK_B=None, FUSED_DQ=fused_dq, FP16_B=dtype == "fp16")
    if not fused_dq:
        ptrs.pop("DQ_B")
        cx["DQ_B"] = None
    return resources(compile_kernel(_attention_kl_fwd_kernel, ptrs, cx, warps, stages))


def backward_resources(d: int, block_m: int, block_n: int, warps: int, stages: int, causal: bool = False,
                       atomic: bool = True, dtype: str = "bf16") -> dict:
    common = dict(_flags(causal, dtype), D_A=d, D_B=d, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_DA=d, BLOCK_DB=d,
                  NEED_A=False, NEED_B=True, FP16_A=dtype == "fp16", FP16_B=dtype == "fp16")
    ptrs = _pointers(dtype, ["Q_A", "K_A", "Q_B", "K_B", "DK_A", "DK_B"],
                     ["GRAD", "KL", "LSE_A", "LSE_B", "DQ_A", "DQ_B"], ["KEY_MASK"])
    dk = resources(compile_kernel(_attention_kl_bwd_dk_kernel, ptrs,
                                  dict(common, DK_A_PER_HEAD=False, ATOMIC_DQ=atomic), warps, stages))
    if atomic:
        return {"dk+atomic dq": dk}
    ptrs_q = dict(ptrs, DQ_A=f"*{dtype}", DQ_B=f"*{dtype}")
    common.pop("HAS_QUERY_MASK")
    dq = resources(compile_kernel(_attention_kl_bwd_dq_kernel, ptrs_q, dict(common, BANDED=causal), warps,
                                  stages))
    return {"dk": dk, "dq": dq}


#: Forward tiles worth compiling (block_m, block_n, warps, stages); the tuning script times the spill-free ones.
FORWARD_CANDIDATES = [(64, 64, 4, 3), (64, 64, 4, 2), (128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 2),
                      (128, 128, 8, 2), (64, 128, 4, 3), (64, 32, 4, 3), (128, 32, 4, 3), (128, 32, 8, 3),
                      (256, 64, 8, 2)]


#: (head dim, causal, block_m, ring stages) of the one-warpgroup Hopper key pass compiled by ``--hopper-key-pass``
HOPPER_KEY_PASS_CASES = [(d, causal, bm, stages) for d in (64, 128) for causal in (False, True)
                         for bm, stages in ((32, 4), (64, 2), (64, 3), (64, 6))]


def hopper_key_pass_resources(package, d: int, causal: bool, block_m: int, stages: int) -> dict:
    """Resources of ``package``'s one-warpgroup Gluon key pass (``_hopper.backward._hopper_dk_kernel``), bf16 on both
    sides, 64 keys per program, 4 warps, a scalar upstream gradient (and, from v16, the full steps pipelined or not as
    its launch picks for head dim ``d``)."""
    import importlib

    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    module = importlib.import_module(f"{package.__name__}._hopper.backward")
    fn = module._hopper_dk_kernel

    def descriptor(block):
        layout = gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16)
        return f"tensordesc<bf16[{','.join(map(str, block))}],{layout!r}>"

    types = {"qa_desc": descriptor((1, 1, block_m, d)), "qb_desc": descriptor((1, 1, block_m, d)),
             "ka_desc": descriptor((1, 1, 64, d)), "kb_desc": descriptor((1, 1, 64, d)), "GRAD": "*fp32",
             "LSE_A": "*fp32", "LSE_B": "*fp32", "DK_B": "*bf16", "qk_scale_a": "fp32", "qk_scale_b": "fp32",
             "grad_scale_b": "fp32"}
    constexprs = dict(CAUSAL=causal, SCALAR_GRAD=True, BLOCK_M=block_m, BLOCK_N=64, STAGES=stages, num_warps=4)
    if "OVERLAP" in fn.arg_names:  # v16: full steps pipelined or one at a time, as the launch picks by head dim
        constexprs["OVERLAP"] = d <= 64  # streamkl.dispatch's variant: full steps pipelined where D_s <= 64
    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names}
    src = GluonASTSource(fn, signature=signature, constexprs={(fn.arg_names.index(k),): v for k, v in
                                                              constexprs.items()}, attrs={})
    return resources(triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}))


def hopper_fused_forward_resources(package, d: int, causal: bool, block_m: int, block_n: int, stages: int,
                                   consumers: int = 2) -> dict:
    """Resources of ``package``'s warp-specialised fused forward (``_hopper.fused_forward._ws_fused_fwd_kernel``, v17),
    bf16, ``block_m`` rows per consumer, ``block_n`` keys per tile, a ``stages``-deep key ring, a bf16 dQ buffer,
    ``consumers`` consumer warpgroups. The registers are the launch limit (``KERNEL_REGS``, or
    ``THREE_KERNEL_REGS``), which ``setmaxnreg`` raises in the consumers; the stack is the largest partition's."""
    import importlib

    module = importlib.import_module(f"{package.__name__}._hopper.fused_forward")
    types = {"qa_desc": _gluon_descriptor((1, 1, block_m, d)), "qb_desc": _gluon_descriptor((1, 1, block_m, d)),
             "ka_desc": _gluon_descriptor((1, 1, block_n, d)), "kb_desc": _gluon_descriptor((1, 1, block_n, d)),
             "KL": "*fp32", "LSE_A": "*fp32", "LSE_B": "*fp32", "DQ_B": "*bf16", "qk_scale_a": "fp32",
             "qk_scale_b": "fp32", "grad_scale_b": "fp32"}
    constexprs = dict(CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, num_warps=4)
    if "CONSUMERS" in module._ws_fused_fwd_kernel.arg_names:  # a copy from before the kernel fixed two consumers
        constexprs["CONSUMERS"] = consumers
    return _compile_gluon(module._ws_fused_fwd_kernel, types, constexprs,
                          maxnreg=module.KERNEL_REGS if consumers == 2 else module.THREE_KERNEL_REGS)


def _gluon_descriptor(block: tuple[int, ...]) -> str:
    """The signature type of a bf16 TMA descriptor with ``block`` and its default shared layout."""
    from triton.experimental.gluon import language as gl

    layout = gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16)
    return f"tensordesc<bf16[{','.join(map(str, block))}],{layout!r}>"


def _compile_gluon(fn, types: dict, constexprs: dict, maxnreg: int | None = None) -> dict:
    """Compile a Gluon kernel for sm_90 (parameters not in ``types`` or ``constexprs`` are i32) and read its
    resources."""
    from triton.experimental.gluon._runtime import GluonASTSource

    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names}
    src = GluonASTSource(fn, signature=signature, constexprs={(fn.arg_names.index(k),): v for k, v in
                                                              constexprs.items()}, attrs={})
    options = {"num_warps": constexprs["num_warps"]}
    if maxnreg:
        options["maxnreg"] = maxnreg
    return resources(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options))


def hopper_key_pass_table(against: str | None) -> dict:
    """:data:`HOPPER_KEY_PASS_CASES` compiled from this checkout's package and, with ``against``, from a copy of an
    earlier one."""
    from report import load_package

    import streamkl

    packages = {"this": streamkl}
    if against:
        packages["against"] = load_package(os.path.abspath(against), "streamkl_base")
    rows = []
    for label, package in packages.items():
        for d, causal, block_m, stages in HOPPER_KEY_PASS_CASES:
            row = dict(package=label, d=d, causal=causal, block_m=block_m, stages=stages,
                       **hopper_key_pass_resources(package, d, causal, block_m, stages))
            print(row, flush=True)
            rows.append(row)
    return {"triton": triton.__version__, "target": "sm_90", "against": against, "rows": rows}


HOPPER_FUSED_FORWARD_CASES = [(d, causal, bm, bn, stages) for d in (64, 128) for causal in (False, True)
                              for bm, bn, stages in ((64, 64, 2), (64, 32, 4))]


def hopper_fused_forward_table() -> dict:
    """:data:`HOPPER_FUSED_FORWARD_CASES` compiled from this checkout's package (v17's tiles and the 32-key ones)."""
    import streamkl

    rows = []
    for d, causal, block_m, block_n, stages in HOPPER_FUSED_FORWARD_CASES:
        row = dict(d=d, causal=causal, block_m=block_m, block_n=block_n, stages=stages,
                   **hopper_fused_forward_resources(streamkl, d, causal, block_m, block_n, stages))
        print(row, flush=True)
        rows.append(row)
    return {"triton": triton.__version__, "target": "sm_90", "rows": rows}


#: (d, causal, consumers): the training forward with two and with three consumer warpgroups, v17's tiles
HOPPER_CONSUMERS_CASES = [(64, causal, consumers) for causal in (False, True) for consumers in (2, 3)]


def hopper_consumers_table() -> dict:
    """:data:`HOPPER_CONSUMERS_CASES` compiled from this checkout's package
    (``benchmarks/bench_three_consumers.py``)."""
    import streamkl

    rows = []
    for d, causal, consumers in HOPPER_CONSUMERS_CASES:
        row = dict(d=d, causal=causal, consumers=consumers,
                   **hopper_fused_forward_resources(streamkl, d, causal, 64, 64, 2, consumers))
        print(row, flush=True)
        rows.append(row)
    return {"triton": triton.__version__, "target": "sm_90", "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hopper-key-pass", action="store_true", help="the one-warpgroup Gluon key pass's tiles")
    parser.add_argument("--against", help="with --hopper-key-pass: also a copy of an earlier kernels/streamkl")
    parser.add_argument("--out", help="with --hopper-key-pass: directory for its JSON, "
                        "kernel-resources-hopper-key-pass<tag>.json")
    parser.add_argument("--tag", default="", help="with --hopper-key-pass --out: a suffix of the file's name")
    parser.add_argument("--hopper-fused-forward", action="store_true",
                        help="the warp-specialised Gluon fused forward's tiles (with --out: its JSON, "
                        "kernel-resources-hopper-fused-forward.json)")
    parser.add_argument("--hopper-consumers", action="store_true",
                        help="the Gluon fused forward with two and three consumer warpgroups (with --out: its JSON, "
                        "kernel-resources-hopper-consumers.json)")
    parser.add_argument("--sweep-forward", action="store_true")
    parser.add_argument("--sweep-backward", action="store_true")
    parser.add_argument("--fused-dq", action="store_true", help="with --sweep-forward: the forward that also "
                        "accumulates side b's query gradient")
    args = parser.parse_args()
    if args.hopper_key_pass:
        data = hopper_key_pass_table(args.against)
        if args.out:
            from bench_attention_kl import write_json

            write_json(os.path.join(args.out, f"kernel-resources-hopper-key-pass{args.tag}.json"), data)
        return
    if args.hopper_fused_forward:
        data = hopper_fused_forward_table()
        if args.out:
            from bench_attention_kl import write_json

            write_json(os.path.join(args.out, "kernel-resources-hopper-fused-forward.json"), data)
        return
    if args.hopper_consumers:
        data = hopper_consumers_table()
        if args.out:
            from bench_attention_kl import write_json

            write_json(os.path.join(args.out, "kernel-resources-hopper-consumers.json"), data)
        return
    if args.sweep_forward:
        for d in (64, 128):
            for bm, bn, w, s in FORWARD_CANDIDATES:
                res = forward_resources(d, bm, bn, w, s, fused_dq=args.fused_dq)
                print(f"fwd D={d} BM={bm} BN={bn} warps={w} stages={s}:", res)
        return
    if args.sweep_backward:
        for d in (64, 128):
            for bm, bn, w, s in [(64, 64, 4, 2), (64, 64, 8, 2), (32, 128, 4, 2), (64, 128, 8, 2), (128, 128, 8, 1)]:
                print(f"bwd D={d} BM={bm} BN={bn} warps={w} stages={s}:", backward_resources(d, bm, bn, w, s))
        return
    from streamkl._triton.configs import dk_config, dq_config, forward_config

    for d in (64, 128, 256):
        for causal in (False, True):
            f = forward_config(d, d)
            k, q = dk_config(d, d, causal), dq_config(d, d, causal)
            fwd = forward_resources(d, f.block_m, f.block_n, f.num_warps, f.num_stages, causal)
            dk = backward_resources(d, k.block_m, k.block_n, k.num_warps, k.num_stages, causal, atomic=False)["dk"]
            dq = backward_resources(d, q.block_m, q.block_n, q.num_warps, q.num_stages, causal, atomic=False)["dq"]
            print(f"D={d} causal={causal} fwd {f}: {fwd}")
            print(f"D={d} causal={causal} dk {k}: {dk}")
            print(f"D={d} causal={causal} dq {q}: {dq}")


if __name__ == "__main__":
    main()
