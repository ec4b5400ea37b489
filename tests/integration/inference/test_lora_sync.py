"""LoRA adapters as weight versions on a real vLLM server (the tiny model), both interrupt modes.

One LoRA server for the module (a start costs 30-90 s on 2 cores); tests pick the next
version from the server's current one, so they run in any order. Versions are PEFT adapters
published through the weight store (v0: B = 0, the base model; v1..: random B), loaded by
``ServerWeightLoader(adapters=True)`` (no base reload). The reference log-probs are the HF PEFT
model's, float32, over exactly the recorded tokens and versions, within the full-model
tests' tolerance (test_updates.py).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from lora_adapter_builder import peft_model, write_adapter

from asyncrl.storage.fs import open_root
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.inference.adapter_sync import AdapterUpdateReport, loaded_adapters
from asyncrl.tasks.inference.client import RolloutClient
from asyncrl.tasks.inference.samples import InterruptMode, SampleOutput, UpdateStats
from asyncrl.tasks.inference.server import RolloutServer, RolloutServerHandle
from asyncrl.tasks.inference.server_config import RolloutServerConfig
from asyncrl.tasks.inference.vllm_api import adapter_name
from asyncrl.tasks.inference.weight_loader import ServerWeightLoader
from asyncrl.tasks.inference.weight_sync import WeightSyncError

pytestmark = pytest.mark.slow  # every test here runs on the module's LoRA server

API_KEY = "rollout-lora-test-key"
PROMPT = [84, 104, 101, 32, 97, 110, 115, 119, 101, 114, 32, 105, 115]
LOGPROB_TOLERANCE = 1e-4
"""The full-model tests' (test_updates.py)."""
RANK, ALPHA, B_STD = 4, 8, 0.05
"""Adapter rank 4: the server's max_lora_rank 4 is passed to vLLM as 8 (rounded up)."""
MAX_LORAS = 2
NUM_VERSIONS = 16
"""v0..v15: the sampling test uses 1, each mid-generation test up to ATTEMPTS, the unload test 3."""
N, MAX_NEW_TOKENS = 4, 200
"""Enough for the update, sent at the first streamed token, to cut requests (each test checks
that one was cut, else retries); a group takes ~2 s on 2 idle cores."""
ATTEMPTS = 5


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[int, Path]:
    base = tmp_path_factory.mktemp("lora-adapters")
    return {
        v: write_adapter(tiny_model_dir, base / f"v{v}", seed=v, rank=RANK, alpha=ALPHA, b_std=0.0 if v == 0 else B_STD)
        for v in range(NUM_VERSIONS)
    }


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory: pytest.TempPathFactory, adapter_dirs: dict[int, Path]) -> str:
    uri = "file://" + str(tmp_path_factory.mktemp("lora-run-root"))
    store = WeightStore(open_root(uri))
    for version, directory in sorted(adapter_dirs.items()):
        store.publish(version, directory)
    return uri


@pytest.fixture(scope="module")
def lora_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora-weight-cache")


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[RolloutServerHandle]:
    config = RolloutServerConfig(
        model_dir=tiny_model_dir, api_key=API_KEY, kv_cache_gib=1.0, session_nice=10,
        log_path=tmp_path_factory.mktemp("lora-server") / "server.log", max_lora_rank=RANK, max_loras=MAX_LORAS,
    )  # fmt: skip
    server = RolloutServer(config)
    server.start()
    try:
        server.wait_healthy()
        yield server.handle
    finally:
        server.stop()


@pytest.fixture(scope="module")
def lora_loader(adapter_root: str, lora_cache_dir: Path) -> Iterator[ServerWeightLoader]:
    with ServerWeightLoader(adapter_root, None, str(lora_cache_dir), adapters=True, keep_adapters=MAX_LORAS) as loader:
        yield loader


@pytest.fixture(scope="module")
def reference_model(tiny_model_dir: Path, adapter_dirs: dict[int, Path]) -> Callable[[int | None], Any]:
    """HF PEFT model of a version (None: the bare base model), loaded once."""
    cache: dict[int | None, Any] = {}

    def get(version: int | None) -> Any:
        if version not in cache:
            cache[version] = peft_model(tiny_model_dir, None if version is None else adapter_dirs[version])
        return cache[version]

    return get


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _full(helpers: Any, model: Any, tokens: list[int]) -> list[float]:
    return helpers.reference_logprobs(model, None, PROMPT, tokens, len(tokens))


def test_an_adapter_version_is_sampled_as_peft_computes_it_and_differs_from_the_base(
    lora_server: RolloutServerHandle, lora_loader: ServerWeightLoader,
    reference_model: Callable[[int | None], Any], helpers: Any,
) -> None:  # fmt: skip
    async def run() -> tuple[int, list[SampleOutput], list[AdapterUpdateReport], list[SampleOutput]]:
        async with RolloutClient([lora_server], adapters=True) as client:
            old = client.current_version
            before = await client.generate_group(PROMPT, 2, 32, ignore_eos=True)
            reports: list[Any] = []
            await client.update_weights(old + 1, lambda handle: reports.append(lora_loader.load(handle, old + 1)))
            assert client.server_adapters() == {lora_server.url: adapter_name(old + 1)}
            return old, before, reports, await client.generate_group(PROMPT, 2, 32, ignore_eos=True)

    old, before, reports, samples = asyncio.run(run())
    new = old + 1
    ((report,),) = [reports]
    assert isinstance(report, AdapterUpdateReport) and report.version == new and report.adapter == adapter_name(new)
    ((worker,),) = [report.workers]
    assert worker.model_sha256 is not None, worker.model_note  # the check reached vLLM's copy
    assert worker.model_sha256 == worker.file_sha256 and ".lora_A." in worker.checksum_tensor
    assert 0 < report.bytes < 1_000_000, report.bytes  # an adapter, not the model (~12 MB)
    print(f"adapter v{new}: {report.bytes} bytes, update {report.seconds:.3f} s (vLLM load {report.load_s:.3f} s)")
    # Before: the version it was at (v0 = the base model, with or without its B = 0 adapter).
    for sample in before:
        assert sample.token_versions == [old] * 32
        reference = _full(helpers, reference_model(old), sample.output_token_ids)
        assert _max_diff(reference, sample.behaviour_logprobs) < LOGPROB_TOLERANCE
    worst = 0.0
    for sample in samples:
        assert sample.token_versions == [new] * 32
        tokens = sample.output_token_ids
        reference = _full(helpers, reference_model(new), tokens)
        worst = max(worst, _max_diff(reference, sample.behaviour_logprobs))
        # The adapter is used: the base model's log-probs of the same tokens are far off.
        assert _max_diff(_full(helpers, reference_model(None), tokens), sample.behaviour_logprobs) > 100 * LOGPROB_TOLERANCE
    print(f"adapter v{new}: max |server - PEFT| log-prob = {worst:.3g}")
    assert worst < LOGPROB_TOLERANCE


def _run_update(
    mode: InterruptMode, server: RolloutServerHandle, loader: ServerWeightLoader, helpers: Any,
    caplog: pytest.LogCaptureFixture,
) -> tuple[int, int, UpdateStats, list[SampleOutput], bool]:  # fmt: skip
    """An update in the middle of a group: (old, new, stats, samples, whether a request ran across
    the update in the engine) of the first attempt where the update cut a request (recompute: a
    sample holds both versions; keep: the client logged a segment whose engine spans hold two
    versions), else the last attempt's."""

    async def run() -> tuple[int, int, UpdateStats, list[SampleOutput]]:
        async with RolloutClient([server], interrupt_mode=mode, adapters=True) as client:
            old = client.current_version
            group = asyncio.create_task(client.generate_group(PROMPT, N, MAX_NEW_TOKENS, ignore_eos=True))
            await helpers.wait_streamed(client, server.url, at_least=1)
            stats = await client.update_weights(old + 1, loader.for_version(old + 1))
            return old, old + 1, stats, await group

    for attempt in range(1, ATTEMPTS + 1):
        caplog.clear()
        began = time.monotonic()
        old, new, stats, samples = asyncio.run(run())
        print(f"LoRA {mode} attempt {attempt}: {time.monotonic() - began:.1f} s")
        across = any("ran across an update" in record.getMessage() for record in caplog.records)
        if (mode == "recompute" and any(len(set(s.token_versions)) == 2 for s in samples)) or (
            mode == "keep" and across
        ):
            break
    return old, new, stats, samples, across


def test_recompute_update_mid_generation_resubmits_under_the_new_adapter(
    caplog: pytest.LogCaptureFixture, lora_server: RolloutServerHandle, lora_loader: ServerWeightLoader,
    reference_model: Callable[[int | None], Any], helpers: Any,
) -> None:  # fmt: skip
    caplog.set_level(logging.DEBUG, logger="asyncrl")
    old, new, stats, samples, _ = _run_update("recompute", lora_server, lora_loader, helpers, caplog)
    assert any(len(set(s.token_versions)) == 2 for s in samples), "no attempt cut a sample mid-generation"
    assert stats.failed_servers == {} and stats.interrupted_segments > 0
    worst = 0.0
    for sample in samples:
        tokens, versions = sample.output_token_ids, sample.token_versions
        assert len(tokens) == len(versions) == MAX_NEW_TOKENS and versions == sorted(versions)
        switch = versions.count(old)
        assert set(versions) <= {old, new}
        # Recompute: the new adapter re-reads prompt + old tokens.
        full = {v: _full(helpers, reference_model(v), tokens) for v in (old, new)}
        reference = full[old][:switch] + full[new][switch:]
        worst = max(worst, _max_diff(reference, sample.behaviour_logprobs))
        for other, part in ((full[new], slice(0, switch)), (full[old], slice(switch, None))):
            if other[part]:  # the check has power: the other version is far off
                assert _max_diff(other[part], sample.behaviour_logprobs[part]) > 100 * LOGPROB_TOLERANCE
    print(f"LoRA recompute: stall {stats.stall_s:.3f} s, max |server - PEFT| log-prob = {worst:.3g}")
    assert worst < LOGPROB_TOLERANCE


def test_keep_update_mid_generation_finishes_each_request_on_its_adapter(
    caplog: pytest.LogCaptureFixture, lora_server: RolloutServerHandle, lora_loader: ServerWeightLoader,
    reference_model: Callable[[int | None], Any], helpers: Any,
) -> None:  # fmt: skip
    """vLLM keeps a frozen request's adapter: its tokens after the resume are the old adapter's,
    although the engine's version spans call them the new version. Every token must carry the
    version whose adapter sampled it."""
    caplog.set_level(logging.DEBUG, logger="asyncrl")
    old, new, stats, samples, across = _run_update("keep", lora_server, lora_loader, helpers, caplog)
    assert across, f"no attempt of {ATTEMPTS} froze a request mid-generation"
    assert stats.failed_servers == {}
    worst = 0.0
    for sample in samples:
        tokens = sample.output_token_ids
        assert len(tokens) == MAX_NEW_TOKENS and sample.timings.segments == 1  # never resubmitted
        assert set(sample.token_versions) <= {old, new}
        # One adapter per segment: the engine's spans would split it at the update.
        assert len(set(sample.token_versions)) == 1, f"keep under LoRA mislabelled: {sample.token_versions}"
        version = sample.token_versions[0]
        reference = _full(helpers, reference_model(version), tokens)
        worst = max(worst, _max_diff(reference, sample.behaviour_logprobs))
        other = _full(helpers, reference_model(new if version == old else old), tokens)
        assert _max_diff(other, sample.behaviour_logprobs) > 100 * LOGPROB_TOLERANCE
    # The engine's label would have been wrong: the requests it saw across the update are old.
    assert any(set(s.token_versions) == {old} and s.timings.interruptions == 1 for s in samples)
    print(f"LoRA keep: stall {stats.stall_s:.3f} s, max |server - PEFT| log-prob = {worst:.3g}")
    assert worst < LOGPROB_TOLERANCE


def test_an_unknown_version_fails_clearly_and_the_server_keeps_its_adapter(
    lora_server: RolloutServerHandle, lora_loader: ServerWeightLoader,
    reference_model: Callable[[int | None], Any], helpers: Any,
) -> None:  # fmt: skip
    async def run() -> tuple[int, list[SampleOutput]]:
        async with RolloutClient([lora_server], adapters=True) as client:
            current = client.current_version
            with pytest.raises(WeightSyncError) as error:
                await asyncio.to_thread(lora_loader.load, lora_server, 999)
            assert re.search(r"weight version 999 is not published; available complete versions: \[0, 1, ", str(error.value))
            assert str(lora_server.url) in str(error.value)
            return current, await client.generate_group(PROMPT, 2, 32, ignore_eos=True)

    current, samples = asyncio.run(run())
    for sample in samples:
        assert sample.token_versions == [current] * 32
        reference = _full(helpers, reference_model(current), sample.output_token_ids)
        assert _max_diff(reference, sample.behaviour_logprobs) < LOGPROB_TOLERANCE


def test_only_the_newest_max_loras_adapters_stay_loaded_and_cached(
    lora_server: RolloutServerHandle, lora_loader: ServerWeightLoader, lora_cache_dir: Path,
    reference_model: Callable[[int | None], Any], helpers: Any,
) -> None:  # fmt: skip
    async def run() -> tuple[int, list[Any], list[SampleOutput]]:
        async with RolloutClient([lora_server], adapters=True) as client:
            start = client.current_version
            reports: list[Any] = []
            for version in range(start + 1, start + 4):
                await client.update_weights(version, lambda handle, v=version: reports.append(lora_loader.load(handle, v)))
            return start + 3, reports, await client.generate_group(PROMPT, 1, 16, ignore_eos=True)

    last, reports, samples = asyncio.run(run())
    assert loaded_adapters(lora_server) == [adapter_name(last - 1), adapter_name(last)]
    assert adapter_name(last - 2) in reports[-1].unloaded
    cached = sorted(p.name for p in lora_cache_dir.glob("*/v*") if p.is_dir())
    assert cached == [f"v{last - 1:06d}", f"v{last:06d}"], cached
    # An unloaded adapter can no longer be named.
    body = {"model": adapter_name(last - 2), "token_ids": PROMPT, "sampling_params": {"max_tokens": 1}, "stream": False}
    response = httpx.post(f"{lora_server.url}/inference/v1/generate", json=body, headers=lora_server.headers(), timeout=60)
    assert response.status_code == 404, response.text
    reference = _full(helpers, reference_model(last), samples[0].output_token_ids)
    assert samples[0].token_versions == [last] * 16
    assert _max_diff(reference, samples[0].behaviour_logprobs) < LOGPROB_TOLERANCE


def _generate_as(server: RolloutServerHandle, name: str, tokens: int) -> tuple[list[int], list[float]]:
    """One request naming adapter ``name``: its sampled token ids and their log-probs."""
    body = {"model": name, "token_ids": PROMPT, "stream": False,
            "sampling_params": {"max_tokens": tokens, "logprobs": 0, "ignore_eos": True, "temperature": 1.0}}  # fmt: skip
    response = httpx.post(f"{server.url}/inference/v1/generate", json=body, headers=server.headers(), timeout=120)
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    return choice["token_ids"], [float(c["logprob"]) for c in choice["logprobs"]["content"]]


def _lora_control(server: RolloutServerHandle, path: str, body: dict[str, str]) -> None:
    response = httpx.post(f"{server.url}{path}", json=body, headers=server.headers(), timeout=120)
    assert response.status_code == 200, response.text


def test_an_adapter_that_never_arrives_trips_the_canary_and_the_trained_one_does_not(
    lora_server: RolloutServerHandle, adapter_dirs: dict[int, Path], tiny_model_dir: Path, helpers: Any,
    tmp_path: Path,
) -> None:  # fmt: skip
    """The silent LoRA failure (rollouts keep sampling the initial policy while training goes
    on): the server serves the initial adapter's files (v0, B = 0) under the trained version's
    name. The trainer's log-probs of those tokens (the trained adapter, PEFT) then differ from
    the server's by a policy change and the mismatch canary fires; served with the trained
    adapter's own files, the figures stay at numerics level and it stays quiet."""
    import torch

    from asyncrl.configs.canary import MismatchCanaryConfig
    from asyncrl.tasks.algo.mismatch import all_gather_mismatch, local_mismatch
    from asyncrl.tasks.launch.canary import MismatchCanary

    trained = write_adapter(tiny_model_dir, tmp_path / "trained", seed=77, rank=RANK, alpha=ALPHA, b_std=0.5)
    trainer_model = peft_model(tiny_model_dir, trained)
    tokens = 24

    def figures(name: str, files: Path) -> dict[str, float]:
        _lora_control(lora_server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(files)})
        try:
            samples = [_generate_as(lora_server, name, tokens) for _ in range(N)]
        finally:
            _lora_control(lora_server, "/v1/unload_lora_adapter", {"lora_name": name})
        trainer = [torch.tensor(_full(helpers, trainer_model, ids), dtype=torch.float64) for ids, _ in samples]
        server = [torch.tensor(logprobs, dtype=torch.float64) for _, logprobs in samples]
        return all_gather_mismatch(local_mismatch(trainer, server, [[0] * tokens] * N), lambda x: [x])

    canary = MismatchCanary(MismatchCanaryConfig(min_tokens=N * tokens))
    bad = figures(adapter_name(900), adapter_dirs[0])  # the trained version's name, the initial files
    alarm = canary.observe(1, bad)
    assert alarm is not None and "a weight-sync bug?" in alarm.message(), bad
    good = figures(adapter_name(901), trained)
    assert good["mismatch/abs_logp_diff_mean"] < 1e-4 and good["mismatch/ratio_outside_frac"] == 0.0, good
    assert canary.observe(2, good) is None and canary.alarms == [alarm]
