"""Where each kernel's time goes, read from the GPU's hardware counters with Nsight Compute (``ncu``).

The design page's bounds (docs/concepts/kernels.md) say how far each kernel is from the exponential unit's and the
tensor cores' ceilings; this script says *why*, for the frozen-teacher training call (the fused forward and the key
pass) and for cuDNN attention's forward+backward on the same shapes: how often each scheduler issued, how busy each pipe
was, how many warps were resident, and what the warps waited on between two issues (Nsight Compute's warp-state
sampling, in cycles per issued instruction).

    PYTHONPATH=kernels:. python benchmarks/kernel_profile.py --out benchmarks/results   # GPU with ncu on PATH
    python benchmarks/kernel_profile.py --render benchmarks/results/nvidia-h100-80gb-hbm3-kernel-profile.json

Each shape runs in its own process under ``ncu`` (``--clock-control none``: the clocks stay as the card has them;
kernel replay, so every counter is read on the same launch). The process warms both calls up, then profiles one
training call, a marker kernel, and one cuDNN forward+backward. Times under ``ncu`` are single launches with the
counters on: read them as proportions, and take speeds from the paired benchmarks.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import TRAINING_SHAPES, gpu_tag, write_blocks, write_json  # noqa: E402

RESULT_NAME = "kernel-profile.json"
DOC = os.path.join(HERE, "..", "docs", "concepts", "kernels.md")
H100_RESULT = os.path.join(HERE, "results", f"nvidia-h100-80gb-hbm3-{RESULT_NAME}")
#: (name, B, H, N, D, causal): the training-call shapes at N = 8192, bf16, the teacher as wide as the student
SHAPES = [(name, s.b, s.h, s.n, s.d, s.causal) for name, s in TRAINING_SHAPES.items() if name.startswith("N8192")]
SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "WarpStateStats", "Occupancy", "LaunchStats",
            "SchedulerStats", "InstructionStats")
#: ncu's raw metrics kept in the result file (full names; the rest of the raw page is dropped)
KEEP = re.compile("|".join((
    r"^gpu__time_duration\.sum$",
    r"^launch__(registers_per_thread|grid_size|block_size|occupancy_limit_\w+|shared_mem_per_block\w*)$",
    r"^sm__maximum_warps_per_active_cycle_pct$",
    r"^sm__warps_active\.avg\.(pct_of_peak_sustained_active|per_cycle_active)$",
    r"^sm__inst_issued\.avg\.pct_of_peak_sustained_active$",
    r"^smsp__issue_active\.avg\.pct_of_peak_sustained_active$",
    r"^smsp__warps_(eligible|active)\.avg\.per_cycle_active$",
    r"^sm__(inst_executed_)?pipe_\w+\.avg\.pct_of_peak_sustained_active$",
    r"^smsp__average_warps_issue_stalled_\w+_per_issue_active\.ratio$",
    r"^sm__throughput\.avg\.pct_of_peak_sustained_elapsed$",
    r"^smsp__inst_executed\.sum$",
)))
#: The marker launched between the two calls (``torch.cuda._sleep``'s kernel)
MARKER = "spin"
#: Stall reasons shown in the rendered table (ncu's names; the rest stay in the result file)
STALL_LABELS = {
    "wait": "fixed latency",
    "long_scoreboard": "memory (L1TEX)",
    "short_scoreboard": "MUFU / shared memory",
    "math_pipe_throttle": "pipe busy",
    "mio_throttle": "MIO queue",
    "barrier": "CTA barrier",
    "membar": "memory barrier",
    "dispatch_stall": "dispatch",
    "no_instruction": "no instruction",
    "branch_resolving": "branch",
    "lg_throttle": "LSU queue",
    "sleeping": "sleeping",
    "drain": "drain",
    "misc": "misc",
    "tex_throttle": "TEX queue",
    "imc_miss": "constant cache",
    "gmma": "warpgroup MMA",
}


def _shape(name: str) -> tuple:
    for shape in SHAPES:
        if shape[0] == name:
            return shape
    raise ValueError(f"shape: expected one of {[s[0] for s in SHAPES]}, got {name!r}")


def worker(name: str) -> None:
    """Run under ncu: warm up, then profile one training call, the marker, and one cuDNN forward+backward."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import streamkl

    _, b, h, n, d, causal = _shape(name)
    g = torch.Generator(device="cuda").manual_seed(0)
    q_t, k_t, q_s, k_s = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
                          for _ in range(4))
    q_s.requires_grad_(True)
    k_s.requires_grad_(True)

    def training_call():
        loss = streamkl.attention_kl(q_t, k_t, q_s, k_s, causal=causal)
        return torch.autograd.grad(loss, (q_s, k_s))

    sq, sk, sv = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
                  for _ in range(3))
    d_out = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)

    def attention_call():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = sdpa(sq, sk, sv, is_causal=causal)
            return torch.autograd.grad(out, (sq, sk, sv), d_out)

    for _ in range(3):
        training_call()
        attention_call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    training_call()
    torch.cuda._sleep(1000)
    attention_call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def parse_raw_csv(text: str) -> list[dict]:
    """ncu's ``--csv --page raw`` output: one dict per profiled kernel, in launch order, with its name and the
    :data:`KEEP` metrics as numbers; durations in nanoseconds, whatever unit ncu printed.

    Example:
        >>> parse_raw_csv('"ID","Kernel Name","gpu__time_duration.sum","x"\\n"","","us",""\\n'
        ...               '"0","k","1,500","7"\\n')
        [{'id': 0, 'name': 'k', 'gpu__time_duration.sum': 1500000.0}]
    """
    lines = [line for line in text.splitlines() if line.startswith('"')]  # ncu's own messages start with ==
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    if len(rows) < 2:
        return []
    header, units = rows[0], rows[1]
    to_ns = {"ns": 1.0, "nsecond": 1.0, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6, "s": 1e9, "second": 1e9}
    kernels = []
    for row in rows[2:]:
        record = dict(zip(header, row))
        kernel = {"id": int(record["ID"]), "name": record["Kernel Name"]}
        for column, unit in zip(header, units):
            if not KEEP.match(column):
                continue
            value = _number(record.get(column, ""))
            if value is None:
                continue
            if column == "gpu__time_duration.sum":
                if unit not in to_ns:
                    raise ValueError(f"{column}: expected a time unit among {sorted(to_ns)}, got {unit!r}")
                value *= to_ns[unit]
            kernel[column] = value
        kernels.append(kernel)
    return kernels


def role(name: str) -> str:
    """What a kernel of the profiled calls is, from its name.

    Example:
        >>> role("_attention_kl_fwd_kernel"), role("_ws_fused_fwd_kernel"), role("_ws_dk_kernel")
        ('fused forward', 'fused forward', 'key pass')
        >>> role("cudnn_generated_sdpa_sm90_flash_bprop")
        'cuDNN backward'
    """
    if "_attention_kl_fwd" in name or "_fused_fwd" in name:  # portable, or the Gluon one (v17)
        return "fused forward"
    if "dk_kernel" in name:
        return "key pass"
    low = name.lower()
    if "cudnn" in low or "sdpa" in low or "fmha" in low or "flash" in low:
        if "bprop" in low or "bwd" in low or "backward" in low or "dgrad" in low:
            return "cuDNN backward"
        if "fprop" in low or "fwd" in low or "forward" in low:
            return "cuDNN forward"
        return "cuDNN other"
    return "other"


def split_calls(kernels: list[dict]) -> dict:
    """The profiled kernels of one shape, split at the marker into the training call's and cuDNN's."""
    marks = [i for i, k in enumerate(kernels) if MARKER in k["name"]]
    if len(marks) != 1:
        raise ValueError(f"expected one marker kernel ({MARKER!r}) among the profiled kernels, found {len(marks)}")
    cut = marks[0]
    return {"training call": kernels[:cut], "cuDNN fwd+bwd": kernels[cut + 1:]}


def profile_shape(name: str, ncu: str, log_dir: str | None) -> dict:
    """Run :func:`worker` for ``name`` under ncu and return its kernels, split by call."""
    cmd = [ncu, "--target-processes", "all", "--profile-from-start", "off", "--clock-control", "none",
           "--csv", "--page", "raw", *[arg for s in SECTIONS for arg in ("--section", s)],
           sys.executable, os.path.abspath(__file__), "--worker", name]
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if log_dir:
        with open(os.path.join(log_dir, f"ncu-{name}.log"), "w") as f:
            f.write(done.stderr[-200_000:])
    if done.returncode != 0:
        raise RuntimeError(f"ncu failed on {name} (exit {done.returncode}): {done.stderr[-2000:]}")
    return split_calls(parse_raw_csv(done.stdout))


def run(ncu: str, names: list[str], log_dir: str | None) -> dict:
    import torch
    import triton

    version = subprocess.run([ncu, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    rows = []
    for name in names:
        calls = profile_shape(name, ncu, log_dir)
        rows.append({"shape": dict(zip(("name", "b", "h", "n", "d", "causal"), _shape(name))), "calls": calls})
        print(name, {call: [(k["name"][:40], round(k.get("gpu__time_duration.sum", 0), 3)) for k in ks]
                     for call, ks in calls.items()}, flush=True)
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "ncu": version[-1] if version else "", "sections": list(SECTIONS), "shapes": rows}


def _stalls(kernel: dict, top: int | None = 3) -> list[tuple[str, float]]:
    """The ``top`` stall reasons of a kernel, in cycles per issued instruction (a warp that was eligible while
    another issued is not stalled: "not selected" is left out)."""
    found = []
    for column, value in kernel.items():
        m = re.match(r"^smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio$", column)
        if m and m.group(1) not in ("selected", "not_selected"):  # issuing, or eligible while another warp issued
            found.append((m.group(1), value))
    return sorted(found, key=lambda x: -x[1])[:top]  # top=None: all of them


#: The pipe columns: ncu's metric for each (% of peak while the SM is active). The tensor pipe's is its busy cycles
#: (warpgroup and older MMAs alike); the XU and FMA pipes' are their issued instructions.
PIPES = {"tensor": "sm__pipe_tensor_cycles_active", "xu": "sm__inst_executed_pipe_xu",
         "fma": "sm__inst_executed_pipe_fma"}


def pipe(kernel: dict, name: str) -> float | None:
    """How busy the pipe ``name`` (a key of :data:`PIPES`) was, % of peak while the SM is active."""
    return kernel.get(f"{PIPES[name]}.avg.pct_of_peak_sustained_active")


def kernel_rows(data: dict, min_share: float = 0.05) -> list[dict]:
    """One row per kernel that takes at least ``min_share`` of its call's profiled time."""
    rows = []
    for shape in data["shapes"]:
        for call, kernels in shape["calls"].items():
            total = sum(k.get("gpu__time_duration.sum", 0.0) for k in kernels) / 1e6
            for k in kernels:
                ms = k.get("gpu__time_duration.sum", 0.0) / 1e6
                if total <= 0 or ms < min_share * total:
                    continue
                rows.append({
                    "shape": shape["shape"]["name"], "call": call, "kernel": role(k["name"]), "name": k["name"],
                    "ms": ms, "share": ms / total, "regs": k.get("launch__registers_per_thread"),
                    "warps": k.get("sm__warps_active.avg.per_cycle_active"),
                    "issue": k.get("smsp__issue_active.avg.pct_of_peak_sustained_active",
                                   k.get("sm__inst_issued.avg.pct_of_peak_sustained_active")),
                    **{name: pipe(k, name) for name in PIPES},
                    "eligible": k.get("smsp__warps_eligible.avg.per_cycle_active"),
                    "stalls": _stalls(k), "stall": dict(_stalls(k, None)),
                })
    return rows


def _fmt(x: float | None, spec: str = ".0f") -> str:
    return "–" if x is None else format(x, spec)


def table(data: dict) -> str:
    """Markdown: per shape and kernel (those with at least 5% of their call's time), the time under ncu, registers,
    resident and eligible warps, issue and pipe utilisation, and the three largest stall reasons."""
    lines = ["| shape | kernel | ms under ncu (share of its call) | registers | warps / SM "
             "| eligible warps / scheduler | issue busy | tensor pipe | XU pipe (exponentials) | FMA pipe "
             "| largest stalls, cycles per issue |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in kernel_rows(data):
        stalls = ", ".join(f"{STALL_LABELS.get(k, k)} {v:.2f}" for k, v in r["stalls"])
        lines.append(
            f"| {r['shape']} | {r['kernel']} | {r['ms']:.3f} ({r['share']:.0%}) | {_fmt(r['regs'])} | "
            f"{_fmt(r['warps'], '.1f')} | {_fmt(r['eligible'], '.2f')} | {_fmt(r['issue'])}% | {_fmt(r['tensor'])}% | "
            f"{_fmt(r['xu'])}% | {_fmt(r['fma'])}% | {stalls} |")
    return "\n".join(lines)


def blocks(data: dict) -> dict[str, str]:
    return {"kernels:profile": table(data)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--shapes", nargs="*", default=[s[0] for s in SHAPES])
    parser.add_argument("--ncu", default=shutil.which("ncu") or "ncu", help="the Nsight Compute command line")
    parser.add_argument("--out", help="directory for <device>-kernel-profile.json")
    parser.add_argument("--logs", help="directory for ncu's log of each shape")
    parser.add_argument("--render", help="render docs/concepts/kernels.md's profile table from this result file")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return
    if args.render:
        with open(args.render) as f:
            write_blocks(DOC, blocks(json.load(f)))
        return
    data = run(args.ncu, args.shapes, args.logs)
    if args.out:
        path = os.path.join(args.out, f"{gpu_tag(data['device'])}-{RESULT_NAME}")
        write_json(path, data)
        print("wrote", path)
    print(table(data))


if __name__ == "__main__":
    main()
