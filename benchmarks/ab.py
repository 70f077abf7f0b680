"""A/B: a living benchmark's calls on this tree's ``streamkl`` against the ``streamkl`` of another git revision.

The other revision is checked out with ``git worktree add`` into a temporary folder, and its ``kernels/streamkl`` is
imported under another module name (``streamkl_base``) in the same process, so both versions run on the same card,
the same inputs and the same clocks. Each case of the benchmark times both in alternating rounds (the order flips
every round); the verdict per case is the median of the per-round ratios with the exact sign test over the rounds.

    python benchmarks/ab.py HEAD~1                            # the grid's N = 8192 rows, fwd and fwd+bwd, 7 rounds
    python benchmarks/ab.py 5cfe097 --bench overhead --rounds 15 --out /tmp/ab.json
    python benchmarks/ab.py HEAD~1 --bench real --cases fp16 padded    # rows of the real-batches benchmark
    python benchmarks/ab.py HEAD --device cpu                 # the plumbing, on tiny CPU problems
    python benchmarks/ab.py /path/to/other/checkout           # a folder holding kernels/streamkl, used as it is

A benchmark takes part by defining ``ab_cases(device, quick)``: case name -> a function that, given a ``streamkl``
package, returns the zero-argument call to time (``BENCHES`` lists them). With 7 rounds the sign test can reach
p = 0.016; a case is called faster or slower only below p = 0.05.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, compare, do_bench_ms, load_package, paired_rounds, wall_ms, write_json

#: ``--bench`` name -> the module (in benchmarks/) whose ``ab_cases`` it times
BENCHES = {"grid": "bench_attention_kl", "overhead": "overhead", "real": "real_batches"}


@contextlib.contextmanager
def revision_tree(rev: str, repo: str = ROOT) -> Iterator[str]:
    """A detached ``git worktree`` of ``rev`` in a temporary folder, removed afterwards.

    Example (not run: it adds a worktree to the repository)::

        with revision_tree("HEAD~1") as tree:
            base = load_revision(tree)
    """
    folder = tempfile.mkdtemp(prefix="streamkl-ab-")
    subprocess.run(["git", "-C", repo, "worktree", "add", "--detach", "--quiet", folder, rev], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", folder], check=False)


def load_revision(tree: str, name: str = "streamkl_base"):
    """The ``streamkl`` package of the checkout ``tree``, imported as ``name``.

    Example:
        >>> load_revision(ROOT, "streamkl_this_tree").__name__
        'streamkl_this_tree'
    """
    return load_package(os.path.join(tree, "kernels", "streamkl"), name)


def timer_for(device: str) -> Callable[[Callable], float]:
    """``do_bench``'s median on a GPU, the median of 10 wall-clock calls on the CPU (ms).

    Example:
        >>> timer_for("cpu")(lambda: None) >= 0
        True
    """
    return do_bench_ms if device != "cpu" else (lambda fn: wall_ms(fn, device="cpu"))


def run(cases: dict[str, Callable], new, base, rounds: int, timer: Callable[[Callable], float]) -> dict:
    """Each case of ``cases`` on ``new`` and ``base`` in ``rounds`` alternating rounds: case -> :func:`common.compare`
    with the times of every round.

    Example:
        >>> import types
        >>> new, base = types.SimpleNamespace(cost=1.0), types.SimpleNamespace(cost=2.0)
        >>> out = run({"x": lambda pkg: lambda: pkg.cost}, new, base, 7, timer=lambda fn: fn())
        >>> out["x"]["verdict"], out["x"]["ratio"], out["x"]["new_ms"]
        ('faster', 0.5, [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    """
    out = {}
    for name, case in cases.items():
        times = paired_rounds({"new": case(new), "base": case(base)}, rounds, timer)
        out[name] = {**compare(times["new"], times["base"]), "new_ms": times["new"], "base_ms": times["base"]}
    return out


def table(results: dict) -> str:
    """The verdicts as a markdown table.

    Example:
        >>> from common import compare
        >>> print(table({"N8192 fwd": compare([0.9] * 7, [1.0] * 7)}).splitlines()[-1])
        | N8192 fwd | 0.900 | 1.000 | 0.900× | 7 of 7 | 0.0156 | faster |
    """
    lines = ["| case | this tree ms | other ms | this / other | rounds faster | sign test p | verdict |",
             "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['median_new']:.3f} | {r['median_base']:.3f} | {r['ratio']:.3f}× | "
                     f"{r['faster']} of {r['rounds']} | {r['p']:.3g} | {r['verdict']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rev", help="the git revision to compare this tree with, or a checkout's folder")
    parser.add_argument("--bench", choices=sorted(BENCHES), default="grid")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for tiny problems (the plumbing)")
    parser.add_argument("--full", action="store_true", help="every case of the benchmark, not its quick ones")
    parser.add_argument("--cases", nargs="*", help="only the cases whose name contains one of these")
    parser.add_argument("--out", help="also write the results as JSON")
    args = parser.parse_args(argv)
    import streamkl

    cases = importlib.import_module(BENCHES[args.bench]).ab_cases(args.device, quick=not args.full)
    if args.cases:
        cases = {k: v for k, v in cases.items() if any(c in k for c in args.cases)}
    other = contextlib.nullcontext(args.rev) if os.path.isdir(args.rev) else revision_tree(args.rev)
    with other as tree:
        base = load_revision(tree)
        results = run(cases, streamkl, base, args.rounds, timer_for(args.device))
    print(table(results))
    if args.out:
        write_json(args.out, {"rev": args.rev, "bench": args.bench, "device": args.device, "cases": results})
    return results


if __name__ == "__main__":
    main()
