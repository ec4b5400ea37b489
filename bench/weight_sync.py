"""``asyncrl bench weight-sync``: publish, fetch and in-place load of a realistic weight version.

The bench writes a Qwen2 checkpoint with random weights (no hub; ``--size 0.5b`` has the
shape of Qwen2.5-0.5B), starts one rollout server on it and times, on each storage backend
(local disk, S3 with ``--s3-endpoint``) and for fresh versions that share no bytes, the
phases of a weight update: ``publish``, ``fetch`` (and ``fetch by copy`` on a local store),
and ``load`` into the running server, each load checked by fingerprint. Each phase is set
against the slowest physical link it crosses (disk, page cache, memory, SHA-256), measured
in the same run (:func:`measure_links`), so results read as a fraction of what the hardware
allows rather than as absolute times. Phases and links: ``docs/internals/bench.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import shutil
import sys
import tempfile
import time
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.bench.weight_sync_settings import (
    CHUNK_BYTES,
    MIB,
    WeightSyncBenchSettings,
    dir_bytes,
    model_spec,
    write_bench_model,
)
from asyncrl.storage import paths
from asyncrl.storage.fs import open_root
from asyncrl.storage.weights import WEIGHT_SUFFIX, WeightStore

if TYPE_CHECKING:
    from asyncrl.tasks.inference.server import RolloutServerHandle

GB = 1e9
CHECKSUM_TENSOR = "model.embed_tokens.weight"
LINK_NAMES = types.MappingProxyType({
    "disk_write": "disk write (sequential, fsync)",
    "disk_read_direct": "disk read (O_DIRECT)",
    "page_cache_read": "page-cache read",
    "memory_copy": "memory copy",
    "sha256": "SHA-256 (compute, not a link)",
})  # fmt: skip
LINK_METHODS = types.MappingProxyType({
    "disk_write": "new file written in 8 MiB chunks, fsync included",
    "disk_read_direct": "that file read with O_DIRECT, bypassing this kernel's page cache (a VM's host may still cache)",
    "page_cache_read": "that file read buffered just after writing it: served from the page cache, not the disk",
    "memory_copy": "numpy copy between two buffers, best of 3; bytes copied (each read once, written once)",
    "sha256": "hashlib SHA-256 of in-memory data, one core: the ceiling of every verified phase",
})  # fmt: skip
PHASE_LINKS = types.MappingProxyType({
    "publish": ("page_cache_read", "disk_write"),
    "fetch": ("page_cache_read", "disk_write"),
    "fetch by copy": ("page_cache_read", "disk_write"),
    "load": ("page_cache_read", "disk_write", "memory_copy"),
    "worker fetch": ("page_cache_read", "disk_write"),
    "worker reload": ("page_cache_read", "memory_copy"),
})  # fmt: skip
"""The physical links each phase crosses when it copies. publish/fetch: read a file written
just before (page cache), write a copy (fsynced); load: a worker fetch, then the reload copies
every tensor into the model (memory). On S3 the same: SeaweedFS keeps its objects on this disk.
A zero-copy fetch writes no data: see :func:`phase_links`."""
ZERO_COPY_PHASES = ("fetch", "load", "worker fetch")
"""Phases whose fetch writes no data when it hard-links a local store's files."""


# --- figures ---------------------------------------------------------------------------


def gb_per_s(num_bytes: int, seconds: float) -> float:
    """Throughput in GB/s (10^9 bytes): GB/s = bytes / seconds / 1e9."""
    if num_bytes < 0 or not seconds > 0:
        raise ValueError(f"gb_per_s needs bytes >= 0 and seconds > 0, got {num_bytes} bytes in {seconds} s")
    return num_bytes / seconds / GB


def fraction_of_link(phase_gb_s: float, link_gb_s: float) -> float:
    """Efficiency of a phase: fraction = phase GB/s / GB/s of the slowest link it crosses."""
    if not link_gb_s > 0:
        raise ValueError(f"fraction_of_link needs link GB/s > 0, got {link_gb_s}")
    return phase_gb_s / link_gb_s


def slowest_link(links: Mapping[str, float | None], crossed: Sequence[str]) -> tuple[str, float]:
    """(name, GB/s) of the slowest of the ``crossed`` links: min over crossed of link GB/s.
    Links not measured (None) are skipped; ``ValueError`` if none is left."""
    measured = [(name, rate) for name in crossed if (rate := links.get(name)) is not None]
    if not measured:
        raise ValueError(f"none of the links {list(crossed)} was measured: {dict(links)}")
    return min(measured, key=lambda item: item[1])


def phase_links(phase: str, zero_copy: bool) -> tuple[str, ...]:
    """The links ``phase`` crosses: ``PHASE_LINKS[phase]``, less the disk write when its fetch
    hard-linked the store's files (``zero_copy``, phases of :data:`ZERO_COPY_PHASES`)."""
    crossed = PHASE_LINKS[phase]
    if zero_copy and phase in ZERO_COPY_PHASES:
        return tuple(name for name in crossed if name != "disk_write")
    return crossed


def phase_figures(seconds: Sequence[float], num_bytes: int, link: tuple[str, float]) -> dict[str, Any]:
    """Mean and best of a phase's repeats: mean_s = sum(seconds) / n, best_s = min(seconds),
    GB/s = bytes / seconds / 1e9 of each, fraction = GB/s / link GB/s (:func:`fraction_of_link`)."""
    if not seconds:
        raise ValueError("phase_figures needs at least one measurement")
    mean_s = sum(seconds) / len(seconds)
    best_s = min(seconds)
    mean_gb_s, best_gb_s = gb_per_s(num_bytes, mean_s), gb_per_s(num_bytes, best_s)
    return {
        "bytes": num_bytes,
        "seconds": list(seconds),
        "mean_s": mean_s,
        "best_s": best_s,
        "mean_gb_s": mean_gb_s,
        "best_gb_s": best_gb_s,
        "link": link[0],
        "link_gb_s": link[1],
        "fraction_mean": fraction_of_link(mean_gb_s, link[1]),
        "fraction_best": fraction_of_link(best_gb_s, link[1]),
    }


# --- physical links ----------------------------------------------------------------------


def _timed(function: Callable[[], object]) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def measure_disk_write(path: Path, num_bytes: int) -> float:
    """Seconds to write ``num_bytes`` (incompressible, in :data:`CHUNK_BYTES` chunks) to a new
    file ``path`` and fsync it: GB/s = bytes / seconds / 1e9 is the disk's sequential write."""
    chunk = os.urandom(CHUNK_BYTES)

    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for _ in range(num_bytes // CHUNK_BYTES):
                os.write(fd, chunk)
            os.fsync(fd)
        finally:
            os.close(fd)

    return _timed(write)


def measure_file_read(path: Path, direct: bool) -> float | None:
    """Seconds to read ``path`` sequentially in :data:`CHUNK_BYTES` chunks into one buffer.

    ``direct``: with ``O_DIRECT`` (the disk, not the page cache); None when the filesystem
    refuses it. Otherwise a buffered read (of a file just written: the page cache).
    GB/s = file bytes / seconds / 1e9.
    """
    flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
    if direct and flags == os.O_RDONLY:
        return None
    buffer = mmap.mmap(-1, CHUNK_BYTES)  # page-aligned, as O_DIRECT needs
    try:
        fd = os.open(path, flags)
    except OSError:
        buffer.close()
        return None
    try:

        def read() -> None:
            while os.readv(fd, [buffer]):
                pass

        return _timed(read)
    except OSError:
        return None
    finally:
        os.close(fd)
        buffer.close()


def measure_memory_copy(num_bytes: int, tries: int = 3) -> float:
    """Best seconds of ``tries`` copies of a ``num_bytes`` buffer into another (numpy, after one
    warm-up copy): GB/s = bytes copied / seconds / 1e9 (each byte read once and written once)."""
    import numpy as np

    source = np.ones(num_bytes, dtype=np.uint8)
    target = np.zeros(num_bytes, dtype=np.uint8)
    np.copyto(target, source)
    return min(_timed(lambda: np.copyto(target, source)) for _ in range(tries))


def measure_sha256(num_bytes: int) -> float:
    """Seconds to SHA-256 ``num_bytes`` in memory (chunks of :data:`CHUNK_BYTES`): the compute
    ceiling of every verified phase, GB/s = bytes / seconds / 1e9."""
    chunk = os.urandom(CHUNK_BYTES)

    def digest() -> None:
        hasher = hashlib.sha256()
        for _ in range(num_bytes // CHUNK_BYTES):
            hasher.update(chunk)
        hasher.hexdigest()

    return _timed(digest)


def measure_links(work_dir: Path, num_bytes: int) -> dict[str, dict[str, Any]]:
    """Every link of ``LINK_NAMES`` (disk figures on a file of ``num_bytes`` in ``work_dir``,
    deleted after): ``{name: {"gb_s", "seconds", "bytes", "what"}}``, ``gb_s`` None if not measured."""
    work_dir.mkdir(parents=True, exist_ok=True)
    probe = work_dir / "link-probe.bin"
    try:
        seconds: dict[str, float | None] = {"disk_write": measure_disk_write(probe, num_bytes)}
        cached = [s for s in (measure_file_read(probe, direct=False) for _ in range(2)) if s is not None]
        seconds["page_cache_read"] = min(cached) if cached else None
        seconds["disk_read_direct"] = measure_file_read(probe, direct=True)
    finally:
        probe.unlink(missing_ok=True)
    seconds["memory_copy"] = measure_memory_copy(num_bytes)
    seconds["sha256"] = measure_sha256(num_bytes)
    links: dict[str, dict[str, Any]] = {}
    for name in LINK_NAMES:
        taken = seconds[name]
        rate = None if taken is None else gb_per_s(num_bytes, taken)
        links[name] = {"gb_s": rate, "seconds": taken, "bytes": num_bytes, "what": LINK_METHODS[name]}
    return links


# --- model and versions --------------------------------------------------------------------


@dataclass(frozen=True)
class VersionDigest:
    """What a correct load of a version must report for :data:`CHECKSUM_TENSOR`."""

    file_sha256: str
    """Fingerprint of its bytes in the file (bfloat16)."""
    model_sha256: str
    """Fingerprint of its bytes cast to the server's dtype (what the model holds)."""


def write_version(base: Path, target: Path, seed: int, server_dtype: str = "float32") -> VersionDigest:
    """A copy of checkpoint ``base`` at ``target`` whose embedding (:data:`CHECKSUM_TENSOR`,
    tied to the LM head) is new random N(0, 0.02^2) values from ``seed``; return its digests."""
    import torch
    from safetensors.torch import load_file, save_file

    from asyncrl.tasks.inference.weight_sync import tensor_fingerprint

    shutil.copytree(base, target, ignore=shutil.ignore_patterns(f"*{WEIGHT_SUFFIX}"))
    digest: VersionDigest | None = None
    generator = torch.Generator().manual_seed(seed)
    for file in sorted(base.glob(f"*{WEIGHT_SUFFIX}")):
        tensors = load_file(str(file))
        if CHECKSUM_TENSOR in tensors:
            old = tensors[CHECKSUM_TENSOR]
            new = (0.02 * torch.randn(old.shape, generator=generator, dtype=torch.float32)).to(old.dtype)
            tensors[CHECKSUM_TENSOR] = new
            digest = VersionDigest(tensor_fingerprint(new), tensor_fingerprint(new.to(getattr(torch, server_dtype))))
        save_file(tensors, str(target / file.name), metadata={"format": "pt"})
        del tensors
    if digest is None:
        raise ValueError(f"{base} holds no tensor {CHECKSUM_TENSOR}")
    return digest


# --- the bench -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Backend:
    name: str
    uri: str
    options: Mapping[str, Any]
    """Storage options for :func:`fetch_weight_version` and the load request (no secrets:
    S3 credentials come from the environment, the server's included)."""
    local: bool


def local_backend(work_dir: Path) -> Backend:
    """A local store under ``work_dir`` (a ``file://`` root)."""
    return Backend("local", f"file://{work_dir / 'store-local'}", {}, local=True)


def s3_backend(endpoint: str, bucket: str) -> Backend:
    """A fresh prefix of ``bucket`` (created if missing) on ``endpoint``, by ``bench.storage``'s
    ``_s3_root``, which also checks that AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY are set."""
    from asyncrl.bench.storage import _s3_root

    root = _s3_root(endpoint, bucket)
    return Backend("s3", root.uri, {"endpoint_url": endpoint}, local=False)


def is_linked(store: WeightStore, version: int, fetched: Path) -> bool:
    """Whether the fetched copy of a local store's ``version`` shares the store files' inodes
    (a zero-copy fetch): every ``*.safetensors`` file is the same (device, inode)."""
    if not store.root.is_local:
        return False
    for file in fetched.glob(f"*{WEIGHT_SUFFIX}"):
        stored = os.stat(store.root.full_path(paths.weights_file(version, file.name)))
        mine = file.stat()
        if (stored.st_dev, stored.st_ino) != (mine.st_dev, mine.st_ino):
            return False
    return True


def _load_record(backend: str, version: int, report: Any, digest: VersionDigest) -> dict[str, Any]:
    worker = report.workers[0]
    return {
        "backend": backend,
        "version": version,
        "seconds": report.seconds,
        "download_s": worker.download_s,
        "reload_s": worker.reload_s,
        "cached": worker.cached,
        "num_tensors": worker.num_tensors,
        "file_sha256": worker.file_sha256,
        "model_sha256": worker.model_sha256,
        "hashes_verified": (
            len(report.workers) == 1 and not worker.cached and worker.checksum_tensor == CHECKSUM_TENSOR
            and worker.file_sha256 == digest.file_sha256 and worker.model_sha256 == digest.model_sha256
        ),
    }  # fmt: skip


def bench_backend(
    backend: Backend,
    handle: RolloutServerHandle,
    base: Path,
    work_dir: Path,
    settings: WeightSyncBenchSettings,
    first_version: int,
) -> tuple[dict[str, list[float]], list[dict[str, Any]], int, bool]:
    """Publish, fetch, (fetch by copy,) and load ``settings.repeats`` fresh versions on one
    backend; return (seconds by phase, load records, bytes of a version, whether every fetch
    was zero-copy)."""
    import httpx

    from asyncrl.tasks.inference.weight_sync import update_server_weights
    from asyncrl.tasks.model.weight_fetch import cached_version_dir, fetch_weight_version

    store = WeightStore(open_root(backend.uri, dict(backend.options)))
    seconds: dict[str, list[float]] = {phase: [] for phase in PHASE_LINKS if backend.local or phase != "fetch by copy"}
    loads: list[dict[str, Any]] = []
    version_bytes = 0
    zero_copy = True
    fetch_cache = work_dir / f"fetch-cache-{backend.name}"
    with httpx.Client() as http:
        for version in range(first_version, first_version + settings.repeats):
            source = work_dir / f"{backend.name}-v{version}"
            digest = write_version(base, source, seed=settings.seed + version, server_dtype=settings.server_dtype)
            version_bytes = dir_bytes(source)
            seconds["publish"].append(_timed(lambda: store.publish(version, source)))
            seconds["fetch"].append(
                _timed(lambda: fetch_weight_version(backend.uri, dict(backend.options), version, fetch_cache))
            )
            zero_copy = zero_copy and is_linked(store, version, cached_version_dir(fetch_cache, backend.uri, version))
            shutil.rmtree(fetch_cache)
            if backend.local:
                copied = work_dir / "fetch-by-copy"
                seconds["fetch by copy"].append(_timed(lambda: store.download(version, copied)))
                shutil.rmtree(copied)
            report = update_server_weights(
                handle, backend.uri, dict(backend.options), version, cache_dir=str(work_dir / "server-cache"), http=http
            )
            loads.append(_load_record(backend.name, version, report, digest))
            seconds["load"].append(report.seconds)
            seconds["worker fetch"].append(report.workers[0].download_s)
            seconds["worker reload"].append(report.workers[0].reload_s)
            shutil.rmtree(source)
            store.prune(keep_latest=1)
    return seconds, loads, version_bytes, zero_copy


def streaming_estimate(phases: Sequence[Mapping[str, Any]], backend: str) -> dict[str, Any] | None:
    """What loading straight from a local store (no staging copy) saves, by mean seconds:
    staged = fetch by copy + worker reload, zero-copy = fetch + worker reload (the fetch
    hard-links the store's files and hashes them where they lie); saving = staged - zero-copy,
    saving_fraction = saving / staged. None without a ``fetch by copy`` on ``backend``."""
    by_phase = {p["phase"]: p for p in phases if p["backend"] == backend}
    if "fetch by copy" not in by_phase:
        return None
    reload_s = by_phase["worker reload"]["mean_s"]
    staged = by_phase["fetch by copy"]["mean_s"] + reload_s
    zero_copy = by_phase["fetch"]["mean_s"] + reload_s
    return {
        "backend": backend,
        "staged_s": staged,
        "zero_copy_s": zero_copy,
        "saving_s": staged - zero_copy,
        "saving_fraction": (staged - zero_copy) / staged,
    }


def run_weight_sync_bench(
    settings: WeightSyncBenchSettings,
    work_dir: Path,
    s3_endpoint: str | None = None,
    s3_bucket: str = "asyncrl-bench",
) -> dict[str, Any]:
    """The whole bench (see the module docstring) under ``work_dir``; the JSON-ready result."""
    from asyncrl.tasks.inference.server import RolloutServer
    from asyncrl.tasks.inference.server_config import RolloutServerConfig

    work_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    links = measure_links(work_dir, settings.probe_mib * MIB)
    link_gb_s = {name: link["gb_s"] for name, link in links.items()}
    spec = model_spec(settings.size)
    base = write_bench_model(work_dir / "model", settings)
    backends = [local_backend(work_dir)]
    if s3_endpoint:
        backends.append(s3_backend(s3_endpoint, s3_bucket))
    config = RolloutServerConfig(
        model_dir=base, kv_cache_gib=settings.kv_cache_gib, max_model_len=settings.max_model_len,
        served_model_name="weight-sync-bench", start_timeout_s=settings.server_start_timeout_s,
        log_path=work_dir / "server.log", dtype=settings.server_dtype,
    )  # fmt: skip
    phases: list[dict[str, Any]] = []
    loads: list[dict[str, Any]] = []
    zero_copy_fetch: dict[str, bool] = {}
    server_started = time.perf_counter()
    with RolloutServer(config) as server:
        server_start_s = time.perf_counter() - server_started
        for index, backend in enumerate(backends):
            seconds, backend_loads, version_bytes, zero_copy = bench_backend(
                backend, server.handle, base, work_dir, settings, first_version=1 + index * settings.repeats
            )
            loads.extend(backend_loads)
            zero_copy_fetch[backend.name] = zero_copy
            for phase, values in seconds.items():
                num_bytes = dir_bytes(base, WEIGHT_SUFFIX) if phase == "worker reload" else version_bytes
                link = slowest_link(link_gb_s, phase_links(phase, zero_copy))
                phases.append({"backend": backend.name, "phase": phase, **phase_figures(values, num_bytes, link)})
    return {
        "settings": asdict(settings),
        "model": {
            "size": settings.size,
            "parameters": spec.num_parameters(),
            "dtype": "bfloat16",
            "server_dtype": settings.server_dtype,
            "vocab_size": spec.vocab_size,
            "hidden_size": spec.hidden_size,
            "num_layers": spec.num_layers,
            "safetensors_bytes": dir_bytes(base, WEIGHT_SUFFIX),
            "version_bytes": dir_bytes(base),
        },
        "backends": [{"name": b.name, "uri": b.uri, "zero_copy_fetch": zero_copy_fetch[b.name]} for b in backends],
        "links": links,
        "phases": phases,
        "loads": loads,
        "hashes_verified": bool(loads) and all(load["hashes_verified"] for load in loads),
        "streaming": streaming_estimate(phases, "local"),
        "server_start_s": server_start_s,
        "total_s": time.perf_counter() - started,
    }


# --- output --------------------------------------------------------------------------------


def _pair(mean: float, best: float, digits: int) -> str:
    return f"{mean:.{digits}f} ({best:.{digits}f})"


def format_tables(result: Mapping[str, Any]) -> str:
    """Markdown tables: the phases (mean (best) over the versions, against their slowest link)
    and the machine's links, then the streaming comparison."""
    model = result["model"]
    lines = [
        f"model: Qwen2 {model['size']}, {model['parameters']:,} parameters, {model['dtype']} "
        f"({model['safetensors_bytes'] / GB:.3f} GB of safetensors, {model['version_bytes'] / GB:.3f} GB per version), "
        f"server dtype {model['server_dtype']}; {result['settings']['repeats']} versions per backend; "
        f"hashes verified: {result['hashes_verified']}",
        "",
        "| backend | phase | seconds | GB/s | link | link GB/s | fraction of link |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in result["phases"]:
        lines.append(
            f"| {p['backend']} | {p['phase']} | {_pair(p['mean_s'], p['best_s'], 3)} "
            f"| {_pair(p['mean_gb_s'], p['best_gb_s'], 3)} | {LINK_NAMES[p['link']]} | {p['link_gb_s']:.3f} "
            f"| {_pair(p['fraction_mean'], p['fraction_best'], 2)} |"
        )
    lines += ["", "seconds, GB/s and fraction of link: mean (best) over the versions.", "",
              "| link | GB/s | measured |", "|---|---|---|"]  # fmt: skip
    for name, link in result["links"].items():
        rate = "not measured" if link["gb_s"] is None else f"{link['gb_s']:.3f}"
        lines.append(f"| {LINK_NAMES[name]} | {rate} | {link['bytes'] / GB:.2f} GB: {link['what']} |")
    streaming = result.get("streaming")
    if streaming:
        lines += [
            "",
            f"loading from the local store without a staging copy: fetch by copy + reload {streaming['staged_s']:.3f} s, "
            f"zero-copy fetch + reload {streaming['zero_copy_s']:.3f} s "
            f"(saving {streaming['saving_s']:.3f} s, {100 * streaming['saving_fraction']:.0f}%)",
        ]
    return "\n".join(lines)


def cmd_bench_weight_sync(args: argparse.Namespace) -> int:
    try:
        settings = WeightSyncBenchSettings(
            size=args.size, repeats=args.repeats, probe_mib=args.probe_mib, kv_cache_gib=args.kv_cache_gib,
            max_model_len=args.max_model_len, server_dtype=args.server_dtype,
        )  # fmt: skip
    except ValueError as exc:
        print(f"bench weight-sync: {exc}", file=sys.stderr)
        return 2
    if args.lora is not None:
        return cmd_bench_lora_sync(settings, args)
    with tempfile.TemporaryDirectory(prefix="asyncrl-weight-sync-bench-") as scratch:
        work_dir = Path(args.work_dir) if args.work_dir else Path(scratch)
        result = run_weight_sync_bench(settings, work_dir, args.s3_endpoint, args.s3_bucket)
    print(format_tables(result))
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if not result["hashes_verified"]:
        print("bench weight-sync: a load reported other hashes than the version's", file=sys.stderr)
        return 1
    return 0


def cmd_bench_lora_sync(settings: WeightSyncBenchSettings, args: argparse.Namespace) -> int:
    """``--lora RANK``: :func:`~asyncrl.bench.lora_sync.run_lora_sync_bench` instead."""
    from asyncrl.bench.lora_sync import format_lora_table, run_lora_sync_bench

    if args.lora < 1:
        print(f"bench weight-sync: --lora: the adapter rank must be >= 1, got {args.lora}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="asyncrl-lora-sync-bench-") as scratch:
        result = run_lora_sync_bench(settings, args.lora, Path(args.work_dir) if args.work_dir else Path(scratch))
    print(format_lora_table(result))
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if result["fingerprints_verified"] else 1
