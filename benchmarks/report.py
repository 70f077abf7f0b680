"""Turn benchmark results (``benchmarks/results/<gpu>.json``) into docs/benchmarks.md and PNG plots.

    python benchmarks/report.py                                   # every results file -> docs/
    python benchmarks/report.py benchmarks/results/nvidia-h100-80gb-hbm3.json

Runs on any machine (no GPU needed). Every ratio in the tables compares numbers measured in the same run.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
DOCS = os.path.join(HERE, "..", "docs")
IMG = os.path.join(DOCS, "img")


def load(path: str) -> tuple[dict, dict]:
    """Results file -> (meta, table) where table[shape_key][provider/mode] = ms | bytes | status."""
    with open(path) as f:
        raw = json.load(f)
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


def targets(meta, t) -> list[str]:
    """The issue's targets, each with the measured value and whether it is met."""
    rows = []

    def add(name, value, goal, ok):
        rows.append(f"| {name} | {value} | {goal} | {'met' if ok else '**missed**'} |")

    for d in (64, 128):
        for causal in (False, True):
            for n in (4096, 8192, 16384):
                r = t.get(plain(16, d, causal, n), {})
                f, cf, fa = r.get("streamkl/fwd"), r.get("sdpa-default/fwd"), r.get("sdpa-flash/fwd")
                b, cb = r.get("streamkl/bwd"), r.get("sdpa-default/bwd")
                if not all(isinstance(x, float) for x in (f, cf, fa, b, cb)):
                    continue
                tag = f"D={d} {'causal' if causal else 'full'} N={n}"
                add(f"fwd / cuDNN fwd, {tag}", f"{f / cf:.2f}×", "≤ 1.30×", f / cf <= 1.3)
                add(f"fwd / FA2 fwd, {tag}", f"{f / fa:.2f}×", "≤ 0.85×", f / fa <= 0.85)
                add(f"bwd / cuDNN bwd, {tag}", f"{b / cb:.2f}×", "≤ 1.00×", b / cb <= 1.0)
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
    return ["| target | measured | goal | |", "|---|---|---|---|", *rows]


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
    path = os.path.join(IMG, f"bench_time_vs_n_{tag}.png")
    fig.savefig(path, dpi=110)
    out.append(path)

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
    path = os.path.join(IMG, f"bench_memory_vs_n_{tag}.png")
    fig.savefig(path, dpi=110)
    out.append(path)
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
    path = os.path.join(IMG, "readme_memory_time.png")
    fig.savefig(path, dpi=110)
    out.append(path)
    plt.close("all")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="*")
    args = parser.parse_args()
    found = glob.glob(os.path.join(HERE, "results", "*.json"))
    paths = args.results or sorted(p for p in found if "tuning" not in p)
    doc = ["# Benchmarks", "",
           "Generated by `python benchmarks/report.py` from the results that `python benchmarks/bench_attention_kl.py` "
           "wrote (do not edit by hand). Times are `triton.testing.do_bench` medians in ms; every ratio compares "
           "numbers measured in the same run on the same card. Baselines: torch SDPA with its default backend "
           "(cuDNN on H100) and with the FLASH_ATTENTION backend (FA2), on the same shapes (one attention, "
           "which computes one softmax where the KL computes two); the naive materialising KL from "
           "`streamkl.naive`, eager and under `torch.compile`. \"bwd\" is the student backward (dQ_s, dK_s) with the "
           "graph retained; the default backward is the deterministic two-pass one, \"atomic bwd\" the one-pass "
           "backward with fp32 atomic dQ (`deterministic=False`). Bounds use the exp2 and bf16-matmul rates measured "
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
        for img in plots(meta, t, tag):
            rel = os.path.relpath(img, DOCS)
            doc += [f"![{os.path.basename(img)}]({rel})", ""]
        doc += ["### Headline: B=1, H=16, N=8192, bf16", "", *headline(meta, t), "",
                "### Targets (issue: speed and memory at the hardware limit)", "", *targets(meta, t), "",
                "### Memory: peak extra bytes of one forward+backward beyond the inputs", "", *memory(meta, t), "",
                "### Spot checks (fp16, fp32, GQA, D_t ≠ D_s, teacher gradients)", "", *spot_checks(meta, t), "",
                "### Full grid", *grid(meta, t), ""]
    with open(os.path.join(DOCS, "benchmarks.md"), "w") as f:
        f.write("\n".join(doc) + "\n")
    print("wrote docs/benchmarks.md")


if __name__ == "__main__":
    main()
