"""The mismatch canary on a real vLLM server whose weight sync is broken on purpose.

A weight update whose load does nothing (the bug: the server is told the new version but
keeps its old weights) still labels every token with the new version, so to the trainer
these tokens look sampled by its own current weights (staleness 0). The trainer's log-probs
of them (a transformers float32 forward of the labelled version's weights, what its
proximal pass computes) then differ from the behaviour log-probs the server reported by a
whole policy change, and the canary fires. A correct update right after (which also gives
the shared server back the weights its label says) keeps every figure at numerics level,
and the canary stays quiet.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import torch

from asyncrl.tasks.inference.client import RolloutClient
from asyncrl.tasks.inference.samples import SampleOutput
from asyncrl.tasks.inference.server import RolloutServerHandle
from asyncrl.tasks.launch.canary import MismatchCanary
from asyncrl.configs.canary import MismatchCanaryConfig
from asyncrl.tasks.algo.mismatch import all_gather_mismatch, local_mismatch

PROMPT = [84, 104, 101, 32, 97, 110, 115, 119, 101, 114, 32, 105, 115]
N, TOKENS = 4, 24


def figures(samples: list[SampleOutput], trainer_model: Any, helpers: Any) -> dict[str, float]:
    """The step's mismatch figures with the trainer holding ``trainer_model`` (every token
    labelled with the trainer's version: lag 0)."""
    trainer = [
        torch.tensor(helpers.reference_logprobs(trainer_model, None, PROMPT, s.output_token_ids, len(s.output_token_ids)),
                     dtype=torch.float64)
        for s in samples
    ]  # fmt: skip
    behaviour = [torch.tensor(s.behaviour_logprobs, dtype=torch.float64) for s in samples]
    lags = [[0] * len(s.output_token_ids) for s in samples]
    return all_gather_mismatch(local_mismatch(trainer, behaviour, lags), lambda x: [x])


@pytest.mark.slow
def test_a_server_that_skips_the_load_trips_the_canary_and_a_correct_update_does_not(
    server_a: RolloutServerHandle, loader: Callable[[int], Any], hf_models: Callable[[int], Any], helpers: Any
) -> None:
    async def run() -> tuple[int, list[SampleOutput], list[SampleOutput]]:
        async with RolloutClient([server_a], interrupt_mode="recompute") as client:
            broken = client.current_version + 1
            await client.update_weights(broken, lambda handle: None)  # the bug: nothing loaded
            stale = await client.generate_group(PROMPT, N, TOKENS, ignore_eos=True)
            await client.update_weights(broken + 1, loader(broken + 1))
            synced = await client.generate_group(PROMPT, N, TOKENS, ignore_eos=True)
            return broken, stale, synced

    broken, stale, synced = asyncio.run(run())
    assert all(s.token_versions == [broken] * TOKENS for s in stale)  # labelled as the new version
    assert all(s.token_versions == [broken + 1] * TOKENS for s in synced)
    canary = MismatchCanary(MismatchCanaryConfig(min_tokens=N * TOKENS))

    bad = figures(stale, hf_models(broken), helpers)
    assert bad["mismatch/current_version_tokens"] == N * TOKENS
    alarm = canary.observe(1, bad)
    assert alarm is not None and set(alarm.crossed) == set(canary.config.thresholds()), bad
    assert "a weight-sync bug?" in alarm.message()

    good = figures(synced, hf_models(broken + 1), helpers)
    assert good["mismatch/abs_logp_diff_mean"] < 1e-4 and good["mismatch/ratio_outside_frac"] == 0.0, good
    assert canary.observe(2, good) is None and canary.alarms == [alarm]
