"""A data folder on S3 (a moto server): the data files under an ``s3://`` prefix, listed in
the order of their keys with their digests, by their full URIs."""

from __future__ import annotations

import hashlib
import json

import pytest
import s3_servers
import s3fs

from asyncrl.storage.train_manifest import TrainFile
from asyncrl.tasks.data.records import DatasetError
from asyncrl.tasks.data.train_files import list_train_files


def test_an_s3_prefix_lists_its_data_files_sorted_by_key(moto_endpoint: s3_servers.S3Endpoint) -> None:
    options = s3_servers.storage_options(moto_endpoint)
    bucket = s3_servers.create_bucket(moto_endpoint)
    store = s3fs.S3FileSystem(**options)
    contents = {
        "prompts/2026-12-02.jsonl": json.dumps({"question": "2+2?", "answer": "#### 4"}) + "\n",
        "prompts/2026-12-01.jsonl": json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n",
        "prompts/day/part-0.jsonl": json.dumps({"question": "3+3?", "answer": "#### 6"}) + "\n",
        "prompts/_SUCCESS": "",
        "prompts-old/2026-11-30.jsonl": "{}\n",  # beside the prefix, not under it
    }
    for key, text in contents.items():
        store.pipe(f"{bucket}/{key}", text.encode())

    listed = list_train_files(f"s3://{bucket}/prompts/", options)
    keys = ["prompts/2026-12-01.jsonl", "prompts/2026-12-02.jsonl", "prompts/day/part-0.jsonl"]
    assert listed == [
        TrainFile(f"s3://{bucket}/{key}", hashlib.sha256(contents[key].encode()).hexdigest()[:16]) for key in keys
    ]
    assert list_train_files(f"s3://{bucket}/prompts", options) == listed

    with pytest.raises(DatasetError, match=rf"^data\.train_path: s3://{bucket}/nothing/ is not there"):
        list_train_files(f"s3://{bucket}/nothing/", options)
