"""A durable count keeps every increment through a SIGKILL of its process, one file per
process; a file that is not a count is refused by name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.tasks.system.durable_count import DurableCount, read_counts

CHILD = """
import sys, time
from pathlib import Path
from asyncrl.tasks.system.durable_count import DurableCount
count = DurableCount.new(Path(sys.argv[1]), "delivered")
for _ in range(1000):
    count.add(3)
print("counted", flush=True)
time.sleep(600)
"""


def test_every_increment_survives_a_sigkill_of_the_counting_process(tmp_path: Path) -> None:
    totals = []
    for _ in range(2):  # a process and its restart: two files, summed by the reader
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "counted"
        finally:
            os.kill(child.pid, signal.SIGKILL)  # no close, no flush, no exit handler
            child.wait()
        totals.append(3000)
    counts = read_counts(tmp_path, "delivered")
    assert sorted(counts.values()) == totals and len(counts) == 2


def test_a_count_only_grows_and_is_read_back(tmp_path: Path) -> None:
    count = DurableCount.new(tmp_path / "counts", "delivered")
    count.add(5)
    count.add(0)
    with pytest.raises(ValueError, match="only grows, got -1"):
        count.add(-1)
    assert read_counts(tmp_path / "counts", "delivered") == {count.path.name: 5}
    assert read_counts(tmp_path / "counts", "other") == {} and read_counts(tmp_path / "absent", "delivered") == {}
    count.close()


def test_a_file_that_is_not_one_count_is_named(tmp_path: Path) -> None:
    (tmp_path / "delivered-1-2.count").write_bytes(b"\x01\x02\x03")
    with pytest.raises(ValueError, match=r"delivered-1-2\.count: holds 3 bytes, not one count of 8"):
        read_counts(tmp_path, "delivered")
