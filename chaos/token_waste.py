"""Tokens generated again after kills, counted from what the schedulers received, against
the bound that the journal allows (issue 50's waste audit).

    tokens_regenerated = D - W - F

with D the output tokens every scheduler process of the run received (each keeps a count
that survives its kill, ``RunPaths.token_counts``), W the model tokens of every sample in
the run's shards and F those of the groups left out on purpose (their records). A token
received and kept lands in W or F exactly once, so in a run that drained (nothing in flight
at its end) the difference is the tokens received and then lost: streamed to a scheduler
killed before its journal held them, or cut from a server killed mid-segment after an
update began on it. A group generated again after its shard's quarantine counts too.

The bound sums, over the kills, what each may lose. At most S = (eta + 1) * B * n samples
are in flight (the gate admits the groups of the next eta + 1 steps, B groups of n samples
each, ``rollout.eta``, ``trainer.batch_groups``, ``rollout.n_samples``), each at most
M = ``rollout.max_new_tokens`` long:

- a scheduler: S * min(M, 2 J) with the journal (J = ``rollout.journal_tokens``: a sample
  holds under J unjournaled tokens when the writer looks, plus what streams while it looks
  and writes, allowed another J), S * M without it;
- a rollout server: S * M (in ``keep`` mode a segment's tokens received after an update
  began on its server are lost with the server: at most a whole answer);
- the trainer and the reward service: 0 (the scheduler waits through their outage and
  keeps every sample).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

LOSSLESS_KINDS = ("trainer", "reward")


@dataclass(frozen=True)
class TokenWaste:
    """What the kills of one run cost in tokens (module docstring)."""

    received: int
    """D: output tokens the run's scheduler processes received, summed over their counts."""
    kept: int
    """W + F: model tokens in the shards and in the left-out groups' records."""
    bound_per_kind: dict[str, int]
    """The bound's share of each kind of kill."""

    @property
    def bound(self) -> int:
        return sum(self.bound_per_kind.values())

    @property
    def regenerated(self) -> int:
        return self.received - self.kept

    def problems(self) -> list[str]:
        """Why the count breaks its contract: over the bound, or below zero (counts lost)."""
        if self.regenerated < 0:
            return [f"the schedulers' counts hold {self.received} tokens received, fewer than the {self.kept} kept: "
                    "a count is missing (a scheduler that ran without one, or a machine crash)"]  # fmt: skip
        if self.regenerated > self.bound:
            return [f"{self.regenerated} tokens were generated again after the kills, over the bound of {self.bound} "
                    f"({self.bound_per_kind}) that the journal allows"]  # fmt: skip
        return []


def regeneration_bound(
    kills: Iterable[str], eta: int, batch_groups: int, n_samples: int, max_new_tokens: int, journal_tokens: int
) -> dict[str, int]:
    """The bound of the module docstring per kind of kill, from the kinds of the kills fired."""
    in_flight = (eta + 1) * batch_groups * n_samples
    scheduler = min(max_new_tokens, 2 * journal_tokens) if journal_tokens > 0 else max_new_tokens
    per_kill = {"scheduler": in_flight * scheduler, "rollout": in_flight * max_new_tokens}
    bound: dict[str, int] = {}
    for kind in kills:
        if kind not in per_kill and kind not in LOSSLESS_KINDS:
            raise ValueError(f"no regeneration bound for a kill of {kind!r}")
        bound[kind] = bound.get(kind, 0) + per_kill.get(kind, 0)
    return bound


def token_waste(
    received: Mapping[str, int], shard_tokens: int, left_out_tokens: int, bound: Mapping[str, int]
) -> TokenWaste:
    """``received``: each scheduler process's count by file name
    (:func:`~asyncrl.tasks.system.durable_count.read_counts`)."""
    return TokenWaste(sum(received.values()), shard_tokens + left_out_tokens, dict(bound))
