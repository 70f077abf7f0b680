"""Turn benchmark results into docs: ``benchmarks/results/<gpu>.json`` (``bench_attention_kl.py``) into
docs/benchmarks.md and PNG plots, and ``benchmarks/results/<gpu>-tuning.json`` (``tune_kernels.py``) into the tables
between the ``tuning`` markers of docs/perf-notes.md.

    python benchmarks/report.py                                   # every results file -> docs/
    python benchmarks/report.py benchmarks/results/nvidia-h100-80gb-hbm3.json
    python benchmarks/report.py --no-plots                        # the markdown only

The bounds and tuning tables of docs/perf-notes.md always come from ``PERF_NOTES_GRID`` and ``PERF_NOTES_TUNING``, its
remaining-gap table from ``PERF_NOTES_TRAINING`` and that grid's ceilings.

Runs on any machine (no GPU needed). Every ratio in the tables compares numbers measured in the same run. Other
JSON files under results/ (the ablation and continual results, ...) are not benchmark grids and are skipped.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import statistics
import sys
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
DOCS = os.path.normpath(os.path.join(HERE, "..", "docs"))
IMG = os.path.join(DOCS, "img")
PERF_NOTES = os.path.join(DOCS, "perf-notes.md")
#: the runs whose tables docs/perf-notes.md shows (its prose quotes the same files: benchmarks/figures.py); named, not
#: the last grid and tuning file found, so a run of another card never rewrites the H100 notes
#: The grid as v3 to v15 measured and merged it: its ceilings are the ones every bound in docs/perf-notes.md was
#: computed with (the full grid of v17 replaced benchmarks/results/<gpu>.json; docs/benchmarks.md renders that).
PERF_NOTES_GRID = os.path.join(RESULTS, "runs", "nvidia-h100-80gb-hbm3-grid-v3-to-v15.json")
PERF_NOTES_TUNING = os.path.join(RESULTS, "nvidia-h100-80gb-hbm3-tuning.json")
#: The full grid of v17's kernels, which the "grid re-measured" section of docs/perf-notes.md sets against the grid
#: as it was published before (``PERF_NOTES_GRID``, whose long-context rows were older kernels').
PERF_NOTES_CURRENT_GRID = os.path.join(RESULTS, "nvidia-h100-80gb-hbm3.json")
#: the training call whose distance to its bounds the "remaining gap" section of docs/perf-notes.md renders (v12's run)
PERF_NOTES_TRAINING = os.path.join(RESULTS, "nvidia-h100-80gb-hbm3-peeled-key-pass.json")


def is_grid(raw) -> bool:
    """Whether a parsed JSON file is a benchmark grid written by ``bench_attention_kl.py``."""
    return isinstance(raw, dict) and "records" in raw and "ceilings" in raw


def is_tuning(raw) -> bool:
    """Whether a parsed JSON file is a tile sweep written by ``tune_kernels.py``."""
    return isinstance(raw, dict) and "shape" in raw and any(k.endswith("/best") for k in raw)


def is_real_teacher(raw: object) -> bool:
    """Whether a parsed JSON file was written by ``bench_real_teacher.py`` (packed and windowed problems)."""
    return isinstance(raw, dict) and "ratios_fwd_bwd" in raw and "rows" in raw


def find_results(kind=is_grid, directory: str = RESULTS) -> list[str]:
    """The JSON files under ``directory`` of one kind (``is_grid`` or ``is_tuning``), sorted."""
    found = []
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        with open(path) as f:
            if kind(json.load(f)):
                found.append(path)
    return found


def load(path: str) -> tuple[dict, dict]:
    """Results file -> (meta, table) where table[shape_key][provider/mode] = ms | bytes | status."""
    with open(path) as f:
        raw = json.load(f)
    if not is_grid(raw):
        raise ValueError(f"{path} is not a benchmark grid written by bench_attention_kl.py (it has no 'records' and "
                         "'ceilings'); pass the <gpu>.json files only")
    table: dict = defaultdict(dict)
    bounds: dict = {}
    for rec in raw["records"]:
        s = rec["shape"]
        key = (s["h"], s["d"], s["causal"], s["n"], s["dtype"], s["h_kt"], s["d_s"], s["teacher_grad"])
        value = rec["peak_bytes"] if rec["mode"] == "mem" else rec["ms"]
        table[key][f"{rec['provider']}/{rec['mode']}"] = value if rec["status"] == "ok" else rec["status"]
        if rec.get("extra"):
            bounds[key] = rec["extra"]
    raw["bounds"] = bounds
    return raw, table


def _ms(v) -> str:
    if isinstance(v, (int, float)):
        return f"{v:.3f}" if v < 10 else f"{v:.1f}"
    return "OOM" if v == "OOM" else ("–" if v is None else "err")


def _ratio(a, b) -> str:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0:
        return f"{a / b:.2f}×"
    return "–"


def _gib(v) -> str:
    if isinstance(v, (int, float)):
        return f"{v / 2**30:.3f}" if v < 2**30 else f"{v / 2**30:.2f}"
    return "OOM" if v == "OOM" else "–"


def plain(h, d, causal, n, dtype="bfloat16"):
    return (h, d, causal, n, dtype, None, None, False)


def headline(meta, t) -> list[str]:
    lines = ["| D | causal | streamkl fwd | bwd | fwd+bwd | cuDNN fwd | bwd | FA2 fwd | bwd | naive eager fwd "
             "| fwd+bwd | naive compile fwd+bwd |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for d in (64, 128):
        for causal in (False, True):
            r = t.get(plain(16, d, causal, 8192), {})
            lines.append(
                f"| {d} | {causal} | {_ms(r.get('streamkl/fwd'))} | {_ms(r.get('streamkl/bwd'))} | "
                f"{_ms(r.get('streamkl/fwd+bwd'))} | {_ms(r.get('sdpa-default/fwd'))} | "
                f"{_ms(r.get('sdpa-default/bwd'))} | "
                f"{_ms(r.get('sdpa-flash/fwd'))} | {_ms(r.get('sdpa-flash/bwd'))} | {_ms(r.get('naive-eager/fwd'))} | "
                f"{_ms(r.get('naive-eager/fwd+bwd'))} | {_ms(r.get('naive-compile/fwd+bwd'))} |"
            )
    return lines


#: The most a ratio to cuDNN moved between two runs of the same code (the training calls of the paired runs of v13's
#: and v14's code, docs/perf-notes.md v14 and v15; tests/test_benchmarks.py checks it against those files): a ratio
#: target measured closer than this to its goal is not settled by one run.
RUN_SPREAD = 0.08


def same_code_movements() -> dict[str, float]:
    """How far the same code's training-call ratio to cuDNN moved between two committed paired runs: v13's code in
    v13's and v14's runs, v14's code in v14's and v15's, per shape (relative change, ``"v13 N8192-D64": 0.031``)."""
    def rows(name):
        with open(os.path.join(RESULTS, f"nvidia-h100-80gb-hbm3-{name}.json")) as f:
            return {r["shape"]["name"]: r for r in json.load(f)["rows"]}

    def ratio(row, label):
        return statistics.median(row["ms"][f"training call {label}"]) / row["cudnn_fwd_bwd_ms"]

    out = {}
    for code, (first, second) in (("v13", ("ws-key-pass", "peeled-key-pass")), ("v14", ("peeled-key-pass", "bf16-dq"))):
        a, b = rows(first), rows(second)
        for shape in a.keys() & b.keys():
            out[f"{code} {shape}"] = abs(ratio(a[shape], "new") / ratio(b[shape], "previous") - 1)
    return out


def target_status(measured: float, goal: float, ok: bool) -> str:
    """"met" or "**missed**", marked as within the run-to-run spread when ``measured`` lies within
    :data:`RUN_SPREAD` of ``goal``.

    Example:
        >>> target_status(1.1496, 1.15, True), target_status(1.33, 1.15, False)
        ('met, within the run-to-run spread', '**missed**')
    """
    status = "met" if ok else "**missed**"
    return f"{status}, within the run-to-run spread" if abs(measured / goal - 1) <= RUN_SPREAD else status


def targets(meta, t) -> list[str]:
    """The issue's targets, each with the measured value and whether it is met (ratio targets: whether one run can
    tell, :func:`target_status`)."""
    rows = []

    def add(name, value, goal, ok, ratio=None):
        status = target_status(*ratio, ok) if ratio else ("met" if ok else "**missed**")
        rows.append(f"| {name} | {value} | {goal} | {status} |")

    for d in (64, 128):
        for causal in (False, True):
            for n in (4096, 8192, 16384):
                r = t.get(plain(16, d, causal, n), {})
                f, cf, fa = r.get("streamkl/fwd"), r.get("sdpa-default/fwd"), r.get("sdpa-flash/fwd")
                b, cb = r.get("streamkl/fwd+bwd"), r.get("sdpa-default/fwd+bwd")
                if not all(isinstance(x, float) for x in (f, cf, fa, b, cb)):
                    continue
                tag = f"D={d} {'causal' if causal else 'full'} N={n}"
                add(f"fwd / cuDNN fwd, {tag}", f"{f / cf:.2f}×", "≤ 1.15×", f / cf <= 1.15, (f / cf, 1.15))
                add(f"fwd / FA2 fwd, {tag}", f"{f / fa:.2f}×", "≤ 0.85×", f / fa <= 0.85, (f / fa, 0.85))
                add(f"fwd+bwd / cuDNN fwd+bwd, {tag}", f"{b / cb:.2f}×", "≤ 1.15×", b / cb <= 1.15, (b / cb, 1.15))
                if n >= 8192:
                    bound = meta["bounds"].get(plain(16, d, causal, n), {}).get("fwd_bound_ms")
                    if bound:
                        add(f"fwd at % of max(exp, matmul) bound, {tag}", f"{100 * bound / f:.0f}%", "≥ 70%",
                            bound / f >= 0.7)
    r = t.get(plain(16, 64, False, 8192), {})
    nf, nfb = r.get("naive-eager/fwd"), r.get("naive-eager/fwd+bwd")
    f, fb = r.get("streamkl/fwd"), r.get("streamkl/fwd+bwd")
    if all(isinstance(x, float) for x in (nf, nfb, f, fb)):
        add("naive eager fwd / streamkl fwd, D=64 full N=8192", f"{nf / f:.0f}×", "≥ 50×", nf / f >= 50)
        add("naive eager fwd+bwd / streamkl fwd+bwd, D=64 full N=8192", f"{nfb / fb:.0f}×", "≥ 25×", nfb / fb >= 25)
    big = t.get((32, 128, True, 131072, "bfloat16", None, None, False), {}).get("streamkl/mem")
    add("fwd+bwd at N=131072, H=32, D=128 on one 80 GB card", "runs" if isinstance(big, int) else str(big), "runs",
        isinstance(big, int))
    oom = t.get(plain(16, 64, True, 16384), {}).get("naive-eager/mem")
    add("naive loss at N=16384, H=16", str(oom), "OOM", oom == "OOM")
    per_row = t.get(plain(16, 64, True, 131072), {}).get("streamkl/mem")
    if isinstance(per_row, int):
        pr = per_row / (16 * 131072)
        add("extra bytes per (b, h, query row), D=64, N=131072 (incl. the dq, dk grads)", f"{pr:.0f} B", "O(D)",
            pr < 16 * 64)
    return ["| target | measured | goal | |", "|---|---|---|---|", *rows, "",
            f"A ratio within {RUN_SPREAD:.0%} of its goal is marked as within the run-to-run spread: the same code's "
            f"ratio to cuDNN moved by up to that much between two runs (docs/perf-notes.md v15), so one run does not "
            f"settle it."]


def grid(meta, t) -> list[str]:
    lines = []
    for h in (16, 32):
        for d in (64, 128):
            for causal in (False, True):
                title = f"**H={h}, D={d}, {'causal' if causal else 'non-causal'}** (ms; ratios are streamkl / baseline)"
                lines += [f"\n{title}\n",
                          "| N | fwd | bwd | fwd+bwd | atomic bwd | cuDNN fwd | cuDNN bwd | FA2 fwd | FA2 bwd "
                          "| fwd/cuDNN | fwd/FA2 | bwd/cuDNN | fwd bound | fwd % bound |",
                          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
                for n in (1024, 2048, 4096, 8192, 16384, 32768):
                    r = t.get(plain(h, d, causal, n))
                    if not r:
                        continue
                    b = meta["bounds"].get(plain(h, d, causal, n), {}).get("fwd_bound_ms")
                    f = r.get("streamkl/fwd")
                    pct = f"{100 * b / f:.0f}%" if isinstance(f, float) and b else "–"
                    lines.append(
                        f"| {n} | {_ms(f)} | {_ms(r.get('streamkl/bwd'))} | {_ms(r.get('streamkl/fwd+bwd'))} | "
                        f"{_ms(r.get('streamkl-atomic/bwd'))} | {_ms(r.get('sdpa-default/fwd'))} | "
                        f"{_ms(r.get('sdpa-default/bwd'))} | {_ms(r.get('sdpa-flash/fwd'))} | "
                        f"{_ms(r.get('sdpa-flash/bwd'))} | "
                        f"{_ratio(f, r.get('sdpa-default/fwd'))} | {_ratio(f, r.get('sdpa-flash/fwd'))} | "
                        f"{_ratio(r.get('streamkl/bwd'), r.get('sdpa-default/bwd'))} | {_ms(b)} | {pct} |"
                    )
    return lines


def spot_checks(meta, t) -> list[str]:
    lines = ["| shape | fwd | bwd (default, deterministic) | bwd (atomic dQ) | fwd+bwd |", "|---|---|---|---|---|"]
    for key, r in sorted(t.items(), key=lambda kv: str(kv[0])):
        h, d, causal, n, dtype, h_kt, d_s, tgrad = key
        special = dtype != "bfloat16" or h_kt or d_s or tgrad
        if not special or "streamkl/fwd" not in r:
            continue
        desc = f"H={h} D={d} N={n} {'causal' if causal else 'full'} {dtype}"
        desc += f" GQA teacher H_k={h_kt}" if h_kt else ""
        desc += f" D_s={d_s}" if d_s else ""
        desc += " + teacher grads" if tgrad else ""
        lines.append(f"| {desc} | {_ms(r.get('streamkl/fwd'))} | {_ms(r.get('streamkl/bwd'))} | "
                     f"{_ms(r.get('streamkl-atomic/bwd'))} | {_ms(r.get('streamkl/fwd+bwd'))} |")
    return lines


def memory(meta, t) -> list[str]:
    lines = ["| H | D | N | streamkl extra GiB | bytes / (b,h,row) | naive eager GiB |", "|---|---|---|---|---|---|"]
    for key, r in sorted(t.items(), key=lambda kv: str(kv[0])):
        if "streamkl/mem" not in r:
            continue
        h, d, _, n = key[:4]
        s = r.get("streamkl/mem")
        per_row = f"{s / (h * n):.0f}" if isinstance(s, int) else "–"
        lines.append(f"| {h} | {d} | {n} | {_gib(s)} | {per_row} | {_gib(r.get('naive-eager/mem'))} |")
    return lines


def plots(meta, t, tag: str) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    os.makedirs(IMG, exist_ok=True)
    time_png, memory_png, readme_png = plot_files(tag)
    out = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, causal in zip(axes, (False, True)):
        ns = [n for n in (1024, 2048, 4096, 8192, 16384, 32768) if plain(16, 64, causal, n) in t]
        for provider, label in (("streamkl", "streamkl (attention KL)"), ("sdpa-default", "SDPA cuDNN (attention)"),
                                ("sdpa-flash", "SDPA FA2 (attention)"), ("naive-eager", "naive KL, eager"),
                                ("naive-compile", "naive KL, torch.compile")):
            pts = [(n, t[plain(16, 64, causal, n)].get(f"{provider}/fwd+bwd")) for n in ns]
            pts = [(n, v) for n, v in pts if isinstance(v, float)]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        bnd = meta["bounds"]
        bound = [(n, bnd[plain(16, 64, causal, n)]["fwd_bound_ms"] + bnd[plain(16, 64, causal, n)]["bwd_bound_ms"])
                 for n in ns if plain(16, 64, causal, n) in bnd]
        if bound:
            ax.plot(*zip(*bound), linestyle="--", color="gray", label="exp/matmul bound (fwd+bwd)")
        ax.set(xscale="log", yscale="log", xlabel="sequence length N", ylabel="ms (fwd+bwd)",
               title=f"H=16, D=64, bf16, {'causal' if causal else 'non-causal'}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"attention-KL forward+backward time ({meta['device']})")
    fig.tight_layout()
    fig.savefig(time_png, dpi=110)
    out.append(time_png)

    fig, ax = plt.subplots(figsize=(6, 4))
    ns = sorted(k[3] for k in t if k[:3] == (16, 64, True) and "streamkl/mem" in t[k])
    s = [(n, t[plain(16, 64, True, n)]["streamkl/mem"] / 2**30) for n in ns]
    nv = [(n, t[plain(16, 64, True, n)].get("naive-eager/mem")) for n in ns]
    ax.plot(*zip(*s), marker="o", label="streamkl (extra memory, fwd+bwd)")
    ok = [(n, v / 2**30) for n, v in nv if isinstance(v, int)]
    if ok:
        ax.plot(*zip(*ok), marker="o", label="naive KL, eager")
    oom = [n for n, v in nv if v == "OOM"]
    if oom:
        ax.scatter(oom, [80] * len(oom), marker="x", color="red", label="naive: OOM (80 GB card)")
    ax.set(xscale="log", yscale="log", xlabel="sequence length N", ylabel="GiB", title="H=16, D=64, bf16, causal")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(memory_png, dpi=110)
    out.append(memory_png)
    plt.close("all")

    # README figure: memory and time against the naive loss, side by side (H=16, D=64, causal)
    fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax_m.plot(*zip(*s), marker="o", label="streamkl")
    if ok:
        ax_m.plot(*zip(*ok), marker="o", color="tab:red", label="naive KL (materialised)")
    if oom:
        ax_m.scatter(oom, [80] * len(oom), marker="x", color="tab:red", label="naive: out of memory (80 GB)")
    ax_m.set(xscale="log", yscale="log", xlabel="context length N", ylabel="extra GiB (fwd+bwd)", title="memory")
    ts = [(n, t[plain(16, 64, True, n)].get("streamkl/fwd+bwd")) for n in ns if plain(16, 64, True, n) in t]
    tn = [(n, t[plain(16, 64, True, n)].get("naive-eager/fwd+bwd")) for n in ns if plain(16, 64, True, n) in t]
    ta = [(n, t[plain(16, 64, True, n)].get("sdpa-default/fwd+bwd")) for n in ns if plain(16, 64, True, n) in t]
    for pts, label, color in ((ts, "streamkl", "tab:blue"), (tn, "naive KL (materialised)", "tab:red"),
                              (ta, "for scale: one attention, cuDNN", "tab:gray")):
        pts = [(n, v) for n, v in pts if isinstance(v, float)]
        if pts:
            ax_t.plot(*zip(*pts), marker="o", label=label, color=color)
    ax_t.set(xscale="log", yscale="log", xlabel="context length N", ylabel="ms (fwd+bwd)", title="time")
    for ax in (ax_m, ax_t):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"attention KL, H=16, D=64, bf16, causal, {meta['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(readme_png, dpi=110)
    out.append(readme_png)
    plt.close("all")
    return out


def plot_files(tag: str) -> list[str]:
    """The images ``plots`` writes for the results file named ``tag``, under docs/img/."""
    return [os.path.join(IMG, f"bench_time_vs_n_{tag}.png"), os.path.join(IMG, f"bench_memory_vs_n_{tag}.png"),
            os.path.join(IMG, "readme_memory_time.png")]


def render(paths: list[str]) -> str:
    """The text of docs/benchmarks.md for the given grid files."""
    doc = ["# Benchmarks", "",
           "Generated by `python benchmarks/report.py` from the results that `python benchmarks/bench_attention_kl.py` "
           "wrote (do not edit by hand). Times are `triton.testing.do_bench` medians in ms; every ratio compares "
           "numbers measured in the same run on the same card. Baselines: torch SDPA with its default backend "
           "(cuDNN on H100) and with the FLASH_ATTENTION backend (FA2), on the same shapes (one attention, "
           "which computes one softmax where the KL computes two); the naive materialising KL from "
           "`streamkl.naive`, eager and under `torch.compile`. \"bwd\" is the student backward (dQ_s, dK_s) with the "
           "graph retained; the default backward is the deterministic two-pass one, \"atomic bwd\" the one-pass "
           "backward with fp32 atomic dQ (`deterministic=False`). A frozen teacher's forward, run with grad, also "
           "accumulates dQ_s (since v6), so in the rows measured since then (all of them since the full grid of "
           "v17) \"bwd\" is only the key pass and a scaling, while \"fwd\" (timed without grad, as a metric runs "
           "it) is the plain forward: compare fwd+bwd. Bounds use the exp2 and bf16-matmul rates measured "
           "in the same run. See docs/perf-notes.md for what each kernel version changed.", ""]
    for path in paths:
        meta, t = load(path)
        tag = os.path.splitext(os.path.basename(path))[0]
        c = meta["ceilings"]
        doc += [f"## {meta['device']} (torch {meta['torch']}, triton {meta['triton']})", "",
                f"Ceilings measured in the run: exp2 {c['exp2_per_s']:.3e}/s, bf16 matmul "
                f"{c['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s, device copy "
                f"{c['copy_bytes_per_s'] / 1e12:.2f} TB/s.", ""]
        for note in meta.get("notes", []):
            doc += [f"Note: {note}.", ""]
        for img in map(os.path.basename, plot_files(tag)):
            doc += [f"![{img}](img/{img})", ""]
        doc += ["### Headline: B=1, H=16, N=8192, bf16", "", *headline(meta, t), "",
                "### Targets (issue: speed and memory at the hardware limit)", "", *targets(meta, t), "",
                "### Memory: peak extra bytes of one forward+backward beyond the inputs", "", *memory(meta, t), "",
                "### Spot checks (fp16, fp32, GQA, D_t ≠ D_s, teacher gradients)", "", *spot_checks(meta, t), "",
                "### Full grid", *grid(meta, t), ""]
    return "\n".join(doc) + "\n"


# ------------------------------------------------------------------------------------ bounds -> perf notes
#: (name, QK^T-sized products, exponentials) per score element of each pass
PASSES = (("forward", 2, 2), ("backward, one pass (atomic dQ), student only", 4, 2),
          ("backward, two passes (default without v6: trainable teacher, reverse KL), student only", 6, 4),
          ("forward accumulating dQ_s (v6, frozen teacher, with grad)", 4, 2),
          ("backward after it: the key pass, student only", 3, 2))


def bounds_table(meta: dict, h: int = 16, n: int = 8192) -> str:
    """The exp-bound and matmul-bound times of each pass at B=1, ``h`` heads, N=``n``, from the run's ceilings."""
    c = meta["ceilings"]
    e = h * n * n
    lines = [f"Ceilings measured in the run ({meta['device']}): exp2 {c['exp2_per_s']:.3e}/s, bf16 matmul "
             f"{c['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s. B=1, H={h}, N={n}, non-causal; ms.", "",
             "| pass | work per score element | exp bound | matmul bound, D=64 | matmul bound, D=128 | bound, D=64 "
             "| bound, D=128 |", "|---|---|---|---|---|---|---|"]
    for name, products, exps in PASSES:
        exp_ms = exps * e / c["exp2_per_s"] * 1e3
        mm = {d: products * 2 * d * e / c["bf16_matmul_flops"] * 1e3 for d in (64, 128)}
        which = {d: f"{max(exp_ms, mm[d]):.2f} ({'exp' if exp_ms >= mm[d] else 'matmul'})" for d in (64, 128)}
        lines.append(f"| {name} | {products} products ({2 * products}·D flop), {exps} exp2 | {exp_ms:.2f} | "
                     f"{mm[64]:.2f} | {mm[128]:.2f} | {which[64]} | {which[128]} |")
    return "\n".join(lines)


#: (QKᵀ-sized products, exp2) per score element: the frozen-teacher training call (the fused forward, 4 and 2, then
#: the key pass, 3 and 2) and attention's forward+backward (forward 2 and 1, backward 5 and 1, as in FA2 and cuDNN)
TRAINING_CALL_WORK, ATTENTION_WORK = (7, 4), (7, 2)
#: issue 14's long-context target: the training call within this many times cuDNN attention's forward+backward
TRAINING_TARGET = 1.15


def work_bounds(shape: dict, ceilings: dict, work: tuple[int, int]) -> tuple[float, float]:
    """``(max, sum)`` of the exponential time and the tensor-core time (ms) of ``work`` per score element on
    ``shape`` (a results row's shape: b, h, n, d, causal) at the run's ceilings: the time with perfect overlap of the
    two units, and without any.

    Example:
        >>> shape = dict(b=1, h=1, n=1000, d=64, causal=False)
        >>> work_bounds(shape, {"exp2_per_s": 1e12, "bf16_matmul_flops": 1e14}, (1, 1))
        (0.00128, 0.00228)
    """
    e = shape["b"] * shape["h"] * shape["n"] * shape["n"]
    if shape["causal"]:
        e = e * (shape["n"] + 1) / (2 * shape["n"])
    products, exps = work
    mm = products * 2 * shape["d"] * e / ceilings["bf16_matmul_flops"] * 1e3
    ex = exps * e / ceilings["exp2_per_s"] * 1e3
    return max(mm, ex), mm + ex


def training_gap_rows(ceilings: dict, training: dict) -> list[dict]:
    """Per long-context shape of ``training`` (bench_lazy_frames.py's results): the training call's median time (the
    new version) and cuDNN attention's forward+backward, each with its bounds (:func:`work_bounds`), and the time the
    issue's target (1.15× cuDNN's) allows."""
    import statistics

    rows = []
    for r in training["rows"]:
        if r["shape"]["n"] < 4096:
            continue
        ms = statistics.median(r["ms"]["training call new"])
        rows.append(dict(name=r["shape"]["name"], ms=ms, bound=work_bounds(r["shape"], ceilings, TRAINING_CALL_WORK),
                         cudnn=r["cudnn_fwd_bwd_ms"], cudnn_bound=work_bounds(r["shape"], ceilings, ATTENTION_WORK),
                         target=TRAINING_TARGET * r["cudnn_fwd_bwd_ms"]))
    return rows


def training_gap_table(ceilings: dict, training: dict) -> str:
    """The "remaining gap" table of docs/perf-notes.md (see :func:`training_gap_rows`)."""
    lines = ["| shape | training call ms | its bound ms, overlap / none | % of overlap / none | cuDNN fwd+bwd ms | "
             f"its bound ms, overlap / none | % of overlap / none | target ms ({TRAINING_TARGET}× cuDNN) | "
             "% of the call's bound, overlap / none |", "|---|---|---|---|---|---|---|---|---|"]
    for r in training_gap_rows(ceilings, training):
        (b_max, b_sum), (c_max, c_sum) = r["bound"], r["cudnn_bound"]
        lines.append(f"| {r['name']} | {r['ms']:.3f} | {b_max:.3f} / {b_sum:.3f} | {100 * b_max / r['ms']:.0f}% / "
                     f"{100 * b_sum / r['ms']:.0f}% | {r['cudnn']:.3f} | {c_max:.3f} / {c_sum:.3f} | "
                     f"{100 * c_max / r['cudnn']:.0f}% / {100 * c_sum / r['cudnn']:.0f}% | {r['target']:.3f} | "
                     f"{100 * b_max / r['target']:.0f}% / {100 * b_sum / r['target']:.0f}% |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ tuning -> perf notes
_KERNELS = {
    "fwd": "forward",
    "bwd-atomic": "backward, one pass, atomic dQ (`deterministic=False`)",
    "bwd-det-dk": "backward, two passes (default): dK pass swept, dQ pass at its default tile",
    "bwd-det-dq": "backward, two passes (default): dQ pass swept, dK pass at the best non-causal dK tile",
}


def _tile(cfg: dict) -> str:
    tile = f"{cfg['block_m']}×{cfg['block_n']}, {cfg['num_warps']} warps, {cfg['num_stages']} stages"
    return tile + (", pipelined" if cfg.get("pipeline") else "")


def tuning_best(tuning: dict) -> str:
    """The fastest tile of every kernel and head dim, non-causal and causal (ms for the whole op's pass)."""
    s = tuning["shape"]
    lines = [f"{tuning['device']}, B={s['B']}, H={s['H']}, N={s['N']}, {s['dtype']}; `do_bench` medians in ms of "
             "the whole forward, or of the whole backward while one of its kernels' tiles is swept. Generated by "
             "`python benchmarks/report.py` from `benchmarks/results/*-tuning.json` (do not edit by hand).", "",
             "| D | kernel | fastest tile, non-causal | ms | fastest tile, causal | ms |", "|---|---|---|---|---|---|"]
    for d in sorted({int(k.split("/D")[1].split("/")[0]) for k in tuning if "/D" in k}):
        for kernel, label in _KERNELS.items():
            best = tuning.get(f"{kernel}/D{d}/best")
            if not best:
                continue
            full, causal = best.get("false") or best.get(False), best.get("true") or best.get(True)
            cells = [f"{_tile(b['config'])} | {b['ms']:.3f}" if b else "– | –" for b in (full, causal)]
            lines.append(f"| {d} | {label} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def tuning_pipeline(tuning: dict) -> str:
    """Software-pipelined forward against the same tile without pipelining (non-causal)."""
    lines = ["| D | tile | plain ms | pipelined ms | pipelined / plain |", "|---|---|---|---|---|"]
    for key in sorted((k for k in tuning if k.startswith("fwd/D") and not k.endswith("/best")),
                      key=lambda k: int(k.split("/D")[1])):
        d = int(key.split("/D")[1])
        rows = [r for r in tuning[key] if not r["causal"] and isinstance(r["ms"], float)]
        plain = {tuple(v for k, v in r["config"].items() if k != "pipeline"): r["ms"] for r in rows
                 if not r["config"].get("pipeline")}
        for r in rows:
            cfg = r["config"]
            base = plain.get(tuple(v for k, v in cfg.items() if k != "pipeline"))
            if cfg.get("pipeline") and base is not None:
                lines.append(f"| {d} | {_tile({**cfg, 'pipeline': False})} | {base:.3f} | {r['ms']:.3f} | "
                             f"{r['ms'] / base:.2f}× |")
    return "\n".join(lines)


TUNING_BLOCKS = {"tuning:best": tuning_best, "tuning:pipeline": tuning_pipeline}


def replace_block(text: str, name: str, body: str) -> str:
    """Replace what lies between ``<!-- name:start -->`` and ``<!-- name:end -->`` in ``text`` by ``body``."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    if start not in text or end not in text:
        raise ValueError(f"the markers {start} ... {end} are missing")
    return re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: f"{start}\n{body}\n{end}", text, flags=re.S)


def write_blocks(path: str, blocks: dict[str, str]) -> None:
    """Rewrite the file at ``path`` with each ``name -> body`` of ``blocks`` between its markers
    (:func:`replace_block`)."""
    with open(path) as f:
        text = f.read()
    for name, body in blocks.items():
        text = replace_block(text, name, body)
    with open(path, "w") as f:
        f.write(text)


#: The long-context rows the "grid re-measured" table shows: N = 8192 (the issue's shapes) and up.
REFRESH_NS = (8192, 16384, 32768)


def cudnn_ratios(row: dict) -> tuple:
    """(forward, forward+backward) of streamkl over cuDNN attention's in one grid row (None where either is
    missing)."""
    def ratio(mode: str):
        a, b = row.get(f"streamkl/{mode}"), row.get(f"sdpa-default/{mode}")
        ok = isinstance(a, (int, float)) and isinstance(b, (int, float))
        return a / b if ok else None
    return ratio("fwd"), ratio("fwd+bwd")


def grid_refresh_table(before_path: str, after_path: str) -> str:
    """The long-context rows' ratios to cuDNN attention as the grid at ``before_path`` published them and as the
    full re-measured grid at ``after_path`` has them (not paired: two runs, and the earlier rows came from several)."""
    before, after = load(before_path)[1], load(after_path)[1]
    lines = ["| H | D | causal | N | fwd / cuDNN fwd, before → now | fwd+bwd / cuDNN fwd+bwd, before → now |",
             "|---|---|---|---|---|---|"]
    fmt = lambda v: "–" if v is None else f"{v:.2f}×"
    for h in (16, 32):
        for d in (64, 128):
            for causal in (False, True):
                for n in REFRESH_NS:
                    (f0, fb0), (f1, fb1) = (cudnn_ratios(g.get(plain(h, d, causal, n), {})) for g in (before, after))
                    lines.append(f"| {h} | {d} | {causal} | {n} | {fmt(f0)} → {fmt(f1)} | {fmt(fb0)} → {fmt(fb1)} |")
    return "\n".join(lines)


def perf_notes(text: str, grid_path: str, tuning_path: str, training_path: str | None = None,
               current_grid_path: str | None = None) -> str:
    """``text`` (docs/perf-notes.md) with its bounds table rendered from ``grid_path``, its tuning tables from
    ``tuning_path``, given ``training_path`` its remaining-gap table from that training-call run and the grid's
    ceilings, and given ``current_grid_path`` the table of the grid re-measured against ``grid_path``."""
    meta = load(grid_path)[0]
    text = replace_block(text, "bounds", bounds_table(meta))
    if current_grid_path is not None:
        text = replace_block(text, "grid-refresh", grid_refresh_table(grid_path, current_grid_path))
    if training_path is not None:
        with open(training_path) as f:
            text = replace_block(text, "gap", training_gap_table(meta["ceilings"], json.load(f)))
    with open(tuning_path) as f:
        tuning = json.load(f)
    for name, table in TUNING_BLOCKS.items():
        text = replace_block(text, name, table(tuning))
    return text


def render_real_teacher(result: dict) -> str:
    """The real-teacher section (see ``bench_real_teacher.render_markdown``)."""
    import sys

    sys.path.insert(0, HERE)
    from bench_real_teacher import render_markdown

    return render_markdown(result)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="*", help="benchmark grids (default: every one under benchmarks/results/)")
    parser.add_argument("--no-plots", action="store_true", help="write the markdown only")
    args = parser.parse_args(argv)
    paths = args.results or find_results(is_grid)
    if not args.no_plots:
        for path in paths:
            meta, t = load(path)
            plots(meta, t, os.path.splitext(os.path.basename(path))[0])
    page = render(paths)
    for path in find_results(is_real_teacher):
        with open(path) as f:
            page += "\n" + render_real_teacher(json.load(f))
    with open(os.path.join(DOCS, "benchmarks.md"), "w") as f:
        f.write(page)
    print("wrote docs/benchmarks.md")
    if os.path.exists(PERF_NOTES_GRID) and os.path.exists(PERF_NOTES_TUNING):
        with open(PERF_NOTES) as f:
            text = perf_notes(f.read(), PERF_NOTES_GRID, PERF_NOTES_TUNING, PERF_NOTES_TRAINING,
                              PERF_NOTES_CURRENT_GRID)
        with open(PERF_NOTES, "w") as f:
            f.write(text)
        print("wrote the bounds, tuning, remaining-gap and grid-refresh tables of docs/perf-notes.md")


def render_results(doc: str, blocks, path: str, tuning_path: str | None = None) -> None:
    """Write ``blocks(data, tuning)`` (name -> markdown) into ``doc``: ``data`` read from the results file ``path``,
    ``tuning`` from ``tuning_path`` (the sweep's run; read once when it is ``path`` itself or None).

    Example (not run: it writes a page)::

        render_results("docs/perf-notes.md", bench_hopper.blocks, bench_hopper.H100_RESULT, bench_hopper.H100_TUNING)
    """
    with open(path) as f:
        data = json.load(f)
    tuning = data
    if tuning_path is not None and os.path.abspath(tuning_path) != os.path.abspath(path):
        with open(tuning_path) as f:
            tuning = json.load(f)
    write_blocks(doc, blocks(data, tuning))


def paired_run_main(argv, description: str, run, blocks, result_name: str, h100_result: str,
                    doc: str = PERF_NOTES, extra: tuple[str, str] | None = None) -> None:
    """The command line of a script that measures this version against a copy of an earlier one and renders its
    tables into ``doc``: ``--against DIR`` runs ``run(DIR)`` and writes ``<out>/<gpu>-<result_name>`` (default
    ``benchmarks/results``); ``--render [FILE]`` writes ``blocks`` of ``FILE`` (default ``h100_result``) into ``doc``.
    ``extra``: ``(option, help)`` of one more, optional package copy, passed to ``run`` as its second argument (None
    when not given).

    Example (not run: it measures on a GPU)::

        paired_run_main(None, __doc__, run, blocks, "bf16-dq.json", H100_RESULT)
    """
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", help="a copy of the previous version's kernels/streamkl")
    parser.add_argument("--out", help=f"directory for <gpu>-{result_name}")
    parser.add_argument("--render", nargs="?", const=h100_result,
                        help=f"write the tables of a results file into docs/{os.path.basename(doc)}")
    if extra:
        parser.add_argument(extra[0], dest="extra", help=extra[1])
    args = parser.parse_args(argv)
    if args.render:
        render_results(doc, blocks, args.render)
        return
    if not args.against:
        parser.error("--against is required to measure (a copy of the previous version's kernels/streamkl)")
    from bench_attention_kl import gpu_tag, write_json

    data = run(args.against, args.extra) if extra else run(args.against)
    out = os.path.join(args.out or RESULTS, f"{gpu_tag(data['device'])}-{result_name}")
    write_json(out, data)
    for table in blocks(data).values():
        print(table)
    print(f"wrote {out}")


def load_package(path: str, name: str):
    """Import the package at ``path`` (a copy of an earlier version of one of ours, whose imports are relative) as
    ``name``, so that two versions run in one process on one machine for a paired comparison.

    Example (not run: it needs a copy)::

        base = load_package("/tmp/streamkl_v8", "streamkl_base")
    """
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def sign_test_p(successes: int, n: int) -> float:
    """Two-sided exact sign test: the probability, with no difference (p = 1/2 per round), of a split at least as
    uneven as ``successes`` of ``n``.

    Example:
        >>> round(sign_test_p(10, 10), 4), sign_test_p(5, 10)
        (0.002, 1.0)
    """
    k = max(successes, n - successes)
    tail = sum(math.comb(n, i) for i in range(k, n + 1)) / 2 ** n
    return min(1.0, 2 * tail)


if __name__ == "__main__":
    main()
