"""Load a published weight version into a LoRA rollout server as an adapter, base weights untouched.

With ``trainer.lora`` a weight version is a PEFT adapter directory (``adapter_config.json`` +
``adapter_model.safetensors``, a few MB) published through the same weight store and
manifests as full weights; version 0 is an adapter too (B = 0: the base model). A server
started with ``RolloutServerConfig.max_lora_rank`` keeps its base model and serves each
version under the name :func:`~asyncrl.tasks.inference.vllm_api.adapter_name`. Two halves of
one contract, as in :mod:`~asyncrl.tasks.inference.weight_sync`: :class:`AdapterSyncExtension`
is the LoRA server's ``--worker-extension-cls`` (the full-weight methods plus the adapter
ones) and :func:`update_server_adapter` is the HTTP side. Its steps:

1. ``POST /collective_rpc`` :meth:`~AdapterSyncExtension.fetch_adapter_version`: each worker
   fetches the version into its cache (:func:`~asyncrl.tasks.model.weight_fetch.fetch_weight_version`,
   verified against the manifest, under the version's lease), checks that it is an adapter,
   and prunes cached versions older than the newest ``keep``: a request still running on an
   older adapter may need its files again if vLLM evicted it from memory;
2. ``POST /v1/load_lora_adapter`` ``{"lora_name": adapter_name(v), "lora_path": <cache dir>}``:
   vLLM reads the adapter into the workers (rank checked against ``--max-lora-rank``);
3. ``POST /collective_rpc`` :meth:`~AdapterSyncExtension.adapter_fingerprint`: the
   :func:`~asyncrl.tasks.inference.weight_sync.tensor_fingerprint` of one ``lora_A`` tensor read
   from the file and of the same tensor in the adapters vLLM's worker holds (the one just
   loaded is the most recently used). No match raises: the server did not take in the
   published adapter, and would sample something else under its name;
4. ``POST /v1/unload_lora_adapter`` for this loader's adapters older than the newest ``keep``
   (requests can no longer name them; vLLM's worker evicts them from memory by its own LRU
   of ``--max-cpu-loras``; requests already running keep theirs);
5. ``POST /reset_prefix_cache`` and ``POST /update_weight_version``, as for full weights.

A failure in steps 1-2 leaves the server serving its previous adapter.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from asyncrl.tasks.inference.server_config import DEFAULT_MAX_LORAS
from asyncrl.tasks.inference.vllm_api import adapter_name, adapter_version
from asyncrl.tasks.inference.weight_sync import (
    DEFAULT_CACHE_DIR,
    WeightSyncError,
    WeightSyncExtension,
    collective_rpc,
    finish_update,
    leased_fetch,
    post_control,
    public_storage_options,
    tensor_fingerprint,
    worker_report,
)
from asyncrl.tasks.model.weight_fetch import prune_weight_cache
from asyncrl.tasks.system.http_errors import error_text

if TYPE_CHECKING:
    import torch
    from asyncrl.tasks.inference.server import RolloutServerHandle

logger = logging.getLogger(__name__)

FETCH_METHOD = "fetch_adapter_version"
FINGERPRINT_METHOD = "adapter_fingerprint"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def oldest_kept(version: int, keep: int) -> int:
    """The oldest version whose adapter stays loaded and cached after loading ``version``:
    max(0, version - keep + 1) (the newest ``keep`` versions)."""
    return max(0, version - keep + 1)


def check_adapter_dir(local_dir: Path, version: int) -> int:
    """Bytes of the adapter files in ``local_dir``; ``ValueError`` naming the version if it is
    not a PEFT adapter (e.g. the run trains without ``trainer.lora``: full weights)."""
    missing = [name for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not (local_dir / name).is_file()]
    if missing:
        raise ValueError(
            f"weight version {version} is not a LoRA adapter: it lacks {missing} (was it trained "
            "without trainer.lora? a server started with LoRA loads adapters only)"
        )
    try:
        json.loads((local_dir / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"weight version {version}: {ADAPTER_CONFIG} is not valid JSON: {exc}") from None
    return sum(path.stat().st_size for path in local_dir.iterdir() if path.is_file())


def first_lora_a(weights_file: Path) -> tuple[str, torch.Tensor]:
    """(name, tensor) of the first ``lora_A`` tensor of an adapter file, by name."""
    from safetensors import safe_open

    with safe_open(str(weights_file), framework="pt") as handle:
        names = sorted(name for name in handle.keys() if ".lora_A." in name)  # noqa: SIM118
        if not names:
            raise ValueError(f"{weights_file} holds no lora_A tensor")
        return names[0], handle.get_tensor(names[0])


def held_lora_as(model_runner: Any, tensor_name: str) -> tuple[list[torch.Tensor], str]:
    """The ``lora_A`` of file tensor ``tensor_name`` in each adapter vLLM's worker holds, most
    recently used first, and "" ; or ([], why not). Reads vLLM 0.32's LoRA manager
    (``lora_manager._adapter_manager``): q/k/v and gate/up adapters are packed into one module
    there, A kept as a list; A is never rescaled (vLLM folds alpha / rank into B)."""
    try:
        from vllm.lora.utils import parse_fine_tuned_lora_name

        manager = model_runner.lora_manager._adapter_manager
        mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
        module, _ = parse_fine_tuned_lora_name(tensor_name, mapper.get_rename_mapper() if mapper else None)
        packed = next(((name, parts.index(module)) for name, parts in manager.packed_modules.items() if module in parts), None)
        held = []
        for lora_id in reversed(list(manager._registered_adapters.order)):
            lora = manager._registered_adapters.cache[lora_id]  # not get(): that would reorder the LRU
            weights = lora.get_lora(module)
            if weights is not None:
                held.append(weights.lora_a)
            elif packed is not None and lora.get_lora(packed[0]) is not None:
                tensor = lora.get_lora(packed[0]).lora_a[packed[1]]
                if tensor is not None:
                    held.append(tensor)
    except (AttributeError, ImportError, KeyError, IndexError, TypeError, ValueError) as exc:
        return [], f"vLLM's LoRA manager is not readable here ({exc!r})"
    return held, "" if held else f"no adapter vLLM's worker holds has LoRA weights for {module}"


@dataclass(frozen=True)
class AdapterLoadReport:
    """What one worker reports about loading one adapter version (fetch and fingerprint)."""

    version: int
    local_dir: str
    cached: bool
    """True if the version was already in the local cache (no download)."""
    bytes: int
    """Size of the adapter directory's files: what a version moves (vs full weights)."""
    fetch_s: float
    checksum_tensor: str
    file_sha256: str
    """:func:`tensor_fingerprint` of ``checksum_tensor`` read from the file (in the worker's
    LoRA dtype)."""
    model_sha256: str | None
    """The same of the tensor as vLLM's worker holds it (the first held adapter's that matches
    the file, else the most recently used one's); None when not reachable (``model_note``)."""
    model_note: str

    @classmethod
    def from_json(cls, fetched: Any, fingerprint: Any) -> AdapterLoadReport:
        """One worker's entries of the two ``/collective_rpc`` results; ``WeightSyncError`` if malformed."""
        if not isinstance(fetched, dict) or not isinstance(fingerprint, dict):
            raise WeightSyncError(f"worker answered {fetched!r}, {fingerprint!r} instead of adapter reports")
        return worker_report(cls, {**fetched, **fingerprint}, "adapter report")


@dataclass(frozen=True)
class AdapterUpdateReport:
    """Outcome of :func:`update_server_adapter`."""

    version: int
    adapter: str
    """The name it is served under (:func:`~asyncrl.tasks.inference.vllm_api.adapter_name`)."""
    workers: tuple[AdapterLoadReport, ...]
    unloaded: tuple[str, ...]
    """Adapters of older versions unloaded from the server (module docstring, step 4)."""
    prefix_cache_reset: bool
    """As in :class:`~asyncrl.tasks.inference.weight_sync.WeightUpdateReport` (vLLM's prefix
    cache keys hold the adapter, so this only frees blocks)."""
    load_s: float
    """``POST /v1/load_lora_adapter``: vLLM reading the adapter into its workers."""
    seconds: float

    @property
    def bytes(self) -> int:
        return self.workers[0].bytes


class AdapterSyncExtension(WeightSyncExtension):
    """The worker extension of a LoRA server (``--worker-extension-cls``): full-weight loads
    as :class:`WeightSyncExtension`, plus the adapter steps of the module docstring."""

    def fetch_adapter_version(
        self,
        root_uri: str,
        storage_options: dict[str, Any],
        version: int,
        cache_dir: str = "",
        keep: int = DEFAULT_MAX_LORAS,
    ) -> dict[str, Any]:
        """Fetch adapter ``version`` into the cache (no reload of anything) and prune cached
        versions older than the newest ``keep``; return the :class:`AdapterLoadReport` fields
        of the fetch. ``ValueError`` naming the version if it is not published (with the
        available ones) or not an adapter."""
        started = time.monotonic()
        cache = Path(cache_dir or DEFAULT_CACHE_DIR)
        with leased_fetch(root_uri, storage_options, version, cache) as (local_dir, cached):
            size = check_adapter_dir(local_dir, version)
        fetched = time.monotonic()
        pruned = prune_weight_cache(cache, root_uri, oldest_kept(version, keep))
        if pruned:
            logger.info("weight cache: deleted adapter versions %s (keeping the newest %d)", pruned, keep)
        return {
            "version": version, "local_dir": str(local_dir), "cached": cached, "bytes": size,
            "fetch_s": fetched - started,
        }  # fmt: skip

    def adapter_fingerprint(self, local_dir: str) -> dict[str, Any]:
        """Fingerprints of the first ``lora_A`` tensor of the adapter at ``local_dir``: as read
        from its file (in the held tensors' dtype) and as vLLM holds it (:func:`held_lora_as`).
        The adapter just loaded is the most recently used one, unless another client's request
        ran meanwhile: the first held tensor that matches the file is reported, else the most
        recent one's fingerprint (a mismatch)."""
        name, tensor = first_lora_a(Path(local_dir) / ADAPTER_WEIGHTS)
        held, note = held_lora_as(self.model_runner, name)
        held = [h for h in held if tuple(h.shape) == tuple(tensor.shape)] if held else held
        if not held and not note:
            note = f"vLLM holds no {name} of the file's shape {tuple(tensor.shape)}"
        file_sha = tensor_fingerprint(tensor if not held else tensor.to(held[0].dtype))
        model_sha = None
        for candidate in held:
            model_sha = tensor_fingerprint(candidate)
            if model_sha == file_sha:
                break
        else:
            model_sha = tensor_fingerprint(held[0]) if held else None
        return {"checksum_tensor": name, "file_sha256": file_sha, "model_sha256": model_sha, "model_note": note}


def _rpc(
    handle: RolloutServerHandle, method: str, args: list[Any], what: str, timeout_s: float, http: httpx.Client | None
) -> list[Any]:
    """``/collective_rpc`` of ``method`` in every worker (:func:`collective_rpc`)."""
    return collective_rpc(handle, {"method": method, "args": args, "timeout": timeout_s}, what, timeout_s, http)


def loaded_adapters(handle: RolloutServerHandle, timeout_s: float = 30.0, http: httpx.Client | None = None) -> list[str]:
    """Names of the weight-version adapters the server serves (``GET /v1/models``), oldest first."""
    try:
        sender = httpx if http is None else http
        response = sender.get(f"{handle.url}/v1/models", headers=handle.headers(), timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise WeightSyncError(f"rollout server {handle.url}/v1/models: request failed: {exc!r}") from exc
    if response.status_code != 200:
        raise WeightSyncError(f"rollout server {handle.url}/v1/models: HTTP {response.status_code}: {error_text(response)}")
    names = [str(item.get("id")) for item in response.json().get("data") or [] if isinstance(item, dict)]
    return sorted((n for n in names if adapter_version(n) is not None), key=lambda n: adapter_version(n) or 0)


def _lora_post(handle: RolloutServerHandle, path: str, body: dict[str, Any], what: str, http: httpx.Client | None) -> None:
    response = post_control(handle, path, 120.0, http, json=body)
    if response.status_code != 200:
        raise WeightSyncError(
            f"rollout server {handle.url}: {what} failed (HTTP {response.status_code}): {error_text(response)}"
            + (" (was the server started with LoRA, RolloutServerConfig.max_lora_rank?)" if response.status_code == 404 else "")
        )


def update_server_adapter(
    handle: RolloutServerHandle,
    root_uri: str,
    storage_options: dict[str, Any] | None,
    version: int,
    cache_dir: str = "",
    keep: int = DEFAULT_MAX_LORAS,
    timeout_s: float = 600.0,
    http: httpx.Client | None = None,
) -> AdapterUpdateReport:
    """Load published adapter ``version`` into a LoRA server, unload adapters older than the
    newest ``keep`` (the server's ``max_loras``), reset its prefix cache, set its version
    (steps in the module docstring). Credentials in ``storage_options`` are dropped (the
    worker uses its own); ``cache_dir`` is a directory on the server's machine. Raises
    :class:`WeightSyncError` with the server's reason (an unknown version names the available
    ones; a version that is not an adapter says so); the server then serves its previous adapter."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"weight version must be a non-negative int, got {version!r}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep: must be an int >= 1, got {keep!r}")
    started = time.monotonic()
    name = adapter_name(version)
    fetch_args = [root_uri, public_storage_options(storage_options), version, cache_dir, keep]
    fetched = _rpc(handle, FETCH_METHOD, fetch_args, f"fetching adapter version {version} from {root_uri}", timeout_s, http)
    local_dirs = {entry.get("local_dir") for entry in fetched if isinstance(entry, dict)}
    if len(local_dirs) != 1 or None in local_dirs:
        raise WeightSyncError(f"rollout server {handle.url}: workers fetched adapter version {version} to {local_dirs}")
    (local_dir,) = local_dirs
    before = loaded_adapters(handle, http=http)
    mark = time.monotonic()
    # A name already served (a load retried after a failed update) is reloaded in place.
    body = {"lora_name": name, "lora_path": local_dir, "load_inplace": name in before}
    _lora_post(handle, "/v1/load_lora_adapter", body, f"loading adapter {name} from {local_dir}", http)
    load_s = time.monotonic() - mark
    checked = _rpc(handle, FINGERPRINT_METHOD, [local_dir], f"checking adapter {name}", timeout_s, http)
    if len(checked) != len(fetched):
        raise WeightSyncError(f"rollout server {handle.url}: {len(fetched)} workers fetched, {len(checked)} checked")
    workers = tuple(AdapterLoadReport.from_json(a, b) for a, b in zip(fetched, checked))
    wrong = [w for w in workers if w.model_sha256 is not None and w.model_sha256 != w.file_sha256]
    if wrong:
        _lora_post(handle, "/v1/unload_lora_adapter", {"lora_name": name}, f"unloading adapter {name}", http)
        raise WeightSyncError(
            f"rollout server {handle.url}: adapter {name} as loaded does not hold the published "
            f"{wrong[0].checksum_tensor} (file {wrong[0].file_sha256[:16]}, server {wrong[0].model_sha256[:16]}); unloaded"  # type: ignore[index]
        )
    for worker in workers:
        if worker.model_sha256 is None:
            logger.warning("rollout server %s: adapter %s not checked against the file: %s", handle.url, name, worker.model_note)
    floor = oldest_kept(version, keep)
    unloaded = tuple(n for n in before if (adapter_version(n) or 0) < floor and n != name)
    for old in unloaded:
        _lora_post(handle, "/v1/unload_lora_adapter", {"lora_name": old}, f"unloading adapter {old}", http)
    prefix_cache_reset = finish_update(handle, version, http)
    report = AdapterUpdateReport(
        version=version,
        adapter=name,
        workers=workers,
        unloaded=unloaded,
        prefix_cache_reset=prefix_cache_reset,
        load_s=load_s,
        seconds=time.monotonic() - started,
    )
    logger.info(
        "rollout server %s: adapter %s (%d bytes) loaded in %.3f s, unloaded %s",
        handle.url, name, report.bytes, report.seconds, list(unloaded) or "none",
    )  # fmt: skip
    return report

