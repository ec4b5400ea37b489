"""Storage under injected S3 faults: the real s3fs against a real S3 server (moto; SeaweedFS
for signatures) through the fault proxy of ``tests/support/s3_fault_proxy.py``.

The workload test runs shards, ledger, weights and the rollout-server registry with a
quarter of all requests failed, delayed, dropped or cut off, and checks what the store
holds afterwards through a second root that talks to the server directly.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import s3_servers
from s3_fault_proxy import FAULT_KINDS, FaultPlan, FaultProxy, s3_fault_proxy
from safetensors.numpy import save_file

from asyncrl.configs.storage import StorageConfig
from asyncrl.storage import fs, paths
from asyncrl.storage.errors import StorageOperationError
from asyncrl.storage.fs import RunRoot, open_root
from asyncrl.storage.ledger import Ledger
from asyncrl.storage.retry import RetryPolicy
from asyncrl.storage.schema import Sample
from asyncrl.storage.shards import ShardReader, ShardWriter
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.inference.server_registry import list_servers, register_server, unregister_server
from asyncrl.tasks.inference.server import RolloutServerHandle

RUN = "fault-run"
FAULT_SHARE = 0.25
SEED = 7
# A request fails for good only if all its attempts fail: about (5/6 * 0.25) ** 8 = 4e-6
# (delays do not fail), so the ~300 requests of the workload pass.
ATTEMPTS = 8
DELAY_S = 0.05
# With match and max_faults: the server applies the request, the client never hears back.
LOST_ANSWER = {"drop_after": 1.0}


def faulty_plan(seed: int = SEED) -> FaultPlan:
    return FaultPlan.uniform(FAULT_SHARE, seed=seed, delay_s=DELAY_S)


@pytest.fixture
def proxy(moto_endpoint: s3_servers.S3Endpoint) -> Iterator[FaultProxy]:
    with s3_fault_proxy(moto_endpoint.url) as started:
        yield started


def open_via(
    endpoint: s3_servers.S3Endpoint, bucket: str, url: str | None = None, attempts: int | None = None
) -> RunRoot:
    """A run root in ``bucket`` reached at ``url`` (default: the server itself), with ``attempts`` per request."""
    options: dict[str, Any] = dict(s3_servers.storage_options(endpoint), endpoint_url=url or endpoint.url)
    if attempts is not None:
        options["config_kwargs"] = {"retries": {"mode": "standard", "total_max_attempts": attempts}}
    return open_root(f"s3://{bucket}/run", options)


def write_shards(
    root: RunRoot, writers: int, per_writer: int, group_factory: Callable[..., list[Sample]]
) -> dict[str, list[list[Sample]]]:
    """``writers`` threads each write ``per_writer`` one-group shards; return groups by shard name."""

    def work(index: int) -> dict[str, list[list[Sample]]]:
        writer = ShardWriter(root, RUN)
        mine = {}
        for j in range(per_writer):
            groups = [group_factory(f"w{index}-g{j}", size=2, versions=(j % 3, j % 3 + 1))]
            mine[writer.write_groups(groups).name] = groups
        return mine

    with ThreadPoolExecutor(writers) as pool:
        return {name: groups for mine in pool.map(work, range(writers)) for name, groups in mine.items()}


def weights_dir(base: Path, version: int) -> Path:
    """An HF-format directory with a random 64 KiB tensor, distinct per version."""
    directory = base / f"weights-v{version}"
    directory.mkdir(parents=True)
    tensor = np.random.default_rng(version).standard_normal((128, 128)).astype(np.float32)
    save_file({"w": tensor}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(f'{{"model_type": "qwen2", "v": {version}}}')
    return directory


def handle(port: int) -> RolloutServerHandle:
    url = f"http://127.0.0.1:{port}"
    return RolloutServerHandle(url=url, pid=port, pgid=port, log_path=Path("server.log"), model="m")


def test_workload_round_trips_through_faults(
    moto_endpoint: s3_servers.S3Endpoint, proxy: FaultProxy, group_factory: Callable[..., list[Sample]], tmp_path: Path
) -> None:
    bucket = s3_servers.create_bucket(moto_endpoint)
    root = open_via(moto_endpoint, bucket, proxy.url, ATTEMPTS)
    direct = open_via(moto_endpoint, bucket)
    proxy.set_plan(faulty_plan())

    written = write_shards(root, writers=3, per_writer=6, group_factory=group_factory)
    reader = ShardReader(root, RUN)
    shards = reader.list_shards()
    assert sorted(info.name for info in shards) == sorted(written)
    for info in shards:
        assert reader.read_groups(info) == written[info.name]

    ledger = Ledger(root)
    names = [info.name for info in shards]
    batches = [names[i : i + 4] for i in range(0, len(names), 4)]
    for step, batch in enumerate(batches):
        ledger.record(step, batch)
    assert [list(entry.shards) for entry in ledger.entries()] == batches

    store = WeightStore(root)
    for version in (1, 2, 3):
        store.publish(version, weights_dir(tmp_path / "local", version))
    for version in (1, 3):
        out = store.download(version, tmp_path / "downloaded" / f"v{version}")
        local = tmp_path / "local" / f"weights-v{version}"
        for name in ("model.safetensors", "config.json"):
            assert (out / name).read_bytes() == (local / name).read_bytes()
    assert store.prune(keep_latest=1) == [1, 2]

    for port in (8100, 8101):
        register_server(root, f"server-{port}", handle(port))
    unregister_server(root, "server-8100")
    assert [record.url for record in list_servers(root)] == ["http://127.0.0.1:8101"]

    counts = proxy.counts()
    proxy.set_plan(FaultPlan({}))
    print(f"\nfaults injected: {counts}")
    missing = [kind for kind in FAULT_KINDS if not counts.get(kind)]
    assert not missing, f"no {missing} fault was injected: {counts}"

    # What the store holds, read without the proxy.
    stored = ShardReader(direct, RUN).list_shards()
    assert sorted(info.name for info in stored) == sorted(written)
    claims = fs.list_dir(direct, paths.SHARD_SEQ_DIR)
    assert sorted(int(claim) for claim in claims) == sorted(info.seq for info in stored), "a claim without its shard"
    direct_reader = ShardReader(direct, RUN)
    stored_groups = Counter(group[0].group_id for info in stored for group in direct_reader.read_groups(info))
    assert len(stored_groups) == 18 and set(stored_groups.values()) == {1}, "a group lost or stored twice"
    for info in stored:
        assert fs.read_bytes(direct, info.relpath) == fs.read_bytes(root, info.relpath)
    assert [(entry.step, list(entry.shards)) for entry in Ledger(direct).entries()] == list(enumerate(batches))
    assert WeightStore(direct).list_versions() == [3] and WeightStore(direct).latest() == 3
    assert fs.list_dir(direct, paths.WEIGHTS_DIR) == ["LATEST", "v000003"]
    assert [record.name for record in list_servers(direct)] == ["server-8101"]


def test_a_lost_answer_to_a_conditional_put_is_resolved_not_duplicated(
    moto_endpoint: s3_servers.S3Endpoint, proxy: FaultProxy, group_factory: Callable[..., list[Sample]]
) -> None:
    bucket = s3_servers.create_bucket(moto_endpoint)
    root = open_via(moto_endpoint, bucket, proxy.url, ATTEMPTS)

    # The hazard: plain s3fs retries its create and reports its own object as a conflict.
    proxy.set_plan(FaultPlan(LOST_ANSWER, match=r"^PUT /", max_faults=1))
    with pytest.raises(FileExistsError):
        root.fs.pipe_file(root.full_path("raw/object"), b"mine", mode="create")
    assert proxy.counts()["drop_after"] == 1

    proxy.set_plan(FaultPlan(LOST_ANSWER, match=r"^PUT /", max_faults=1))
    fs.put_if_absent(root, "ours/object", b"mine")
    proxy.set_plan(FaultPlan(LOST_ANSWER, match=r"^PUT /", max_faults=1))
    with pytest.raises(FileExistsError, match="ours/object"):
        fs.put_if_absent(root, "ours/object", b"someone else's")
    assert fs.read_bytes(root, "ours/object") == b"mine"

    # Claim and shard PUTs both lose their answers: still one shard, number 0, no gap.
    proxy.set_plan(FaultPlan(LOST_ANSWER, match=r"^PUT /.*/trajectories/", max_faults=2))
    info = ShardWriter(root, RUN).write_groups([group_factory("g0")])
    assert info.seq == 0 and [s.name for s in ShardReader(root, RUN).list_shards()] == [info.name]
    assert fs.list_dir(root, paths.SHARD_SEQ_DIR) == [f"{0:08d}"]

    proxy.set_plan(FaultPlan(LOST_ANSWER, match=r"^PUT /.*/ledger/", max_faults=1))
    Ledger(root).record(0, [info.name])
    assert [entry.shards for entry in Ledger(root).entries()] == [(info.name,)]
    assert proxy.counts()["drop_after"] == 6


def test_without_retries_a_fault_surfaces_named_and_nothing_written_is_lost(
    moto_endpoint: s3_servers.S3Endpoint, proxy: FaultProxy, group_factory: Callable[..., list[Sample]]
) -> None:
    bucket = s3_servers.create_bucket(moto_endpoint)
    root = open_via(moto_endpoint, bucket, proxy.url, attempts=1)
    assert root.retry == RetryPolicy(attempts=1, mode="standard") and root.fs.retries == 1
    writer = ShardWriter(root, RUN)
    done = {writer.write_groups([group_factory(f"g{i}")]).name: i for i in range(3)}  # before any fault
    proxy.set_plan(faulty_plan())
    with pytest.raises(StorageOperationError) as failure:
        for i in range(3, 100):
            done[writer.write_groups([group_factory(f"g{i}")]).name] = i
    error = failure.value
    assert error.target.startswith(f"s3://{bucket}/run/") and error.attempts == 1
    assert f"{error.operation} {error.target} failed" in str(error) and "total_max_attempts" in str(error)

    with proxy.faults_paused():
        listed = {info.name: info for info in ShardReader(root, RUN).list_shards()}
        assert set(done) <= set(listed) and len(set(listed) - set(done)) <= 1  # the failed call's shard, whole
        for name, info in listed.items():
            groups = ShardReader(root, RUN).read_groups(info)
            if name in done:
                assert groups == [group_factory(f"g{done[name]}")]

    ledger = Ledger(root)
    recorded: list[int] = []
    names = sorted(listed)
    with pytest.raises(StorageOperationError, match=f"s3://{bucket}/run/"):
        for step, name in enumerate(names):
            ledger.record(step, [name])
            recorded.append(step)
    with proxy.faults_paused():
        entries = Ledger(root).entries()
    assert [entry.step for entry in entries][: len(recorded)] == recorded and len(entries) <= len(recorded) + 1
    assert all(entry.shards == (names[entry.step],) for entry in entries)


def test_a_busy_store_is_not_taken_for_a_missing_object(
    moto_endpoint: s3_servers.S3Endpoint, proxy: FaultProxy, tmp_path: Path
) -> None:
    bucket = s3_servers.create_bucket(moto_endpoint)
    root = open_via(moto_endpoint, bucket, proxy.url, attempts=1)
    fs.put_if_absent(root, "kept/object", b"payload")
    # fsspec's isfile answers False on any error: a 500 on the HEAD must not read as "no such object".
    calls = (lambda: fs.download_file(root, "kept/object", tmp_path / "out"), lambda: fs.delete(root, "kept/object"))
    for call in calls:
        proxy.set_plan(FaultPlan({"internal_error": 1.0}, match=r"^HEAD /", max_faults=1))
        with pytest.raises(StorageOperationError, match=f"s3://{bucket}/run/kept/object"):
            call()
    assert fs.read_bytes(root, "kept/object") == b"payload" and not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == []  # no partial download left behind


def test_signed_requests_pass_the_proxy_to_a_store_that_checks_them(
    seaweedfs_endpoint: s3_servers.S3Endpoint, group_factory: Callable[..., list[Sample]], tmp_path: Path
) -> None:
    bucket = s3_servers.create_bucket(seaweedfs_endpoint)
    with s3_fault_proxy(seaweedfs_endpoint.url) as proxy:
        forged = dict(s3_servers.storage_options(seaweedfs_endpoint), endpoint_url=proxy.url, secret="not-the-secret")
        with pytest.raises(PermissionError):
            fs.list_dir(open_root(f"s3://{bucket}/run", forged), "trajectories")
        root = open_via(seaweedfs_endpoint, bucket, proxy.url, ATTEMPTS)
        proxy.set_plan(faulty_plan(seed=SEED + 1))
        written = write_shards(root, writers=2, per_writer=3, group_factory=group_factory)
        shards = ShardReader(root, RUN).list_shards()
        assert {info.name: ShardReader(root, RUN).read_groups(info) for info in shards} == written
        Ledger(root).record(0, [info.name for info in shards])
        store = WeightStore(root)
        store.publish(1, weights_dir(tmp_path / "local", 1))
        out = store.download(1, tmp_path / "downloaded")
        local = tmp_path / "local" / "weights-v1"
        assert (out / "model.safetensors").read_bytes() == (local / "model.safetensors").read_bytes()
        fs.delete_tree(root, paths.weights_version_dir(1))
        counts = proxy.counts()
    print(f"\nfaults injected (SeaweedFS): {counts}")
    assert sum(counts.get(kind, 0) for kind in FAULT_KINDS) > 0 and counts["forwarded"] > 0
    direct = open_via(seaweedfs_endpoint, bucket)
    assert Ledger(direct).entries()[0].shards == tuple(info.name for info in shards)
    assert not fs.exists(direct, paths.weights_version_dir(1))


def test_retry_options_reach_botocore_and_s3fs(
    moto_endpoint: s3_servers.S3Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_RETRY_MODE", raising=False)
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    bucket = s3_servers.create_bucket(moto_endpoint)
    default = open_via(moto_endpoint, bucket)
    assert default.retry == RetryPolicy(attempts=5, mode="standard") and default.fs.retries == 5
    assert default.fs.config_kwargs["retries"] == {"mode": "standard", "total_max_attempts": 5}
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "4")  # botocore's own variable, honoured without options
    assert open_via(moto_endpoint, bucket).retry == RetryPolicy(attempts=4, mode="standard")
    config_kwargs = {"retries": {"max_attempts": 2, "mode": "adaptive"}, "read_timeout": 7}
    options = dict(s3_servers.storage_options(moto_endpoint), config_kwargs=config_kwargs)
    tuned = open_root(f"s3://{bucket}/run", options)
    assert tuned.retry == RetryPolicy(attempts=3, mode="adaptive") and tuned.fs.retries == 3
    assert tuned.fs.config_kwargs == {"retries": {"mode": "adaptive", "total_max_attempts": 3}, "read_timeout": 7}
    assert default.fs.retries == 5  # a separate s3fs instance


@pytest.mark.parametrize(
    ("retries", "message"),
    [
        ({"mode": "fast"}, r"config_kwargs.retries.mode: 'fast' is not one of \['legacy', 'standard', 'adaptive'\]"),
        ({"total_max_attempts": 0}, "config_kwargs.retries.total_max_attempts: must be an int >= 1"),
        ({"max_attempts": 1, "total_max_attempts": 2}, "config_kwargs.retries: give total_max_attempts .*, not both"),
        ({"attempts": 3}, r"config_kwargs.retries: unknown keys \['attempts'\]"),
    ],
)
def test_bad_retry_options_are_refused_by_the_run_config(retries: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=r"storage\.options\." + message):
        StorageConfig(root="s3://bucket/run", options={"config_kwargs": {"retries": retries}})
    with pytest.raises(ValueError, match=r"run root 's3://bucket/run': " + message):
        open_root("s3://bucket/run", {"config_kwargs": {"retries": retries}})
