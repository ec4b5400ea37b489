"""The trainer's feed takes shards in the order they were written, so batch-aligned shards
give every step exactly its admission batch (no engine needed)."""

from __future__ import annotations

from pathlib import Path

from asyncrl.storage.fs import RunRoot, open_root
from asyncrl.storage.schema import Sample
from asyncrl.storage.shards import ShardReader, ShardWriter
from asyncrl.tasks.scheduler.group_schedule import group_id, group_index
from asyncrl.tasks.trainer.feed import ShardFeed, StepInput

RUN_ID = "feed-test"


def group(index: int, version: int) -> list[Sample]:
    return [
        Sample(f"p{index}", group_id(index), [1, 2], [3, 4], [-0.5, -0.5], [version, version], 1.0, "stop", 1.0, 2.0)
        for _ in range(2)
    ]


def write(root: RunRoot, *groups: tuple[int, int]) -> str:
    """A shard of (group index, token version) pairs."""
    return ShardWriter(root, RUN_ID).write_groups([group(k, v) for k, v in groups]).name


def feed(root: RunRoot) -> ShardFeed:
    return ShardFeed(ShardReader(root, RUN_ID), vocab_size=100, token_budget=64)


def indices(taken: StepInput | None) -> list[int]:
    assert taken is not None
    return [group_index(g[0].group_id) for g in taken.groups]


def test_shards_are_taken_in_written_order_not_by_oldest_policy(tmp_path: Path) -> None:
    """Batch 1's shard holds only tokens of version 1, batch 2's a token of version 0 (a group
    whose first token came before an update): by oldest policy batch 2 would overtake
    batch 1, which would then be trained a step late."""
    root = open_root(str(tmp_path / "run"))
    first = write(root, (0, 1), (1, 1))
    second = write(root, (2, 0), (3, 2))
    taken = feed(root).take(2)
    assert taken is not None and taken.shards == (first,) and indices(taken) == [0, 1]
    assert [info.name for info in ShardReader(root, RUN_ID).list_pending()] == [second, first]  # oldest policy first


def test_batch_aligned_shards_give_exactly_b_groups_per_step(tmp_path: Path) -> None:
    root = open_root(str(tmp_path / "run"))
    write(root, (0, 0))
    write(root, (1, 0), (2, 0))  # completes batch 0 (B = 3)
    write(root, (3, 0), (4, 1), (5, 1))
    shards = feed(root)
    step_1 = shards.take(3)
    assert indices(step_1) == [0, 1, 2] and len(step_1.shards) == 2
    assert indices(shards.take(3, consumed=set(step_1.shards))) == [3, 4, 5]


def test_shards_that_do_not_line_up_give_more_groups_never_fewer(tmp_path: Path) -> None:
    """An older scheduler's shards: a step takes whole shards until it holds B groups."""
    root = open_root(str(tmp_path / "run"))
    write(root, (0, 0), (1, 0))
    write(root, (2, 0), (3, 0))
    assert feed(root).take(3) is not None and indices(feed(root).take(3)) == [0, 1, 2, 3]
    assert feed(root).take(5) is None


def test_the_tokens_of_samples_dropped_as_too_stale_are_counted_as_wasted(tmp_path: Path) -> None:
    from asyncrl.tasks.trainer.loop import stale_tokens

    step_input = StepInput(("s",), (tuple(group(0, 0)), tuple(group(1, 3))))
    # trainer at 4 steps, bound 2: group 0 (staleness 4) is dropped, group 1 (1) is not
    assert stale_tokens(step_input, 2, 4, lambda v: v) == 2 * 2
    assert stale_tokens(step_input, None, 4, lambda v: v) == 0
    assert stale_tokens(step_input, 4, 4, lambda v: v) == 0
