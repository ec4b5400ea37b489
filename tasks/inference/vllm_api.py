"""The vLLM HTTP API as the rollout client speaks it: the generate path, the pause parameters
of each interrupt mode, one segment's sampling parameters, the checks of a generation
request's arguments, the per-token weight versions read back from the final chunk, and the
served name of a weight version's LoRA adapter. Pure functions and data, kept apart from the
client's connection and retry logic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.tasks.inference.samples import InterruptMode


GENERATE_PATH = "/inference/v1/generate"
ADAPTER_PREFIX = "asyncrl-v"


def adapter_name(version: int) -> str:
    """The name weight version ``version`` is served under as a LoRA adapter (``asyncrl-v{version}``):
    what :func:`~asyncrl.tasks.inference.adapter_sync.update_server_adapter` loads and a
    request's ``model`` names to be sampled by that version."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"weight version must be a non-negative int, got {version!r}")
    return f"{ADAPTER_PREFIX}{version}"


def adapter_version(name: str) -> int | None:
    """The weight version of an adapter named by :func:`adapter_name`; None for any other name."""
    digits = name.removeprefix(ADAPTER_PREFIX)
    if digits == name or not digits.isdigit() or adapter_name(int(digits)) != name:
        return None
    return int(digits)

PAUSE_PARAMS: dict[InterruptMode, dict[str, str]] = {
    "recompute": {"mode": "abort", "clear_cache": "true"},
    # clear_cache=true would make vLLM preempt the frozen requests (reset_running_requests)
    # and so recompute their KV cache at resume: keep mode would silently become recompute.
    "keep": {"mode": "keep", "clear_cache": "false"},
}


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float
    top_p: float
    ignore_eos: bool
    stop_token_ids: tuple[int, ...]
    stream_interval: int

    def params(self, max_tokens: int) -> dict[str, Any]:
        """vLLM ``SamplingParams`` of one segment; ``logprobs: 0`` = the sampled token's only."""
        return {
            "stream_interval": self.stream_interval,
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "logprobs": 0,
            "ignore_eos": self.ignore_eos,
            "stop_token_ids": list(self.stop_token_ids),
            "detokenize": False,
        }


def check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: must be an int >= 1, got {value!r}")


def check_generate_args(
    prompt_token_ids: Sequence[int], n: int, max_new_tokens: int, temperature: float, top_p: float
) -> None:
    """``ValueError`` naming the first bad argument of :meth:`RolloutClient.generate_group`."""
    if len(prompt_token_ids) == 0:
        raise ValueError("prompt_token_ids: empty prompt; at least one token id is required")
    for i, token in enumerate(prompt_token_ids):
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"prompt_token_ids[{i}]: token ids are non-negative ints, got {token!r}")
    check_positive_int("n", n)
    check_positive_int("max_new_tokens", max_new_tokens)
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature: must be a finite number >= 0, got {temperature!r}")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p: must be in (0, 1], got {top_p!r}")


def versions_from_spans(spans: object, num_tokens: int, source: str) -> list[int]:
    """One version per output token from vLLM's spans ``[{"version", "start", "end"}, ...]``.

    The spans must tile ``[0, num_tokens)`` in order; each version string must be an int.
    """
    if num_tokens == 0:
        return []
    if not isinstance(spans, list) or not spans:
        raise RuntimeError(f"{source}: {num_tokens} tokens came without weight_versions spans")
    versions: list[int] = []
    for span in spans:
        raw = span.get("version") if isinstance(span, dict) else None
        if not isinstance(raw, str) or not raw.isdigit():
            raise RuntimeError(
                f"{source}: weight version {raw!r} is not an int (was the server restarted outside the client?)"
            )
        if span.get("start") != len(versions) or not isinstance(span.get("end"), int) or span["end"] < span["start"]:
            raise RuntimeError(f"{source}: weight_versions spans {spans} do not tile [0, {num_tokens})")
        versions.extend([int(raw)] * (span["end"] - span["start"]))
    if len(versions) != num_tokens:
        raise RuntimeError(f"{source}: weight_versions spans {spans} do not tile [0, {num_tokens})")
    return versions


def segment_versions(spans: object, num_tokens: int, source: str, submitted_version: int | None) -> list[int]:
    """One version per output token of a segment: the engine's spans
    (:func:`versions_from_spans`, checked in every case), or, on a server whose versions are
    LoRA adapters, ``submitted_version`` for every token: the server's version when the segment
    was submitted, whose adapter its request named (or the base model, which is version 0,
    before any adapter was loaded).

    Why: vLLM binds a request to its LoRA adapter when it is submitted. A request frozen by a
    ``keep`` pause resumes on the adapter it started with, while the engine's version label
    (``/update_weight_version``) moves on, so its spans would call the later tokens the new
    version; they were sampled by the old adapter. Under LoRA, ``keep`` means "finish on the
    adapter it started with". In ``recompute`` mode the cut segment is resubmitted under the
    new adapter, and the spans and this rule agree.
    """
    versions = versions_from_spans(spans, num_tokens, source)
    if submitted_version is None:
        return versions
    return [submitted_version] * num_tokens
