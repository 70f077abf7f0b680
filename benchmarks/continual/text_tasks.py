"""Three sentence-classification tasks built from text every Python installation carries: the docstrings of the
standard library (the MiniLM example's ``docstring_paragraphs``). Nothing is downloaded.

- ``topic``: does a sentence come from a module about the system (files, processes, networking) or about language
  and data (text, numbers, types)?
- ``order``: is the sentence as written, or were four consecutive words of it shuffled?
- ``continuation``: a pair of sentences: does the second follow the first in its paragraph, or was it drawn from
  another module?

Each task is balanced (two classes, equal counts). The held-out text that measures what the pretrained model
retains (``HELDOUT_MODULES`` of the example) is never used by a task.
"""

from __future__ import annotations

import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

from minilm_attention_transfer import HELDOUT_MODULES, docstring_paragraphs  # noqa: E402

TASKS = ("topic", "order", "continuation")
SYSTEM = ("os", "shutil", "pathlib", "tempfile", "glob", "fnmatch", "subprocess", "threading", "queue", "sched",
          "socket", "http.client", "urllib.parse", "urllib.request", "zipfile", "tarfile", "gzip", "bz2", "lzma",
          "signal", "selectors", "socketserver", "ssl", "stat", "filecmp", "fileinput", "concurrent.futures", "io",
          "mimetypes", "webbrowser", "logging", "multiprocessing", "asyncio.subprocess", "getpass", "netrc")
LANGUAGE = ("json", "csv", "re", "string", "textwrap", "difflib", "codecs", "pprint", "statistics", "decimal",
            "fractions", "numbers", "random", "heapq", "bisect", "itertools", "functools", "operator",
            "collections", "copy", "enum", "dataclasses", "typing", "inspect", "ast", "dis", "types", "keyword",
            "calendar", "datetime", "locale", "gettext", "html.parser", "xml.etree.ElementTree", "struct", "reprlib",
            "argparse", "contextlib", "pickle", "abc", "graphlib")
assert not set(SYSTEM + LANGUAGE) & set(HELDOUT_MODULES)


@dataclass
class TextExample:
    """One example: a sentence (``second`` for a pair) and its label."""

    first: str
    second: str | None
    label: int


def sentences(paragraph: str) -> list[str]:
    """The sentences of a paragraph with 5 to 40 words.

    Example:
        >>> sentences("Return the value of x. Short one. This sentence has more than six words in it.")
        ['Return the value of x.', 'This sentence has more than six words in it.']
    """
    parts = re.split(r"(?<=[.!?])\s+", paragraph)
    return [s for s in parts if 5 <= len(s.split()) <= 40]


def shuffle_window(sentence: str, rng: random.Random, width: int = 4) -> str:
    """``sentence`` with ``width`` consecutive words in another order (never the original one).

    Example:
        >>> shuffle_window("one two three four five six", random.Random(0))
        'one four three two five six'
    """
    words = sentence.split()
    start = rng.randrange(len(words) - width + 1)
    window = words[start:start + width]
    shuffled = window[:]
    while shuffled == window:
        rng.shuffle(shuffled)
    return " ".join(words[:start] + shuffled + words[start + width:])


def make_tasks(seed: int, train: int, test: int) -> dict[str, tuple[list[TextExample], list[TextExample]]]:
    """``{task: (train, test)}`` of ``train`` and ``test`` balanced examples each; ``seed`` draws them.

    Example:
        >>> tasks = make_tasks(0, train=20, test=10)
        >>> {k: (len(a), len(b), sum(e.label for e in a)) for k, (a, b) in tasks.items()}
        {'topic': (20, 10, 10), 'order': (20, 10, 10), 'continuation': (20, 10, 10)}
    """
    rng = random.Random(seed)
    system = [s for p in docstring_paragraphs(SYSTEM) for s in sentences(p)]
    language = [s for p in docstring_paragraphs(LANGUAGE) for s in sentences(p)]
    half = (train + test) // 2

    def split(examples: list[TextExample]) -> tuple[list[TextExample], list[TextExample]]:
        rng.shuffle(examples)
        ones, zeros = [e for e in examples if e.label], [e for e in examples if not e.label]
        tr, te = ones[: train // 2] + zeros[: train // 2], ones[train // 2: half] + zeros[train // 2: half]
        rng.shuffle(tr)
        return tr, te

    out = {}
    a, b = rng.sample(system, half), rng.sample(language, half)
    out["topic"] = split([TextExample(s, None, 1) for s in a] + [TextExample(s, None, 0) for s in b])
    long = [s for s in system + language if len(s.split()) >= 8]
    picked = rng.sample(long, 2 * half)
    out["order"] = split([TextExample(s, None, 1) for s in picked[:half]]
                         + [TextExample(shuffle_window(s, rng), None, 0) for s in picked[half:]])
    paragraphs = [sentences(p) for p in docstring_paragraphs(SYSTEM + LANGUAGE)]
    following = [(p[i], p[i + 1]) for p in paragraphs for i in range(len(p) - 1)]
    pool = system + language
    pairs = rng.sample(following, 2 * half) if len(following) >= 2 * half else \
        [rng.choice(following) for _ in range(2 * half)]
    out["continuation"] = split([TextExample(x, y, 1) for x, y in pairs[:half]]
                                + [TextExample(x, rng.choice(pool), 0) for x, _ in pairs[half:]])
    return out
