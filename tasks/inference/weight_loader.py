"""The one loader a component holds for a whole run: published versions of one store into
its rollout servers, as full weights (:mod:`~asyncrl.tasks.inference.weight_sync`) or as LoRA
adapters (:mod:`~asyncrl.tasks.inference.adapter_sync`), over one pooled HTTP client."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx

from asyncrl.configs.secrets import redact
from asyncrl.tasks.inference.adapter_sync import AdapterUpdateReport, update_server_adapter
from asyncrl.tasks.inference.server_config import DEFAULT_MAX_LORAS
from asyncrl.tasks.inference.weight_sync import DEFAULT_CACHE_DIR, WeightUpdateReport, update_server_weights
from asyncrl.tasks.model.weight_fetch import fetch_weight_version
from asyncrl.tasks.system.network import is_loopback

if TYPE_CHECKING:
    from asyncrl.tasks.inference.routing import ServerAddress
    from asyncrl.tasks.inference.server import RolloutServerHandle

logger = logging.getLogger(__name__)


class ServerWeightLoader:
    """Loads published versions of one store into servers (:func:`update_server_weights`)
    over one pooled HTTP client, for a component that updates its servers for a whole run.

    ``adapters``: the servers were started with LoRA (``RolloutServerConfig.max_lora_rank``)
    and each version is a LoRA adapter: a load is
    :func:`~asyncrl.tasks.inference.adapter_sync.update_server_adapter` (no base weights
    reloaded), which keeps the newest ``keep_adapters`` versions loaded (the servers'
    ``max_loras``). Give the rollout client ``adapters=True`` too.

    ``loader.for_version(v)`` is the per-server callable :meth:`RolloutClient.update_weights`
    takes. Close it (or use it as a context manager) to drop its connections."""

    def __init__(
        self,
        root_uri: str,
        storage_options: Mapping[str, Any] | None,
        cache_dir: str = "",
        *,
        adapters: bool = False,
        keep_adapters: int = DEFAULT_MAX_LORAS,
    ) -> None:
        if isinstance(keep_adapters, bool) or not isinstance(keep_adapters, int) or keep_adapters < 1:
            raise ValueError(f"keep_adapters: must be an int >= 1, got {keep_adapters!r}")
        self._root_uri = root_uri
        self._options = dict(storage_options or {})
        self._cache_dir = cache_dir
        self._adapters = bool(adapters)
        self._keep_adapters = keep_adapters
        self._http = httpx.Client()

    @property
    def adapters(self) -> bool:
        return self._adapters

    def load(self, handle: RolloutServerHandle, version: int) -> WeightUpdateReport | AdapterUpdateReport:
        if self._adapters:
            return update_server_adapter(
                handle, self._root_uri, self._options, version, cache_dir=self._cache_dir,
                keep=self._keep_adapters, http=self._http,
            )  # fmt: skip
        return update_server_weights(
            handle, self._root_uri, self._options, version, cache_dir=self._cache_dir, http=self._http
        )

    def for_version(self, version: int) -> Callable[[RolloutServerHandle], WeightUpdateReport | AdapterUpdateReport]:
        return lambda handle: self.load(handle, version)

    def prefetch(self, version: int, servers: Sequence[ServerAddress]) -> bool:
        """Fetch ``version`` into the servers' weight cache from this process, before an
        update pauses generation, when one of ``servers`` is on this host (a loopback URL:
        the cache directory names the same files for it and for us). The worker's load then
        finds the version cached (complete and verified, :func:`fetch_weight_version`) and
        only reloads, so the fetch leaves the stall: generation goes on meanwhile.

        Returns whether the version is in the cache now. Servers elsewhere fetch in their
        load, as before. A failure is logged, not raised: the load fetches again and
        reports it (an unknown version, a corrupt file)."""
        if not any(is_loopback(urlsplit(server.url).hostname or "") for server in servers):
            return False
        cache = Path(self._cache_dir or DEFAULT_CACHE_DIR)  # as the worker names it
        try:
            fetch_weight_version(self._root_uri, self._options, version, cache)
        except Exception as exc:  # noqa: BLE001 - the load fetches again and reports it
            logger.warning("prefetching weight version %d failed (the load will fetch it): %s", version, redact(str(exc)))
            return False
        return True

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ServerWeightLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
