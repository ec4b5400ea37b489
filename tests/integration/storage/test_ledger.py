from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from asyncrl.storage import fs, paths
from asyncrl.storage.fs import RunRoot, open_root
from asyncrl.storage.ledger import Ledger


def shard(seq: int) -> str:
    return paths.shard_name(seq, seq // 2, seq // 2 + 1)


def test_record_entries_consumed_last_step(root: RunRoot) -> None:
    ledger = Ledger(root)
    assert ledger.entries() == [] and ledger.consumed() == set() and ledger.last_step() is None
    ledger.record(0, [shard(0), shard(1)])
    ledger.record(1, [shard(2)])
    ledger.record(5, [shard(3)])
    entries = ledger.entries()
    assert [(e.step, e.shards) for e in entries] == [(0, (shard(0), shard(1))), (1, (shard(2),)), (5, (shard(3),))]
    assert ledger.consumed() == {shard(i) for i in range(4)}
    assert ledger.last_step() == 5
    stored = json.loads(fs.read_bytes(root, paths.ledger_entry(1)))
    assert stored["step"] == 1 and stored["shards"] == [shard(2)]


def test_reuse_and_double_record_are_refused(root: RunRoot) -> None:
    ledger = Ledger(root)
    ledger.record(3, [shard(0), shard(1)])
    with pytest.raises(ValueError, match=f"shard {shard(1)} was already consumed by step 3"):
        ledger.record(4, [shard(2), shard(1)])
    with pytest.raises(ValueError, match="step 3 is already recorded"):
        ledger.record(3, [shard(5)])
    with pytest.raises(ValueError, match=r"step 2 is not after \(last recorded step 3\)"):
        ledger.record(2, [shard(5)])
    with pytest.raises(ValueError, match="listed twice"):
        ledger.record(4, [shard(5), shard(5)])
    with pytest.raises(ValueError, match="'notes.txt' is not a shard file name"):
        ledger.record(4, ["notes.txt"])
    with pytest.raises(ValueError, match="no shards"):
        ledger.record(4, [])
    assert [e.step for e in ledger.entries()] == [3]
    assert ledger.consumed() == {shard(0), shard(1)}


def test_rollback_makes_shards_unconsumed(root: RunRoot) -> None:
    ledger = Ledger(root)
    for step in range(4):
        ledger.record(step, [shard(step)])
    assert ledger.rollback_after(1) == [2, 3]
    assert ledger.last_step() == 1
    assert ledger.consumed() == {shard(0), shard(1)}
    ledger.record(2, [shard(3), shard(2)])
    assert ledger.rollback_after(5) == []
    assert ledger.rollback_after(-1) == [0, 1, 2]
    assert ledger.entries() == []


def test_concurrent_record_of_one_step_has_one_winner(root_spec) -> None:
    outcomes: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(4)

    def attempt(index: int) -> None:
        ledger = Ledger(root_spec.open())
        barrier.wait()
        try:
            ledger.record(7, [shard(10 + index)])
            result = f"won-{index}"
        except ValueError as exc:
            assert "step 7" in str(exc)
            result = "lost"
        with lock:
            outcomes.append(result)

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [o for o in outcomes if o.startswith("won")]
    assert len(winners) == 1 and len(outcomes) == 4
    entries = Ledger(root_spec.open()).entries()
    assert [(e.step, e.shards) for e in entries] == [(7, (shard(10 + int(winners[0].split("-")[1])),))]


_POLLER = """
import json, sys, time
from asyncrl.storage import fs, paths
from asyncrl.storage.fs import open_root
from asyncrl.storage.ledger import Ledger

uri, options, steps, per_step = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
root = open_root(uri, options)
ledger = Ledger(root)
verified, listings = set(), 0
assert ledger.steps() == [], "ledger not empty at start"
print("ready", flush=True)  # the writer starts only once this reader is polling
deadline = time.monotonic() + 120
while len(verified) < steps and time.monotonic() < deadline:
    listings += 1
    for step in ledger.steps():
        if step in verified:
            continue
        content = json.loads(fs.read_bytes(root, paths.ledger_entry(step)))
        if len(content["shards"]) != per_step:
            raise SystemExit(f"step {step}: {len(content['shards'])} shards visible")
        verified.add(step)
assert [e.step for e in ledger.entries()] == list(range(steps)), "entries() disagrees"
print(json.dumps({"verified": sorted(verified), "listings": listings}), flush=True)
"""


def test_entries_are_never_partially_visible(root_spec) -> None:
    """Another process polling while large entries are written only ever reads whole entries."""
    # Local entries are large (~0.9 MB) so a non-atomic write would stay visible long enough
    # to be caught; an S3 PUT is atomic by protocol, smaller entries keep the test fast.
    steps, per_step = 5, 20_000 if root_spec.backend == "local" else 2_000
    poller = subprocess.Popen(
        [sys.executable, "-c", _POLLER, root_spec.uri, json.dumps(root_spec.options), str(steps), str(per_step)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert poller.stdout is not None and poller.stdout.readline().strip() == "ready"
        writer = Ledger(root_spec.open())
        for step in range(steps):
            writer.record(step, [shard(step * per_step + i) for i in range(per_step)])
        out, err = poller.communicate(timeout=120)
    finally:
        if poller.poll() is None:
            poller.kill()
            poller.wait()
    assert poller.returncode == 0, err[-2000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["verified"] == list(range(steps))


def test_corrupt_entry_is_named(tmp_path: Path) -> None:
    root = open_root(str(tmp_path))
    fs.put_if_absent(root, paths.ledger_entry(2), b'{"step": 2, "shards": [')
    with pytest.raises(ValueError, match="step-00000002.json: corrupt ledger entry"):
        Ledger(root).entries()
    fs.put_if_absent(root, paths.ledger_entry(3), json.dumps({"step": 4, "shards": [], "recorded_at": 0}).encode())
    fs.delete(root, paths.ledger_entry(2))
    with pytest.raises(ValueError, match="entry says step 4, its name says 3"):
        Ledger(root).consumed()
    assert sorted(os.listdir(tmp_path / paths.LEDGER_DIR)) == ["step-00000003.json"]


def test_record_reads_the_entries_once_then_writes_one_object_per_step(
    root: RunRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    Ledger(root).record(1, [shard(0)])
    calls: list[str] = []
    for name in ("read_bytes", "read_many", "list_dir", "exists", "put_if_absent"):
        real = getattr(fs, name)
        monkeypatch.setattr(fs, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
    ledger = Ledger(root)  # a restarted writer: one initial read of the entries
    ledger.record(2, [shard(1)])
    initial = len(calls)
    assert initial >= 2
    for step in range(3, 8):
        calls.clear()
        ledger.record(step, [shard(step)])
        assert calls == ["put_if_absent"]
    with pytest.raises(ValueError, match=f"shard {shard(1)} was already consumed by step 2"):
        ledger.record(8, [shard(1)])
    with pytest.raises(ValueError, match="step 7 is already recorded"):
        ledger.record(7, [shard(9)])


def test_rollback_restores_the_shards_of_each_dropped_step_before_deleting_it(root: RunRoot) -> None:
    ledger = Ledger(root)
    for step in range(1, 5):
        ledger.record(step, [shard(2 * step), shard(2 * step + 1)])
    restored: list[tuple[str, ...]] = []

    def restore_then_die(names: object) -> None:
        restored.append(tuple(names))  # type: ignore[arg-type]
        if len(restored) == 2:
            raise KeyboardInterrupt  # killed while restoring step 3

    with pytest.raises(KeyboardInterrupt):
        ledger.rollback_after(2, restore_then_die)
    assert ledger.steps() == [1, 2, 3]  # step 4's shards were restored, then its entry deleted
    assert ledger.rollback_after(2, restored.append) == [3]  # the repeat restores step 3 again
    assert restored == [(shard(8), shard(9)), (shard(6), shard(7)), (shard(6), shard(7))]
    # The writer state follows the rollback: step 3 and its shards are free again.
    ledger.record(3, [shard(6)])
    with pytest.raises(ValueError, match="already consumed by step 2"):
        ledger.record(4, [shard(4)])
