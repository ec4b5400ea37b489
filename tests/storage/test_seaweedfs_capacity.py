"""The session's SeaweedFS holds as many buckets as the suite makes, whatever the disk.

Every bucket is a SeaweedFS collection with at least one volume of its own; with weed's
defaults the number of volumes is free disk / 1 GiB, and a CI machine with less free disk
than this one failed its 41st-or-so bucket with an S3 ``InternalError`` ("No writable
volumes"). This writes to more buckets than a 48 GiB disk would have allowed.
"""

from __future__ import annotations

from typing import Any

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
