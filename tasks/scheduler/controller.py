"""The rollout controller: admits prompt groups through the staleness gate, generates
them on the rollout servers, scores them, writes trajectory shards, and pushes every
newly published weight version to the servers.

Exactly-once across restarts: group k is always prompt `PromptSchedule.record(k)` with id
`g{k:08d}`; the admitted count is persisted (`scheduler/state.json`) *before* group k is
dispatched, and shards (indexed in ``scheduler/written.json``) are the truth of what was
produced, so a restart re-dispatches admitted, unwritten groups without admitting them again.
The gate admits group k (kept groups only) only while floor(k / B) <= i + eta, and groups are
written in admission order, never a shard across a batch boundary, so the trainer trains
group k at step floor(k / B): no sample is staler than eta. Filtered groups are recorded,
then released. Proof, trade-offs, filtering, episodes: ``docs/internals/scheduler.md``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from asyncrl.tasks.algo.adaptive_eta import AdaptiveEta, AdaptiveState
from asyncrl.configs.adaptive_staleness import AdaptiveStalenessConfig
from asyncrl.tasks.algo.staleness_gate import GateState, StalenessGate
from asyncrl.storage import fs, paths
from asyncrl.storage.doorbell import SHARDS_TOPIC, WEIGHTS_TOPIC, Doorbell, DoorbellListener
from asyncrl.storage.fs import RunRoot
from asyncrl.storage.schema import Sample
from asyncrl.storage.shards import ShardReader, ShardWriter, read_claims
from asyncrl.storage.weight_lineage import VersionUpdates, read_lineage
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.agent.runner import EpisodeRunner, episode_sample, kept_outcomes, score_outcomes
from asyncrl.tasks.data.loader import PromptRecord
from asyncrl.tasks.reward.types import RewardRequest, RewardResult
from asyncrl.tasks.data.reward_requests import reward_request
from asyncrl.tasks.inference.samples import SampleOutput, UpdateStats

LOG = logging.getLogger("asyncrl.scheduler")


class GroupGenerator(Protocol):
    """What the controller needs of the rollout client."""

    @property
    def current_version(self) -> int: ...

    def streamed_tokens(self) -> dict[str, int]: ...

    async def generate_group(
        self,
        prompt_token_ids: Sequence[int],
        n: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        *,
        ignore_eos: bool = False,
        stop_token_ids: Sequence[int] = (),
    ) -> list[SampleOutput]: ...

    async def update_weights(self, version: int, load: Callable[[Any], Any]) -> UpdateStats: ...


class RewardScorer(Protocol):
    async def score(self, requests: Sequence[RewardRequest]) -> list[RewardResult]: ...


class TextCodec(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class ControllerSettings:
    run_id: str
    batch_groups: int
    eta: int
    n_samples: int
    max_new_tokens: int
    max_prompt_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    """Generate to the budget: no end-of-sequence or stop token ends a sample."""
    shard_groups: int = 4
    shard_seconds: float = 10.0
    weight_poll_seconds: float = 0.5
    admit_poll_seconds: float = 0.05
    seed: int = 0
    max_groups_in_flight: int | None = None
    """Admit a group only while fewer are generating or being scored (None: the gate alone).
    A restart sends the groups admitted before it out again at once, over the cap if need be."""
    max_groups: int | None = None
    """Admit at most this many groups in total (None: until stopped); with ``dynamic_filter``,
    filtered groups do not count, so the run still produces this many kept groups."""
    dynamic_filter: bool = False
    """Leave out (and release from the gate) groups whose rewards are all equal (module docstring)."""
    adaptive_staleness: AdaptiveStalenessConfig | None = None
    """Move the gate's effective bound with the drift each step measured (None: always ``eta``;
    :mod:`~asyncrl.tasks.algo.adaptive_eta`)."""


def group_id(index: int) -> str:
    return f"g{index:08d}"


def group_index(gid: str) -> int:
    if not (gid.startswith("g") and gid[1:].isdigit()):
        raise ValueError(f"group id {gid!r} was not written by the scheduler (expected g########)")
    return int(gid[1:])


class PromptSchedule:
    """Group k -> prompt: epoch e = k // N visits all N prompts in a permutation seeded
    by (seed, e), so the order is reproducible and each epoch sees every prompt once."""

    def __init__(self, records: Sequence[PromptRecord], seed: int) -> None:
        if not records:
            raise ValueError("the prompt dataset is empty")
        self._records = list(records)
        self._seed = seed
        self._orders: dict[int, list[int]] = {}

    def record(self, index: int) -> PromptRecord:
        epoch, position = divmod(index, len(self._records))
        order = self._orders.get(epoch)
        if order is None:
            order = list(range(len(self._records)))
            random.Random(f"{self._seed}:{epoch}").shuffle(order)
            self._orders = {epoch: order}  # one epoch at a time is all the controller needs
        return self._records[order[position]]


def sample_budget(record: PromptRecord, max_new_tokens: int) -> int:
    """Output-token budget of each sample of ``record``: min(record.max_new_tokens, max_new_tokens),
    or ``max_new_tokens`` when the prompt sets none."""
    return max_new_tokens if record.max_new_tokens is None else min(record.max_new_tokens, max_new_tokens)


def _scheduler_state(root: RunRoot) -> dict[str, Any] | None:
    """The scheduler state file as a JSON object (None: none saved); ``ValueError`` names it if corrupt."""
    try:
        raw = json.loads(fs.read_bytes(root, paths.SCHEDULER_STATE))
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise ValueError(f"{root.display(paths.SCHEDULER_STATE)}: corrupt scheduler state ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{root.display(paths.SCHEDULER_STATE)}: corrupt scheduler state (not a JSON object)")
    return raw


def load_gate_state(root: RunRoot) -> GateState | None:
    raw = _scheduler_state(root)
    if raw is None:
        return None
    try:
        return GateState.from_json(json.dumps(raw["gate"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{root.display(paths.SCHEDULER_STATE)}: corrupt scheduler state ({exc})") from None


def load_adaptive_state(root: RunRoot) -> AdaptiveState | None:
    """The adaptive staleness state saved beside the gate's (None: none saved)."""
    raw = _scheduler_state(root)
    if raw is None or raw.get("adaptive") is None:
        return None
    try:
        return AdaptiveState.from_dict(raw["adaptive"])
    except ValueError as exc:
        raise ValueError(f"{root.display(paths.SCHEDULER_STATE)}: corrupt scheduler state ({exc})") from None


def save_gate_state(root: RunRoot, state: GateState, adaptive: AdaptiveState | None = None) -> None:
    payload: dict[str, Any] = {"gate": json.loads(state.to_json()), "saved_at": time.time()}
    if adaptive is not None:
        payload["adaptive"] = adaptive.to_dict()
    fs.put_atomic_replace(root, paths.SCHEDULER_STATE, json.dumps(payload).encode())


FILTERED_DIR = f"{paths.SCHEDULER_DIR}/filtered"


FILTER_REASON = "equal_rewards"
NO_EPISODE_KEPT = "no_episode_kept"


def filtered_record_path(index: int) -> str:
    """Where the record of filtered group ``index`` lies: ``scheduler/filtered/g{index:08d}.json``."""
    return f"{FILTERED_DIR}/{group_id(index)}.json"


def save_filtered(root: RunRoot, samples: Sequence[Sample]) -> None:
    """Record that the group of ``samples`` was left out by dynamic filtering (one PUT)."""
    save_left_out(root, group_index(samples[0].group_id), samples[0].prompt_id, FILTER_REASON, samples)


def save_left_out(root: RunRoot, index: int, prompt_id: str, reason: str, samples: Sequence[Sample]) -> None:
    """Record that group ``index`` is in no shard on purpose (one PUT): dynamic filtering
    (``equal_rewards``) or a group of episodes none of which could be kept
    (``no_episode_kept``, ``samples`` empty). The group then counts as filtered."""
    record = {
        "group_id": group_id(index),
        "prompt_id": prompt_id,
        "reason": reason,
        "reward": float(samples[0].reward) if samples else None,
        "samples": len(samples),
        "output_tokens": sum(s.model_token_count for s in samples),
        "filtered_at": time.time(),
    }
    fs.put_atomic_replace(root, filtered_record_path(index), json.dumps(record).encode())


def filtered_groups(root: RunRoot) -> list[int]:
    """Indices of every group dynamic filtering left out, ascending: one listing, O(filtered
    groups) (for audits; the controller checks single records, :func:`count_filtered`)."""
    found = []
    for name in fs.list_dir(root, FILTERED_DIR):
        stem = name.removesuffix(".json")
        if name.endswith(".json") and stem.startswith("g") and stem[1:].isdigit():
            found.append(group_index(stem))
    return sorted(found)


def count_filtered(root: RunRoot, written: WrittenGroups, admitted: int) -> int:
    """Count in ``written`` the admitted groups it lacks that have a filtered record (recorded
    after the index was last saved); returns how many. One existence check per admitted
    group no shard holds: O(groups in flight)."""
    found = [k for k in written.missing_below(admitted) if fs.exists(root, filtered_record_path(k))]
    written.add(found)
    written.filtered += len(found)
    return len(found)


def all_equal_rewards(samples: Sequence[Sample]) -> bool:
    """The group has no advantage signal: every reward the same (what dynamic filtering leaves out)."""
    return len({float(s.reward) for s in samples}) == 1


WRITTEN_FORMAT = 1


@dataclass
class WrittenGroups:
    """Group indices some published shard holds, or that dynamic filtering left out
    (``filtered`` of them), as a dense prefix plus the rest.

    Every k < ``prefix`` is written, and so is every k in ``extra`` (all >= ``prefix``);
    ``next_seq`` says which shards are counted: the groups of every shard published with
    a sequence number below it. Groups finish out of order, so ``extra`` holds the
    groups written past the first gap: O(groups in flight), not O(run), and the saved
    object stays small however long the run.
    """

    next_seq: int = 0
    prefix: int = 0
    extra: set[int] = field(default_factory=set)
    filtered: int = 0
    """How many of the groups counted were left out by dynamic filtering (in no shard)."""

    def add(self, indices: Iterable[int]) -> None:
        """Count ``indices`` as written (amortised O(1) each)."""
        for index in indices:
            if index >= self.prefix:
                self.extra.add(index)
        while self.prefix in self.extra:
            self.extra.remove(self.prefix)
            self.prefix += 1

    def __contains__(self, index: object) -> bool:
        return isinstance(index, int) and (index < self.prefix or index in self.extra)

    @property
    def total(self) -> int:
        """How many groups are written or filtered."""
        return self.prefix + len(self.extra)

    @property
    def in_shards(self) -> int:
        """How many groups some shard holds (the kept groups)."""
        return self.total - self.filtered

    def count_below(self, limit: int) -> int:
        """How many of the groups 0 .. limit-1 are written: O(|extra|)."""
        return min(self.prefix, limit) + sum(1 for index in self.extra if index < limit)

    def missing_below(self, limit: int) -> list[int]:
        """The groups 0 .. limit-1 no shard holds, ascending: O(limit - prefix)."""
        return [k for k in range(self.prefix, limit) if k not in self.extra]

    def to_json(self) -> str:
        return json.dumps(
            {"format": WRITTEN_FORMAT, "next_seq": self.next_seq, "prefix": self.prefix,
             "extra": sorted(self.extra), "filtered": self.filtered, "saved_at": time.time()}
        )  # fmt: skip

    @staticmethod
    def from_json(raw: bytes, source: str) -> WrittenGroups:
        """Parse a saved index; ``ValueError`` names ``source`` if it is not one."""
        try:
            content = json.loads(raw)
            written = WrittenGroups(int(content["next_seq"]), int(content["prefix"]), {int(k) for k in content["extra"]},
                                    int(content.get("filtered", 0)))  # fmt: skip
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{source}: corrupt written-groups index ({exc})") from None
        if (written.next_seq < 0 or written.prefix < 0 or any(k < written.prefix for k in written.extra)
                or not 0 <= written.filtered <= written.total):  # fmt: skip
            raise ValueError(f"{source}: inconsistent written-groups index {content!r}")
        return written


def save_written_groups(root: RunRoot, written: WrittenGroups) -> None:
    """Replace ``scheduler/written.json`` with ``written`` (one PUT)."""
    fs.put_atomic_replace(root, paths.SCHEDULER_WRITTEN, written.to_json().encode())


def _published(reader: ShardReader, name: str, quarantined: list[str]) -> bool:
    return reader.locate(name) is not None or any(q == name or q.startswith(f"{name}.") for q in quarantined)


def _scan_all_shards(root: RunRoot, run_id: str) -> WrittenGroups:
    """The index rebuilt by reading every shard (waiting and consumed): O(run), used only for a
    root whose claims predate the index (they name no groups)."""
    reader = ShardReader(root, run_id)
    written = WrittenGroups()
    for shard in reader.list_shards():
        table = reader.read(shard)
        written.add({group_index(g) for g in set(table.column("group_id").to_pylist())})
        written.next_seq = max(written.next_seq, shard.seq + 1)
    return written


def load_written_groups(root: RunRoot, run_id: str, save: bool = True) -> WrittenGroups:
    """The groups some shard of this run holds: the saved index, brought up to date.

    The index is saved (by the controller, :meth:`RolloutController._flush`) only after
    the shard it counts was published, and one shard write at a time, so it never counts
    a group that is not in a shard; what it may lack are the shards published after the
    last save (a kill in between). Those have sequence numbers >= ``next_seq``: their
    claims (:func:`asyncrl.storage.shards.read_claims`) name the shard and its group ids,
    and a claimed shard counts once it exists, waiting, consumed or quarantined (a claim
    whose shard never appeared was cut by a kill: its groups are generated again). Work:
    one read of the index, one read per claim since it plus one, at most three existence
    checks per such claim, and one listing of ``quarantine/`` when there are claims to
    check; no shard is listed or read. Groups of a quarantined shard stay written: the
    scheduler produced them once and does not produce them again.

    A root whose claims name no groups (written before claims did) is scanned in full
    once. With ``save``, an index that moved forward is saved back.
    """
    raw: bytes | None
    try:
        raw = fs.read_bytes(root, paths.SCHEDULER_WRITTEN)
    except FileNotFoundError:
        raw = None
    written = WrittenGroups() if raw is None else WrittenGroups.from_json(raw, root.display(paths.SCHEDULER_WRITTEN))
    claims = read_claims(root, written.next_seq)
    rebuilt = any(claim.group_ids is None for claim in claims)
    if rebuilt:
        written = _scan_all_shards(root, run_id)
        claims = read_claims(root, written.next_seq)
    if claims:
        reader = ShardReader(root, run_id)
        quarantined = fs.list_dir(root, paths.QUARANTINE_DIR)
        for claim in claims:
            # A claim naming no groups after a full scan: its shard is not in the run (never
            # published, or quarantined before the index existed).
            if claim.shard is not None and claim.group_ids is not None and _published(reader, claim.shard, quarantined):
                written.add({group_index(g) for g in claim.group_ids})
            written.next_seq = claim.seq + 1
    if save and (claims or rebuilt):
        save_written_groups(root, written)
    return written


def written_group_indices(root: RunRoot, run_id: str) -> WrittenGroups:
    """Indices of the groups some shard of this run already holds (:func:`load_written_groups`,
    without saving: for a look that changes nothing)."""
    return load_written_groups(root, run_id, save=False)


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
    started_at: float = field(default_factory=time.monotonic)
    finished_at: float | None = None
    """When the controller stopped (None while it runs): rates are over its lifetime only,
    not the shutdown of the servers that follows."""

    @property
    def wasted_tokens(self) -> int:
        """Tokens generated and thrown away: those of groups cut in flight by the stop
        (streamed_tokens - output_tokens, known once the controller stopped) plus
        ``discarded_tokens``. Nothing else is discarded: no group is aborted and restarted,
        and no written sample is staler than the bound (module docstring)."""
        return max(0, self.streamed_tokens - self.output_tokens) + self.discarded_tokens

    def summary(self) -> dict[str, float]:
        """Counts and rates over elapsed = finished_at (or now) - started_at:
        gen_tokens_per_s = output_tokens / elapsed (tokens of finished groups),
        streamed_tokens_per_s = streamed_tokens / elapsed (all the servers generated),
        weight_sync_stall_fraction = stall / elapsed; per task ``samples/<task>``,
        ``reward_sum/<task>``, reward_mean/<task> = reward_sum/<task> / samples/<task>, and
        ``reasons/<task>/<reason>`` sample counts."""
        end = time.monotonic() if self.finished_at is None else self.finished_at
        elapsed = max(end - self.started_at, 1e-9)
        stall = sum(u.stall_s for u in self.updates)
        return {
            "elapsed_s": elapsed,
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
            **{f"samples/{task}": float(n) for task, n in self.task_samples.items()},
            **{f"reward_sum/{task}": total for task, total in self.task_reward_sum.items()},
            **{f"reward_mean/{task}": self.task_reward_sum[task] / n for task, n in self.task_samples.items() if n},
            **{f"reasons/{reason}": float(n) for reason, n in self.reward_reasons.items()},
        }


class RolloutController:
    """Runs the admit -> generate -> score -> write loop until stopped."""

    def __init__(
        self,
        settings: ControllerSettings,
        root: RunRoot,
        prompts: PromptSchedule,
        render: Callable[[PromptRecord], str],
        codec: TextCodec,
        generator: GroupGenerator,
        scorer: RewardScorer,
        weight_loader: Callable[[int], Callable[[Any], Any]],
        episodes: EpisodeRunner | None = None,
        weight_prefetch: Callable[[int], object] | None = None,
    ) -> None:
        self.settings = settings
        self.root = root
        self.prompts = prompts
        self.render = render
        self.codec = codec
        self.generator = generator
        self.scorer = scorer
        self.weight_loader = weight_loader
        self.weight_prefetch = weight_prefetch
        """Fetches a version onto the servers' host before its update pauses generation
        (:meth:`~asyncrl.tasks.inference.weight_sync.ServerWeightLoader.prefetch`); None: the
        load fetches it during the pause."""
        self.episodes = episodes
        """Runs each group as n agent episodes (``rollout.episode``); None: single-turn samples."""
        self.weights = WeightStore(root)
        self.version_updates = VersionUpdates(root)
        self.writer = ShardWriter(root, settings.run_id)
        self.written: WrittenGroups | None = None
        """The written-groups index (loaded when :meth:`run` starts)."""
        self._write_lock = asyncio.Lock()
        self.stats = ControllerStats()
        self.gate = StalenessGate(
            settings.batch_groups,
            settings.eta,
            _GeneratorUpdates(generator, self.version_updates),
            state=load_gate_state(root),
        )
        self.adaptive: AdaptiveEta | None = None
        """The effective bound's controller (``settings.adaptive_staleness``); its state is
        loaded when :meth:`run` starts."""
        self._order: deque[int] = deque()
        """Dispatched groups not yet written, in admission order: the order they are written in."""
        self._done: dict[int, list[Sample] | None] = {}
        """Finished groups waiting for their turn to be written, by index (None: filtered)."""
        self._done_at: dict[int, float] = {}
        """When each group of ``_done`` finished (the shard timer)."""
        self._failure: BaseException | None = None
        self._version_changed = asyncio.Event()
        """Set when the servers move to a new version: the gate may admit again."""
        self._shards_bell = Doorbell(root, SHARDS_TOPIC)
        self._weights_listener: DoorbellListener | None = None

    async def run(self, stop: asyncio.Event) -> ControllerStats:
        """Work until `stop` is set (or `max_groups` are admitted and produced).

        On stop, the finished groups at the head of the admission order are written and
        groups still generating are cancelled; they and the finished groups behind them are
        in no shard, so a later run of the same root regenerates them (``wasted_tokens``)."""
        in_flight: set[asyncio.Task[None]] = set()
        streamed_before = sum(self.generator.streamed_tokens().values())
        self._weights_listener = await asyncio.to_thread(DoorbellListener, self.root, WEIGHTS_TOPIC)
        watcher = self._start(self._watch_weights(stop), "weight-watcher")
        flusher = self._start(self._flush_periodically(stop), "shard-flusher")
        try:
            self.written = await asyncio.to_thread(load_written_groups, self.root, self.settings.run_id)
            await self._start_adaptive()
            if await asyncio.to_thread(count_filtered, self.root, self.written, self.gate.stats().admitted):
                await asyncio.to_thread(save_written_groups, self.root, self.written)
            self.gate.release(self.written.filtered)  # durable records: see the module docstring
            for index in self._unwritten_admitted():
                self.stats.resubmitted_after_restart += 1
                self._dispatch(index, in_flight)
            await self._admit_loop(stop, in_flight)
            # Admissions are over (max_groups reached): finish the groups in flight,
            # unless stopped first; a stopped group is regenerated by the next run.
            while in_flight and not stop.is_set():
                self._raise_failure()
                await asyncio.wait(set(in_flight), timeout=0.5)
            self._raise_failure()
            await self._flush(partial=True)
        finally:
            self.stats.finished_at = time.monotonic()
            # Finished but behind a group that was still generating: not written (write order,
            # docs/internals/scheduler.md), generated again by the next run.
            self.stats.discarded_tokens += sum(s.model_token_count for g in self._done.values() if g for s in g)
            self.stats.streamed_tokens = sum(self.generator.streamed_tokens().values()) - streamed_before
            stop.set()
            for task in (*in_flight, watcher, flusher):
                task.cancel()
            await asyncio.gather(*in_flight, watcher, flusher, return_exceptions=True)
            await asyncio.to_thread(self._weights_listener.close)
            self._weights_listener = None
        self._raise_failure()
        return self.stats

    def _save_state(self) -> None:
        save_gate_state(self.root, self.gate.state(), None if self.adaptive is None else self.adaptive.state())

    async def _start_adaptive(self) -> None:
        """Go on from the saved effective bound, else start at eta reading from the servers' version."""
        config = self.settings.adaptive_staleness
        if config is None:
            return
        saved = await asyncio.to_thread(load_adaptive_state, self.root)
        if saved is None:
            saved = AdaptiveState(self.settings.eta, self.generator.current_version, 0)
        self.adaptive = AdaptiveEta(config, self.settings.eta, saved)
        self.gate.set_eta(self.adaptive.eta)
        self.stats.adaptive = self.adaptive.summary()

    async def _read_drift(self, latest: int) -> None:
        """Feed the adaptive bound the step figures of the versions published since the last
        one read, in order (their lineage; a version without figures counts as a step
        without drift measured), and apply its bound to the gate."""
        adaptive = self.adaptive
        if adaptive is None or latest <= adaptive.version:
            return
        before = adaptive.eta
        for version in range(adaptive.version + 1, latest + 1):
            lineage = await asyncio.to_thread(read_lineage, self.root, version)
            if lineage is None:
                continue  # not published by the trainer (or not kept): nothing measured
            metrics = lineage.get("metrics")
            step = lineage.get("step")
            adaptive.observe(version, step if isinstance(step, int) else 0, metrics if isinstance(metrics, dict) else {})
        adaptive.version = max(adaptive.version, latest)
        self.stats.adaptive = adaptive.summary()
        if adaptive.eta != before:
            self.gate.set_eta(adaptive.eta)
            self._save_state()
            if adaptive.eta > before:
                self._version_changed.set()  # the gate may admit again

    def _unwritten_admitted(self) -> list[int]:
        assert self.written is not None
        return self.written.missing_below(self.gate.stats().admitted)

    async def _admit_loop(self, stop: asyncio.Event, in_flight: set[asyncio.Task[None]]) -> None:
        limit, cap = self.settings.max_groups, self.settings.max_groups_in_flight
        while not stop.is_set():
            self._raise_failure()
            all_admitted = limit is not None and self._admitted_kept() >= limit
            if all_admitted and not in_flight:
                return
            if all_admitted or (cap is not None and len(in_flight) >= cap):
                # Wait for a group to finish: at max_groups it may yet be filtered out and
                # another admitted instead; at the cap it makes room for the next one.
                await asyncio.wait(set(in_flight), timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
                continue
            if not self.gate.try_admit():
                # Woken by the next weight update (the only thing that opens the gate);
                # the poll interval is a fallback.
                self._version_changed.clear()
                if not self.gate.try_admit():
                    await _wait_either(stop, self._version_changed, self.settings.admit_poll_seconds)
                    continue
            index = self.gate.stats().admitted - 1
            self._save_state()  # before dispatch: see module docstring
            self.stats.admitted += 1
            self._dispatch(index, in_flight)

    def _admitted_kept(self) -> int:
        """Groups admitted and not released by filtering (what ``max_groups`` counts)."""
        stats = self.gate.stats()
        return stats.admitted - stats.released

    def _dispatch(self, index: int, in_flight: set[asyncio.Task[None]]) -> None:
        if self._order and index <= self._order[-1]:
            raise RuntimeError(f"group {index} dispatched after group {self._order[-1]}: groups go out in admission order")
        self._order.append(index)
        task = self._start(self._produce_group(index), f"group-{index}")
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)

    def _start(self, work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """A task whose failure fails the controller (checked by `_raise_failure`)."""
        task = asyncio.create_task(work, name=name)
        task.add_done_callback(self._note_failure)
        return task

    def _note_failure(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None and self._failure is None:
            self._failure = task.exception()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    async def _produce_group(self, index: int) -> None:
        record = self.prompts.record(index)
        if self.episodes is None:
            samples = await self._generate_samples(index, record)
        else:
            samples = await self._run_episodes(index, record)
        if not samples:
            await asyncio.to_thread(save_left_out, self.root, index, record.prompt_id, NO_EPISODE_KEPT, [])
            self._leave_out(index)
            LOG.warning("group %s left out: none of its %d episodes could be kept", group_id(index),
                        self.settings.n_samples)  # fmt: skip
        elif self.settings.dynamic_filter and all_equal_rewards(samples):
            await asyncio.to_thread(save_filtered, self.root, samples)  # durable before it is released
            self._leave_out(index)
            self.stats.filtered_tokens += sum(s.model_token_count for s in samples)
            LOG.info("group %s left out by dynamic filtering: all %d rewards are %g", group_id(index), len(samples),
                     samples[0].reward)  # fmt: skip
        else:
            self._done[index] = samples
        self._done_at[index] = time.monotonic()
        await self._flush()

    def _leave_out(self, index: int) -> None:
        """Group ``index`` (its record saved) goes in no shard: release it from the gate."""
        self.gate.release()
        self.stats.filtered_groups += 1
        self._version_changed.set()  # the gate may admit again
        self._done[index] = None

    async def _generate_samples(self, index: int, record: PromptRecord) -> list[Sample]:
        """The group's single-turn samples, generated and scored."""
        prompt_ids = self.codec.encode(self.render(record))
        if len(prompt_ids) > self.settings.max_prompt_tokens:
            raise ValueError(
                f"prompt {record.prompt_id} has {len(prompt_ids)} tokens, over data.max_prompt_tokens "
                f"= {self.settings.max_prompt_tokens}"
            )
        outputs = await self.generator.generate_group(
            prompt_ids,
            self.settings.n_samples,
            sample_budget(record, self.settings.max_new_tokens),
            self.settings.temperature,
            self.settings.top_p,
            ignore_eos=self.settings.ignore_eos,
            stop_token_ids=() if self.settings.ignore_eos else self.settings.stop_token_ids,
        )
        results = await self._score(record, [self.codec.decode(o.output_token_ids) for o in outputs])
        samples = [
            Sample(
                prompt_id=record.prompt_id,
                group_id=group_id(index),
                prompt_token_ids=prompt_ids,
                output_token_ids=o.output_token_ids,
                behaviour_logprobs=o.behaviour_logprobs,
                token_versions=o.token_versions,
                reward=r.reward,
                finish_reason=o.finish_reason,
                submit_time=o.timings.submitted_at,
                finish_time=o.timings.finished_at,
                task=record.task,
            )
            for o, r in zip(outputs, results, strict=True)
        ]
        for output, result in zip(outputs, results, strict=True):
            self._count_sample(record.task, len(output.output_token_ids), result.reward, result.reason)
        return samples

    async def _run_episodes(self, index: int, record: PromptRecord) -> list[Sample]:
        """The group's episodes as trajectory rows (:mod:`asyncrl.tasks.agent.runner`): run,
        kept by ``on_failure``, scored by the row's reward where the episode left it open."""
        assert self.episodes is not None
        outcomes = await self.episodes.run_group(record, self.settings.n_samples)
        chosen = kept_outcomes(outcomes, self.episodes.config.on_failure)
        for reason, count in chosen.left_out.items():
            self.stats.episodes_left_out[reason] = self.stats.episodes_left_out.get(reason, 0) + count
        for outcome in outcomes:
            if outcome.failure is not None:
                LOG.warning("group %s: episode failed: %s", group_id(index), outcome.failure)
        scoring_started = time.monotonic()
        scored = await score_outcomes(record, chosen.kept, self.scorer)
        self.stats.reward_wait_s += time.monotonic() - scoring_started
        samples = []
        for outcome, (reward, reason) in zip(chosen.kept, scored, strict=True):
            sample = episode_sample(record, group_id(index), outcome, reward)
            generated = sample.model_token_count
            self._count_sample(record.task, generated, reward, reason)
            self.stats.context_tokens += len(sample.output_token_ids) - generated
            samples.append(sample)
        return samples

    async def _score(self, record: PromptRecord, texts: Sequence[str]) -> list[RewardResult]:
        if not texts:
            return []
        scoring_started = time.monotonic()
        results = await self.scorer.score([reward_request(record, t) for t in texts])
        self.stats.reward_wait_s += time.monotonic() - scoring_started
        return results

    def _count_sample(self, task: str, output_tokens: int, reward: float, reason: str) -> None:
        self.stats.samples += 1
        self.stats.output_tokens += output_tokens
        self.stats.reward_sum += reward
        self.stats.task_samples[task] = self.stats.task_samples.get(task, 0) + 1
        self.stats.task_reward_sum[task] = self.stats.task_reward_sum.get(task, 0.0) + reward
        self.stats.reward_reasons[f"{task}/{reason}"] = self.stats.reward_reasons.get(f"{task}/{reason}", 0) + 1

    def _take_writable(self, partial: bool) -> list[tuple[list[list[Sample]], list[int]]]:
        """Take the shards to write now off the buffer, each as (its groups, the filtered
        groups before them): the finished groups at the head of the admission order, cut
        after every kept group that completes a batch (the groups in shards reach a multiple
        of B), so no shard straddles two of the trainer's steps. Whole batches are taken at
        once; the rest of the head only with ``partial``, when it holds ``shard_groups`` kept
        groups, or when it holds filtered groups alone (nothing to write but the index)."""
        assert self.written is not None
        batch = self.settings.batch_groups
        kept = self.written.in_shards
        pieces: list[list[int]] = []
        piece: list[int] = []
        for index in self._order:
            if index not in self._done:
                break  # the head of the line is still generating
            piece.append(index)
            if self._done[index] is None:
                continue  # filtered: in no shard
            kept += 1
            if kept % batch == 0:
                pieces.append(piece)
                piece = []
        piece_kept = sum(1 for k in piece if self._done[k] is not None)
        if piece and (partial or piece_kept == 0 or piece_kept >= self.settings.shard_groups):
            pieces.append(piece)
        for _ in range(sum(len(p) for p in pieces)):
            self._order.popleft()
        taken = []
        for p in pieces:
            groups = [self._done.pop(k) for k in p]
            for k in p:
                self._done_at.pop(k, None)
            taken.append(([g for g in groups if g is not None], [k for k, g in zip(p, groups) if g is None]))
        return taken

    async def _flush(self, partial: bool = False) -> None:
        """Write the finished groups whose turn has come (:meth:`_take_writable`), one shard per
        piece (groups are never split).

        Pieces are taken inside the write lock, so shards are published in admission order
        (the write runs in a thread, so the event loop keeps streaming tokens); if a write
        fails the controller fails and a restart regenerates its groups, since no shard holds
        them. Each write is followed by saving the written-groups index (see
        :func:`load_written_groups`): three PUTs per shard (claim, shard, index). The
        trainer's doorbell is rung as soon as a shard is published."""
        async with self._write_lock:
            written = self.written
            if written is None:
                return
            for groups, filtered in self._take_writable(partial):
                written.add(filtered)  # their records are durable (written when they were filtered)
                written.filtered += len(filtered)
                if groups:
                    shard = await asyncio.to_thread(self.writer.write_groups, groups)
                    self.stats.groups_written += len(groups)
                    self.stats.shards_written += 1
                    self.stats.written_tokens += sum(s.model_token_count for g in groups for s in g)
                    written.add({group_index(group[0].group_id) for group in groups})
                    written.next_seq = max(written.next_seq, shard.seq + 1)
                    await asyncio.to_thread(self._shards_bell.ring)  # the trainer looks at once
                    LOG.info("wrote %s (%d groups)", shard.name, len(groups))
                await asyncio.to_thread(save_written_groups, self.root, written)

    async def _flush_periodically(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await _wait(stop, min(1.0, self.settings.shard_seconds))
            oldest = min(self._done_at.values(), default=None)
            if oldest is not None and time.monotonic() - oldest >= self.settings.shard_seconds:
                await self._flush(partial=True)

    async def _watch_weights(self, stop: asyncio.Event) -> None:
        """Push each newly published version to every server (fetch it onto their host
        where :attr:`weight_prefetch` can, then pause, load, resume), as soon as the trainer
        rings the weights doorbell (``weight_poll_seconds`` is the fallback)."""
        while not stop.is_set():
            latest = await asyncio.to_thread(self.weights.latest)
            if latest is not None:
                # Its update count (lineage; cached per version), read off the event loop: the
                # gate asks for it next.
                await asyncio.to_thread(self.version_updates, latest)
            if latest is not None and latest > self.generator.current_version:
                if self.weight_prefetch is not None:  # generation goes on meanwhile
                    await asyncio.to_thread(self.weight_prefetch, latest)
                stats = await self.generator.update_weights(latest, self.weight_loader(latest))
                self._version_changed.set()
                # after the wake-up: the lineage read must not hold up admission; a bound it
                # lowers applies from the next admission (every one is within eta regardless)
                await self._read_drift(latest)
                self.stats.updates.append(stats)
                LOG.info("rollout now on weight version %d (stall %.2fs)", latest, stats.stall_s)
                continue  # a version published during the update is loaded at once
            if stop.is_set():
                break
            if self._weights_listener is None:
                await _wait(stop, self.settings.weight_poll_seconds)
            else:
                await _first_of(stop.wait(), self._weights_listener.wait_async(self.settings.weight_poll_seconds))


class _GeneratorUpdates:
    """The gate's i: the training steps received by the weights the rollout servers generate
    with (that version, not the newest published one, so a sample's first token is never
    older than the gate assumed), read from the version's lineage
    (:func:`asyncrl.storage.weight_lineage.lineage_updates`).

    Steps, not the version label, because the trainer measures staleness in steps: after a
    trainer restart from checkpoint step s, the killed trainer's labels up to k stay
    published and the resumed trainer's label k + j holds s + j steps. Admitting against
    the label would admit (k - s) * B groups that the resumed trainer reaches only more
    than eta steps after their first token; against steps the gate waits instead until the
    resumed trainer has caught up with what was already admitted. Without a rollback the
    two are the same count. What a rollback cannot undo: groups admitted before it whose
    tokens the resumed trainer's weights (fewer steps) sample, because they were in flight
    or are generated again after a scheduler restart, may lag more than eta steps when
    they are trained; the trainer then drops them by its rule."""

    def __init__(self, generator: GroupGenerator, updates: Callable[[int], int]) -> None:
        self._generator = generator
        self._updates = updates

    def current_version(self) -> int:
        return self._updates(self._generator.current_version)


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except TimeoutError:
        pass


async def _first_of(*waits: Coroutine[Any, Any, object]) -> None:
    """Return when the first of ``waits`` returns; the others are cancelled."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_either(stop: asyncio.Event, event: asyncio.Event, seconds: float) -> None:
    """Wait until ``stop`` or ``event`` is set, at most ``seconds``."""
    try:
        await asyncio.wait_for(_first_of(stop.wait(), event.wait()), timeout=seconds)
    except TimeoutError:
        pass
