"""Generation on a real vLLM server: log-probs, versions, train/inference agreement, bad key."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

import pytest

from asyncrl.tasks.model.tokenizer import EOS_TOKEN, IM_END_TOKEN, special_token_ids
from asyncrl.tasks.inference.client import RolloutClient
from asyncrl.tasks.inference.client_errors import RolloutAuthError, RolloutRequestError
from asyncrl.tasks.inference.routing import ServerEndpoint
from asyncrl.tasks.inference.samples import SampleOutput
from asyncrl.tasks.inference.server import RolloutServerHandle

PROMPT = [72, 101, 108, 108, 111, 44, 32, 50, 43, 50, 61]
LOGPROB_TOLERANCE = 1e-4
"""|vLLM behaviour log-prob - transformers float32 log-prob| allowed per token (seen: ~1e-6)."""


@pytest.mark.slow
def test_group_has_logprobs_and_versions_that_match_a_transformers_forward(
    server_a: RolloutServerHandle, hf_models: Callable[[int], Any], helpers: Any
) -> None:
    n, max_new_tokens = 6, 40

    async def run() -> tuple[int, list[SampleOutput]]:
        async with RolloutClient([server_a]) as client:
            return client.current_version, await client.generate_group(PROMPT, n, max_new_tokens, 1.0, 1.0)

    version, samples = asyncio.run(run())
    stop_ids = {special_token_ids()[EOS_TOKEN], special_token_ids()[IM_END_TOKEN]}
    assert len(samples) == n
    worst = 0.0
    for sample in samples:
        tokens = sample.output_token_ids
        assert 1 <= len(tokens) <= max_new_tokens
        assert len(sample.behaviour_logprobs) == len(tokens) == len(sample.token_versions)
        assert set(sample.token_versions) == {version}
        assert all(math.isfinite(lp) and lp <= 0 for lp in sample.behaviour_logprobs)
        if sample.finish_reason == "length":
            assert len(tokens) == max_new_tokens
        else:
            assert sample.finish_reason == "stop" and tokens[-1] in stop_ids
        timings = sample.timings
        assert (timings.interruptions, timings.retries, timings.segments) == (0, 0, 1)
        assert timings.submitted_at <= timings.finished_at
        reference = helpers.reference_logprobs(hf_models(version), None, PROMPT, tokens, len(tokens))
        worst = max(worst, max(abs(a - b) for a, b in zip(reference, sample.behaviour_logprobs)))
    print(f"train/inference agreement: max |vLLM - transformers| log-prob = {worst:.3g} (version {version})")
    assert worst < LOGPROB_TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("api_key", [None, "not-the-key"])
def test_a_refused_api_key_is_named(server_a: RolloutServerHandle, api_key: str | None) -> None:
    async def run() -> None:
        async with RolloutClient([ServerEndpoint(server_a.url, api_key)]):
            pass

    with pytest.raises(RolloutAuthError, match=rf"{server_a.url}.*refused the API key \(HTTP 401"):
        asyncio.run(run())


@pytest.mark.slow
def test_a_request_the_server_rejects_is_a_request_error(server_a: RolloutServerHandle) -> None:
    async def run() -> None:
        async with RolloutClient([server_a]) as client:
            await client.generate_group([1, 10**6], 2, 4)  # token id far outside the 320-token vocabulary

    with pytest.raises(RolloutRequestError, match=r"rejected the request \(HTTP 400"):
        asyncio.run(run())
