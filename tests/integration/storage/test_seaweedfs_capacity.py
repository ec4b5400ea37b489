"""The session's SeaweedFS holds as many buckets as the suite makes, whatever the disk.

Every bucket is a SeaweedFS collection with at least one volume of its own; with weed's
defaults the number of volumes is free disk / 1 GiB, and a CI machine with less free disk
than this one failed its 41st-or-so bucket with an S3 ``InternalError`` ("No writable
volumes"). This writes to more buckets than a 48 GiB disk would have allowed.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import s3_servers
import s3fs

BUCKETS = 60


def test_the_test_seaweedfs_takes_writes_in_many_new_buckets(seaweedfs_endpoint: Any) -> None:
    fs = s3fs.S3FileSystem(**s3_servers.storage_options(seaweedfs_endpoint))
    buckets = [s3_servers.create_bucket(seaweedfs_endpoint, prefix="capacity") for _ in range(BUCKETS)]
    for bucket in buckets:
        fs.pipe(f"{bucket}/probe", bucket.encode())
    fs.invalidate_cache()
    assert [fs.cat(f"{bucket}/probe") for bucket in buckets] == [b.encode() for b in buckets]


def test_the_test_seaweedfs_takes_writes_on_a_disk_less_than_one_percent_free(tmp_path: Path) -> None:
    """weed's default turns every volume read-only under 1 % free disk, and PUTs then hang.

    CI stop 24 ran out of time that way on a machine whose disk had a few GB free. The
    test store gets a floor of its own; this runs it on a 1 GiB tmpfs with 8 MiB free.
    """
    mount_point = tmp_path / "small-disk"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1g", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here to fill a small disk: {mounted.stderr.strip()}")
    try:
        with open(mount_point / "fill", "wb") as fill:
            for _ in range(1024 - 8):
                fill.write(bytes(2**20))
        assert shutil.disk_usage(mount_point).free < 0.01 * shutil.disk_usage(mount_point).total
        with s3_servers.seaweedfs_server(mount_point / "weed", start_timeout_s=30.0) as endpoint:
            fs = s3fs.S3FileSystem(**s3_servers.storage_options(endpoint), skip_instance_cache=True)
            bucket = s3_servers.create_bucket(endpoint, prefix="small-disk")
            fs.pipe(f"{bucket}/shard", b"x" * 100_000)
            assert fs.cat(f"{bucket}/shard") == b"x" * 100_000
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)
