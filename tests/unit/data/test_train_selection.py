"""Which files of a growing data folder a run trains on (a pure function): the new ones, a
seeded share of the earlier ones, everything when nothing is new."""

from __future__ import annotations

import pytest

from asyncrl.storage.train_manifest import TrainFile
from asyncrl.tasks.data.train_selection import select_train_files


def files(*names: str, digest: str = "d") -> list[TrainFile]:
    return [TrainFile(f"/data/{name}.jsonl", f"{digest}-{name}") for name in names]


def test_a_run_trains_on_the_files_no_earlier_run_trained_on_in_listing_order() -> None:
    listing = files("a", "b", "c", "d")
    chosen = select_train_files(listing, set(files("b", "d")), replay_fraction=0.0, seed=0)
    assert chosen.files == chosen.new == tuple(files("a", "c"))
    assert chosen.replayed == () and chosen.listed == 4


def test_the_first_run_trains_on_every_file() -> None:
    listing = files("a", "b")
    assert select_train_files(listing, (), 0.5, seed=3).files == tuple(listing)


def test_a_rewritten_file_counts_as_new() -> None:
    listing = [TrainFile("/data/a.jsonl", "new-bytes"), *files("b")]
    earlier = {TrainFile("/data/a.jsonl", "old-bytes"), *files("b")}
    chosen = select_train_files(listing, earlier, 0.0, seed=0)
    assert chosen.new == (TrainFile("/data/a.jsonl", "new-bytes"),)


def test_a_file_gone_from_the_folder_is_not_replayed() -> None:
    chosen = select_train_files(files("c"), set(files("a", "b")), 1.0, seed=0)
    assert chosen.files == tuple(files("c")) and chosen.replayed == ()


@pytest.mark.parametrize(
    ("fraction", "new", "old", "replayed"),
    [(0.0, 3, 5, 0), (0.25, 3, 5, 1), (0.5, 3, 5, 2), (1.0, 3, 5, 3), (1.0, 3, 2, 2), (0.1, 30, 40, 3), (0.01, 1, 9, 1)],
)
def test_replay_takes_ceil_of_the_fraction_times_the_new_files(fraction: float, new: int, old: int, replayed: int) -> None:
    old_files = files(*(f"old{i}" for i in range(old)))
    new_files = files(*(f"new{i}" for i in range(new)))
    chosen = select_train_files([*old_files, *new_files], set(old_files), fraction, seed=0)
    assert chosen.new == tuple(new_files)
    assert len(chosen.replayed) == replayed and set(chosen.replayed) <= set(old_files)
    assert chosen.files == tuple(f for f in [*old_files, *new_files] if f in set(chosen.replayed) | set(new_files))


def test_replay_picks_are_fixed_by_the_seed_and_move_with_it_and_with_the_new_files() -> None:
    old_files = files(*(f"old{i:02d}" for i in range(40)))
    listing = [*old_files, *files("new")]
    picks = {seed: select_train_files(listing, set(old_files), 1.0, seed).replayed for seed in range(8)}
    assert picks[0] == select_train_files(listing, set(old_files), 1.0, 0).replayed  # same inputs, same picks
    assert len(set(picks.values())) > 1  # the seed chooses
    # The folder's order does not matter, only the files.
    assert set(select_train_files(list(reversed(listing)), set(old_files), 1.0, 0).replayed) == set(picks[0])
    # Tomorrow's new files (same seed) draw again.
    tomorrow = {select_train_files([*old_files, *files(f"next{i}")], set(old_files), 1.0, 0).replayed for i in range(8)}
    assert len(tomorrow) > 1


def test_nothing_new_trains_on_every_file_and_says_none_is_new() -> None:
    listing = files("a", "b")
    chosen = select_train_files(listing, set(listing), 0.5, seed=0)
    assert chosen.files == tuple(listing) and chosen.new == () and chosen.replayed == ()


@pytest.mark.parametrize("fraction", [-0.1, 1.5])
def test_a_fraction_outside_zero_to_one_is_refused_naming_the_field(fraction: float) -> None:
    with pytest.raises(ValueError, match=r"data\.replay_fraction: .* must be in \[0, 1\]"):
        select_train_files(files("a"), (), fraction, seed=0)
