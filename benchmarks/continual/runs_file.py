"""The resumable runs file of the continual benchmarks (``split_digits.py``, ``minilm_sequence.py``): one JSON run per
line, appended under a lock by every shard, keyed by the configuration's fingerprint and the run's identity.

Example:
    >>> run = {"validation": False, "method": "lwf", "options": {"lam": 1.0}, "seed": 0, "order": 2}
    >>> run_key(run)
    'eval|lwf|lam=1.0|0|2'
    >>> len(unique([{**run, "config": "a"}, {**run, "config": "a"}, {**run, "config": "b"}]))
    2
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from typing import Any


def fingerprint(cfg: dict[str, Any], keys: tuple[str, ...]) -> str:
    """A short hash of ``cfg``'s entries ``keys``: what changes a run's outcome (not its seed, order or method)."""
    keep = {k: cfg[k] for k in keys}
    return hashlib.sha1(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:12]


def run_key(run: dict[str, Any]) -> str:
    """What a run is: tuning or evaluation, its setting (when the benchmark has several), method, options, seed and
    order."""
    opts = ",".join(f"{k}={v}" for k, v in sorted(run["options"].items()))
    setting = f"{run['setting']}|" if "setting" in run else ""
    return f"{'tune' if run['validation'] else 'eval'}|{setting}{run['method']}|{opts}|{run['seed']}|{run['order']}"


def unique(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first run of each configuration and key (a run repeated by two processes counts once)."""
    seen: set[tuple[Any, str]] = set()
    out = []
    for run in runs:
        key = (run.get("config"), run_key(run))
        if key not in seen:
            seen.add(key)
            out.append(run)
    return out


def load_runs(path: str) -> list[dict[str, Any]]:
    """Every run in ``path`` (none when it does not exist yet)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def append(path: str, run: dict[str, Any]) -> None:
    """Append one run as a line of ``path``, under an exclusive lock (shards share the file)."""
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(json.dumps(run) + "\n")
        f.flush()
        fcntl.flock(f, fcntl.LOCK_UN)


def wait_for(fn: Callable[[], Any], timeout: float = 3 * 3600, every: float = 30.0) -> Any:
    """``fn()`` once it stops raising ``ValueError`` (runs of other shards still missing), polling every ``every``
    seconds for at most ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except ValueError:
            if time.monotonic() > deadline:
                raise
            time.sleep(every)
