"""Synthetic sequence-classification tasks whose solutions need different attention patterns.

Every example is ``[CLS, t_1, ..., t_N]``; the classifier reads the CLS position of the last layer, so whatever a
task needs must be routed there by attention. Each task has ``CLASSES`` classes and reads the *value*
``v = token - offset`` (0..15) of content tokens:

- ``position``: the class (``v // 4``) of the token at content position 3 (a fixed positional lookup);
- ``keyword``: one of 4 keyword tokens sits at a random position; which one (a lookup by content);
- ``majority``: the value group (``v // 4``) that occurs most often (uniform attention that counts);
- ``last``: the class of the last token (another fixed positional lookup, competing with ``position``);
- ``marker``: one ``MARK`` token sits at a random position; the class of the token right after it (find a token
  by content, then look one step to the right: two layers; slow to learn at this size).

``vocab="shared"``: every task draws its tokens from the same 16 values. ``vocab="disjoint"``: task ``t`` has its
own 16 token ids (the same values, other embeddings), a crude model of a domain shift (a new language, a new
modality): the old tasks' inputs never reappear, so output distillation on new inputs says little about them.
"""

from __future__ import annotations

import torch

CLS, MARK = 0, 1
VALUES = 16  # content values per task
KEYWORDS = 4  # keyword tokens per task
CLASSES = 4
TASKS = ("position", "keyword", "majority", "last", "marker")
PER_TASK = VALUES + KEYWORDS


def vocab_size(num_tasks: int, vocab: str) -> int:
    """Token ids: CLS, MARK, then 16 content and 4 keyword ids (shared), or that many per task (disjoint)."""
    return 2 + PER_TASK * (num_tasks if vocab == "disjoint" else 1)


def make_task(name: str, index: int, n: int, length: int, *, vocab: str,
              seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` examples of task ``name``, the ``index``-th of the sequence: ids ``[n, 1 + length]``, labels ``[n]``.

    Labels are balanced (each class is drawn first, then an input that has it).
    """
    g = torch.Generator().manual_seed(seed)
    offset = 2 + (PER_TASK * index if vocab == "disjoint" else 0)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    v = torch.randint(0, VALUES, (n, length), generator=g)
    group = VALUES // CLASSES

    def with_class(cls: torch.Tensor) -> torch.Tensor:  # a value of class `cls` (v // 4 == cls)
        return cls * group + torch.randint(0, group, cls.shape, generator=g)

    rows = torch.arange(n)
    if name == "position":
        v[:, 3] = with_class(y)
    elif name == "last":
        v[:, -1] = with_class(y)
    elif name == "keyword":
        where = torch.randint(0, length, (n,), generator=g)
        v[rows, where] = VALUES + y  # keyword ids follow the content ids
    elif name == "marker":
        where = torch.randint(0, length - 1, (n,), generator=g)
        v[rows, where + 1] = with_class(y)
    elif name == "majority":
        # draw value groups uniformly, keep the sequences with a strict majority group: that group is the class
        groups = torch.randint(0, CLASSES, (4 * n, length), generator=g)
        counts = torch.zeros(4 * n, CLASSES, dtype=torch.long).scatter_add_(1, groups, torch.ones_like(groups))
        top = counts.topk(2, dim=1).values
        keep = (top[:, 0] > top[:, 1]).nonzero().squeeze(1)[:n]
        groups, y = groups[keep], counts[keep].argmax(1)
        v = groups * group + torch.randint(0, group, (n, length), generator=g)
    else:
        raise ValueError(f"Expected a task in {TASKS}, but got {name!r}.")
    ids = v + offset
    if name == "marker":
        ids[rows, where] = MARK
    x = torch.cat([torch.full((n, 1), CLS), ids], 1)
    return x, y
