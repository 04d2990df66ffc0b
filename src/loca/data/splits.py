"""Seeded, recorded train / held-out / test splits.

Policy (see ``docs/tasks.md``):

- **Train pool** = the task's train split. A task without one at its source (BoolQ and HellaSwag
  in the local copy, a single user file) has its validation split *partitioned* once, by a
  permutation with the fixed seed :data:`PARTITION_SEED`, into a train pool and a test part
  (:data:`PARTITION_TEST_FRACTION` of the items go to the test part). The partition does not
  depend on the run's seed or sizes, so every run of a task sees the same test part.
- **Groups**: a task with ``group_by`` (BoolQ: the passage, HellaSwag: the source context, see
  :class:`loca.data.tasks.Grouping`) is partitioned by group, not by item: the groups are
  permuted and whole groups go to the test part until it holds the test fraction, so no test
  passage is ever in the train pool. Without ``group_by`` every item is its own group, which is
  exactly the item partition.
- **Train** = the first ``n_train`` items of a seeded permutation of the pool; **held-out** = the
  last ``n_heldout`` items of the same permutation. They are disjoint, the held-out set does not
  change with ``n_train``, and a larger ``n_train`` extends a smaller one. For a grouped task the
  permutation is of groups (items of a group kept together, in file order), and train skips the
  items of any group the held-out set touches, so train and held-out share no group either.
- **Test** = the official validation split (or its test part); ``n_test`` (None or 0 = all) takes a
  seeded sample of it, kept in file order. It depends only on the task, ``n_test`` and ``seed``,
  so ``loca evaluate`` with the same seed sees the same test set as a fit.

Permutations order indices by ``sha256(f"{purpose}:{seed}:{index}")``: reproducible on any
platform and Python/NumPy version. Every index and id used is recorded in ``Splits.record``;
what the examples say (not only which ones they are) is hashed by :func:`content_sha256`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from .schema import Example
from .sources import describe_source, has_split, load_task_split
from .tasks import Task, get_task

DEFAULT_N_TRAIN = 256
DEFAULT_N_HELDOUT = 128
DEFAULT_N_TEST: int | None = None  # all
DEFAULT_SEED = 0
PARTITION_SEED = 0
PARTITION_TEST_FRACTION = 0.5


def permutation(n: int, seed: int, purpose: str) -> list[int]:
    """A seeded permutation of ``range(n)``, stable across platforms and library versions."""

    def key(i: int) -> bytes:
        return hashlib.sha256(f"{purpose}:{seed}:{i}".encode()).digest()

    return sorted(range(n), key=key)


def content_sha256(examples: Iterable[Example]) -> str:
    """sha256 of what ``examples`` say, in order: id, question, passage, choices and label of each.
    Two loads of a file agree on it exactly when every example is the same, so it tells a file
    edited under the same ids (labels flipped, a question reworded) from the one a result was made
    from, which the ids and indices of ``Splits.record`` cannot."""
    h = hashlib.sha256()
    for ex in examples:
        row = [ex.id, ex.question, ex.passage, list(ex.choices), ex.label]
        h.update(json.dumps(row, ensure_ascii=False).encode())
        h.update(b"\n")
    return h.hexdigest()


def group_ids(task: Task, examples: list[Example]) -> list[int] | None:
    """The group of each example under ``task.group_by`` (None when the task is not grouped).

    Examples that share a link key of the task's grouping (``task.group_by.keys``),
    directly or through other examples, are one group. Groups are numbered 0, 1, ... in order of
    their first example, so the numbering does not depend on anything but the examples' order.
    """
    if task.group_by is None:
        return None
    keys_of = task.group_by.keys
    parent = list(range(len(examples)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[str, int] = {}
    for i, ex in enumerate(examples):
        for key in keys_of(ex):
            j = owner.setdefault(key, i)
            a, b = root(i), root(j)
            parent[max(a, b)] = min(a, b)  # the root is the group's first example
    number: dict[int, int] = {}
    return [number.setdefault(root(i), len(number)) for i in range(len(examples))]


def _members(groups: list[int] | None, n: int) -> list[list[int]]:
    """Positions of each group's members, in order (one group per item when ungrouped)."""
    if groups is None:
        return [[i] for i in range(n)]
    members: list[list[int]] = [[] for _ in range(max(groups, default=-1) + 1)]
    for i, g in enumerate(groups):
        members[g].append(i)
    return members


def shared_with(test: list[Example], pool: list[Example], keys) -> int:
    """How many ``test`` examples share a key (``keys(example) -> set``) with some ``pool`` example."""
    pool_keys = set().union(*map(keys, pool)) if pool else set()
    return sum(bool(keys(ex) & pool_keys) for ex in test)


@dataclass
class Splits:
    """Train, held-out and test examples and a JSON-friendly record of how they were drawn."""

    train: list[Example]
    heldout: list[Example]
    test: list[Example]
    record: dict = field(default_factory=dict)

    def content_sha256(self) -> dict[str, str]:
        """:func:`content_sha256` of the train, held-out and test examples."""
        return {
            "train": content_sha256(self.train),
            "heldout": content_sha256(self.heldout),
            "test": content_sha256(self.test),
        }


def degenerate_warnings(splits: Splits) -> list[str]:
    """What makes a task's numbers misleading: examples with one choice (ranking accuracy is 1
    for them), repeated choice texts (a tie decided by order), and test examples whose question
    and passage also occur in the training or held-out examples."""
    out = []
    parts = {"train": splits.train, "held-out": splits.heldout, "test": splits.test}
    for name, examples in parts.items():
        single = sum(len(ex.choices) < 2 for ex in examples)
        if single:
            out.append(f"{single} {name} example(s) have a single choice: their ranking accuracy is always 1")
        repeated = sum(len(set(ex.choices)) < len(ex.choices) for ex in examples)
        if repeated:
            out.append(f"{repeated} {name} example(s) repeat a choice text: a tie that the order decides")
    seen = {(ex.question, ex.passage) for ex in splits.train + splits.heldout}
    overlap = sum((ex.question, ex.passage) in seen for ex in splits.test)
    if overlap:
        out.append(
            f"{overlap} test example(s) have the same question and passage as a training or "
            "held-out example: test numbers overstate generalisation"
        )
    return out


@dataclass
class _Pools:
    pool: list[Example]
    pool_indices: list[int]  # index of each pool item in its split file
    pool_split: str
    test: list[Example]
    test_indices: list[int]
    test_split: str
    partition: dict | None
    pool_groups: list[int] | None  # group of each pool item (None: not grouped)


def _check_size(name: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be non-negative, got {value}")


def _pools(task: Task, data_dir: str | Path | None) -> _Pools:
    validation = load_task_split(task, task.validation_split, data_dir)
    if has_split(task, task.train_split, data_dir):
        pool = load_task_split(task, task.train_split, data_dir)
        return _Pools(
            pool,
            list(range(len(pool))),
            task.train_split,
            validation,
            list(range(len(validation))),
            task.validation_split,
            None,
            group_ids(task, pool),
        )
    n = len(validation)
    groups = group_ids(task, validation)
    members = _members(groups, n)
    target = round(n * PARTITION_TEST_FRACTION)
    test_idx: list[int] = []
    for g in permutation(len(members), PARTITION_SEED, "partition"):
        if len(test_idx) >= target:
            break
        test_idx.extend(members[g])  # whole groups, until the test fraction is reached
    test_idx.sort()
    in_test = set(test_idx)
    pool_idx = [i for i in range(n) if i not in in_test]
    if not test_idx or not pool_idx or target < 1:
        what = f"{n} example(s)" + (f" in {len(members)} group(s)" if groups is not None else "")
        raise ValueError(
            f"task {task.name!r}: its validation split has {what}, too few to partition "
            "into a train pool and a test part"
        )
    partition = {
        "reason": f"no {task.train_split or 'train'} split available at the source",
        "split": task.validation_split,
        "seed": PARTITION_SEED,
        "test_fraction": PARTITION_TEST_FRACTION,
        "pool_size": len(pool_idx),
        "test_size": len(test_idx),
        "group_by": task.group_name,
        "n_groups": len(members) if groups is not None else None,
        "pool_groups": len({groups[i] for i in pool_idx}) if groups is not None else None,
        "test_groups": len({groups[i] for i in test_idx}) if groups is not None else None,
    }
    pool_groups = None
    if groups is not None:  # renumbered in pool order
        number: dict[int, int] = {}
        pool_groups = [number.setdefault(groups[i], len(number)) for i in pool_idx]
    return _Pools(
        [validation[i] for i in pool_idx],
        pool_idx,
        task.validation_split,
        [validation[i] for i in test_idx],
        test_idx,
        task.validation_split,
        partition,
        pool_groups,
    )


def _pool_positions(pools: _Pools, seed: int, n_heldout: int) -> tuple[list[int], list[int]]:
    """``(train candidates in order, held-out positions)`` in the pool for ``seed``.

    The pool is laid out group by group in a seeded permutation of its groups (of its items when
    ungrouped); held-out is the last ``n_heldout`` positions and train takes from the front,
    skipping every group the held-out set touches.
    """
    members = _members(pools.pool_groups, len(pools.pool))
    order = [p for g in permutation(len(members), seed, "pool") for p in members[g]]
    heldout = order[len(order) - n_heldout :]
    rest = order[: len(order) - n_heldout]
    if pools.pool_groups is not None:
        touched = {pools.pool_groups[p] for p in heldout}
        rest = [p for p in rest if pools.pool_groups[p] not in touched]
    return rest, heldout


def _select_test(task: Task, pools: _Pools, n_test: int | None, seed: int) -> tuple[list[int], dict]:
    _check_size("n_test", n_test, allow_none=True)
    available = len(pools.test)
    if not available:
        raise ValueError(f"task {task.name!r}: the test split is empty")
    if not n_test:
        chosen = list(range(available))
    elif n_test > available:
        raise ValueError(
            f"task {task.name!r}: n_test={n_test} exceeds the {available} test examples "
            f"({'test part of ' if pools.partition else ''}split {pools.test_split!r})"
        )
    else:
        chosen = sorted(permutation(available, seed, "test")[:n_test])
    record = {
        "split": pools.test_split,
        "available": available,
        "n": len(chosen),
        "indices": [pools.test_indices[i] for i in chosen],
        "ids": [pools.test[i].id for i in chosen],
    }
    return chosen, record


def _resolve(task: Task | str) -> Task:
    return get_task(task) if isinstance(task, str) else task


def _base_record(task: Task, pools: _Pools, data_dir: str | Path | None, seed: int) -> dict:
    return {
        "task": task.name,
        "template": task.template,
        "source": describe_source(task, data_dir),
        "seed": seed,
        "partition": pools.partition,
    }


def load_pool(
    task: Task | str, data_dir: str | Path | None = None
) -> tuple[list[Example], list[Example], dict | None]:
    """``(train pool, whole test split, partition record or None)``, e.g. to check overlap."""
    pools = _pools(_resolve(task), data_dir)
    return pools.pool, pools.test, pools.partition


def load_test(
    task: Task | str,
    *,
    n_test: int | None = DEFAULT_N_TEST,
    seed: int = DEFAULT_SEED,
    data_dir: str | Path | None = None,
) -> tuple[list[Example], dict]:
    """Only the test set of :func:`load_splits` (the same examples for the same arguments)."""
    task = _resolve(task)
    pools = _pools(task, data_dir)
    chosen, test_record = _select_test(task, pools, n_test, seed)
    record = _base_record(task, pools, data_dir, seed) | {"test": test_record}
    return [pools.test[i] for i in chosen], record


def load_splits(
    task: Task | str,
    *,
    n_train: int = DEFAULT_N_TRAIN,
    n_heldout: int = DEFAULT_N_HELDOUT,
    n_test: int | None = DEFAULT_N_TEST,
    seed: int = DEFAULT_SEED,
    data_dir: str | Path | None = None,
) -> Splits:
    """Seeded, disjoint train and held-out samples of the train pool, and the test set.

    Raises ``ValueError`` when ``n_train`` or ``n_heldout`` is below 1, when together they exceed
    the train pool (for a grouped task: the pool less the rest of the group held-out cuts into),
    or when ``n_test`` exceeds the test split.
    """
    task = _resolve(task)
    _check_size("n_train", n_train)
    _check_size("n_heldout", n_heldout)
    if n_train < 1 or n_heldout < 1:
        raise ValueError(
            f"n_train and n_heldout must be at least 1 (got {n_train} and {n_heldout}); "
            "use load_test() for the test set alone"
        )
    pools = _pools(task, data_dir)
    size = len(pools.pool)
    if n_train + n_heldout > size:
        where = (
            f"the train pool ({size} examples: the non-test part of split {pools.pool_split!r})"
            if pools.partition
            else f"the train pool ({size} examples in split {pools.pool_split!r})"
        )
        raise ValueError(f"task {task.name!r}: n_train + n_heldout = {n_train} + {n_heldout} exceeds {where}")
    candidates, heldout_pos = _pool_positions(pools, seed, n_heldout)
    if n_train > len(candidates):
        raise ValueError(
            f"task {task.name!r}: n_train = {n_train} exceeds the {len(candidates)} examples of the "
            f"train pool ({size} examples of split {pools.pool_split!r}) that share no "
            f"{task.group_name!r} group with the {n_heldout} held-out examples"
        )
    train_pos = candidates[:n_train]
    chosen, test_record = _select_test(task, pools, n_test, seed)

    def part(positions: list[int]) -> dict:
        return {
            "split": pools.pool_split,
            "n": len(positions),
            "indices": [pools.pool_indices[p] for p in positions],
            "ids": [pools.pool[p].id for p in positions],
        }

    record = _base_record(task, pools, data_dir, seed) | {
        "pool": {
            "split": pools.pool_split,
            "size": size,
            "group_by": task.group_name,
            "n_groups": None if pools.pool_groups is None else len(set(pools.pool_groups)),
        },
        "train": part(train_pos),
        "heldout": part(heldout_pos),
        "test": test_record,
    }
    return Splits(
        train=[pools.pool[p] for p in train_pos],
        heldout=[pools.pool[p] for p in heldout_pos],
        test=[pools.test[i] for i in chosen],
        record=record,
    )
