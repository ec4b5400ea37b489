"""The rollout controller's counters and the figures derived from them (token rates, reward
means per task, weight-sync stall, wasted tokens, generation busy time), reported when the
controller stops.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from asyncrl.tasks.inference.samples import UpdateStats
from asyncrl.tasks.system.busy_time import BusyTime


@dataclass
class ControllerStats:
    admitted: int = 0
    resubmitted_after_restart: int = 0
    groups_written: int = 0
    shards_written: int = 0
    samples: int = 0
    output_tokens: int = 0
    reward_sum: float = 0.0
    reward_reasons: dict[str, int] = field(default_factory=dict)
    """Samples per ``<task>/<reason>`` (why rewards were what they were: ok, no_answer, timeout, ...)."""
    task_samples: dict[str, int] = field(default_factory=dict)
    task_reward_sum: dict[str, float] = field(default_factory=dict)
    reward_wait_s: float = 0.0
    """Seconds the groups waited for their rewards, summed over groups (they overlap: the
    reward service scores one group while others generate)."""
    updates: list[UpdateStats] = field(default_factory=list)
    skipped_prompts: int = 0
    filtered_groups: int = 0
    regenerated_groups: int = 0
    """Groups of quarantined shards admitted again (:func:`~asyncrl.tasks.scheduler.written_index.learn_quarantines`)."""
    """Groups in no shard on purpose, released from the gate: dynamic filtering (all rewards
    equal) or a group of episodes none of which could be kept."""
    filtered_tokens: int = 0
    """Output tokens of those groups."""
    written_tokens: int = 0
    """Output tokens of the groups written to shards."""
    context_tokens: int = 0
    """Tokens inserted between the turns of episodes (tool results, user turns: trained
    rows' context, not generated); ``output_tokens`` counts the model's tokens only."""
    episodes_left_out: dict[str, int] = field(default_factory=dict)
    """Episodes written in no row, by reason (``episode_error`` / ``episode_timeout`` under
    ``on_failure: drop``, ``no_model_call``, ``other_prompt``)."""
    discarded_tokens: int = 0
    """Output tokens of groups finished but not written when the controller stopped (behind a
    group still generating, see the module docstring): the next run generates them again."""
    streamed_tokens: int = 0
    """Output tokens the servers streamed during the controller's life, including those of
    groups cut by the stop (server work), set when it stops."""
    adaptive: dict[str, float] = field(default_factory=dict)
    """The adaptive bound's figures (:meth:`AdaptiveEta.summary`; empty without it)."""
    journal: dict[str, float] = field(default_factory=dict)
    """The journal's figures (:meth:`~asyncrl.tasks.scheduler.journal_writer.JournalWriter.figures`,
    set when the controller stops; empty without a journal)."""
    generation: BusyTime = field(default_factory=BusyTime)
    """The samples in flight on the rollout servers (the episodes start and finish them:
    :mod:`~asyncrl.tasks.agent.episodes`); its busy time is ``generation_busy_s``."""
    started_at: float = field(default_factory=time.monotonic)
    finished_at: float | None = None
    """When the controller stopped (None while it runs): rates are over its lifetime only,
    not the shutdown of the servers that follows."""

    @property
    def wasted_tokens(self) -> int:
        """Tokens generated and thrown away: those of groups cut in flight by the stop
        (streamed_tokens - (output_tokens - resumed), known once the controller stopped, where
        resumed are the output tokens taken from the journal rather than streamed) plus
        ``discarded_tokens``. Nothing else is discarded: no group is aborted and restarted,
        and no written sample is staler than the bound (module docstring)."""
        resumed = int(self.journal.get("journal_resumed_tokens", 0))
        return max(0, self.streamed_tokens - (self.output_tokens - resumed)) + self.discarded_tokens

    def count_sample(self, task: str, output_tokens: int, reward: float, reason: str) -> None:
        """Count one produced row (kept or later filtered): its model tokens, reward and reason."""
        self.samples += 1
        self.output_tokens += output_tokens
        self.reward_sum += reward
        self.task_samples[task] = self.task_samples.get(task, 0) + 1
        self.task_reward_sum[task] = self.task_reward_sum.get(task, 0.0) + reward
        self.reward_reasons[f"{task}/{reason}"] = self.reward_reasons.get(f"{task}/{reason}", 0) + 1

    def summary(self) -> dict[str, float]:
        """Counts and rates over elapsed = finished_at (or now) - started_at:
        gen_tokens_per_s = output_tokens / elapsed (tokens of finished groups),
        streamed_tokens_per_s = streamed_tokens / elapsed (all the servers generated),
        weight_sync_stall_fraction = stall / elapsed; per task ``samples/<task>``,
        ``reward_sum/<task>``, reward_mean/<task> = reward_sum/<task> / samples/<task>, and
        ``reasons/<task>/<reason>`` sample counts; generation_busy_s = min(length of the union
        of the samples' in-flight intervals (:class:`BusyTime`), elapsed), the seconds at least
        one sample was generating (the union, not the sum over samples; the min leaves out the
        moment the stop takes to cancel the samples cut by it)."""
        end = time.monotonic() if self.finished_at is None else self.finished_at
        elapsed = max(end - self.started_at, 1e-9)
        stall = sum(u.stall_s for u in self.updates)
        return {
            "elapsed_s": elapsed,
            "generation_busy_s": min(self.generation.busy_s(), elapsed),
            "admitted": self.admitted,
            "groups_written": self.groups_written,
            "shards_written": self.shards_written,
            "samples": self.samples,
            "output_tokens": self.output_tokens,
            "gen_tokens_per_s": self.output_tokens / elapsed,
            "streamed_tokens": self.streamed_tokens,
            "streamed_tokens_per_s": self.streamed_tokens / elapsed,
            "written_tokens": self.written_tokens,
            "filtered_groups": self.filtered_groups,
            "regenerated_groups": self.regenerated_groups,
            "filtered_tokens": self.filtered_tokens,
            "wasted_tokens": self.wasted_tokens,
            "reward_mean": self.reward_sum / self.samples if self.samples else 0.0,
            "weight_updates": len(self.updates),
            "weight_sync_stall_s": stall,
            "weight_sync_stall_fraction": stall / elapsed,
            "skipped_prompts": self.skipped_prompts,
            "reward_wait_s": self.reward_wait_s,
            "context_tokens": self.context_tokens,
            **{f"episodes_left_out/{reason}": float(n) for reason, n in self.episodes_left_out.items()},
            **self.adaptive,
            **self.journal,
            **{f"samples/{task}": float(n) for task, n in self.task_samples.items()},
            **{f"reward_sum/{task}": total for task, total in self.task_reward_sum.items()},
            **{f"reward_mean/{task}": self.task_reward_sum[task] / n for task, n in self.task_samples.items() if n},
            **{f"reasons/{reason}": float(n) for reason, n in self.reward_reasons.items()},
        }
