"""Chaos run: the asynchronous RL run under the same supervisors as the `train` flow
(:mod:`asyncrl.tasks.launch.rl`), plus a seeded kill plan, then an audit of the run root
(:mod:`asyncrl.chaos.audit`).

Each kind of component (trainer, rollout server, scheduler, reward service) is SIGKILLed
K times. The kills are paced by training progress, not by the clock: the seeded plan
(:func:`kill_plan`) gives each kill a training step, spread over the first ~80% of
``trainer.max_steps`` (each kind's kills at distinct steps); a kill is armed once the
newest published weights are of that step or later, every component is up again and a
version newer than the previous kill's is out, and fires within ``max_delay_s`` seconds;
no kill fires once the last step's weights are out. A kill left unfired is a failure of
the run unless ``allow_unfired``. The supervisors restart each victim, which resumes from
storage. The run ends when the trainer finishes; the scheduler drains, and the audit counts
in-flight groups and every sample dropped as too stale as violations, so a clean report
shows exactly-once, the staleness bound and zero waste survive the kills. The report goes
to ``chaos.json`` in the run root. Kill schedule in detail: ``docs/failure-testing.md``.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from asyncrl.configs.run_config import RunConfig
from asyncrl.storage import fs, paths
from asyncrl.storage.ledger import Ledger
from asyncrl.storage.weight_lineage import read_lineage
from asyncrl.storage.weights import WeightStore
from asyncrl.chaos.audit import AuditReport, audit_run
from asyncrl.chaos.token_waste import regeneration_bound, token_waste
from asyncrl.tasks.scheduler.setup import DELIVERED_PREFIX
from asyncrl.tasks.system.durable_count import read_counts
from asyncrl.tasks.launch.components import sigkill_group
from asyncrl.tasks.launch.context import prepare_run
from asyncrl.tasks.system.run_paths import RunPaths
from asyncrl.tasks.launch.rl import RLRunSettings, run_rl, thread_runner
from asyncrl.tasks.pipeline.stages import prepare_inputs
from asyncrl.tasks.launch.supervisor import ComponentFailed, ComponentStatus, RestartPolicy

CHAOS_REPORT = "chaos.json"
KINDS = ("trainer", "rollout", "scheduler", "reward")
SUPERVISOR_POLL_S = 0.25
KILL_SPAN = 0.8
"""Kills are planned at steps 1..floor(KILL_SPAN * max_steps) (at least 1 below max_steps):
the rest of the run leaves room for the delay, the restarts and a trainer's rollback."""


class ChaosError(RuntimeError):
    """The chaos run could not finish: a component failed on its own, or a deadline passed."""


@dataclass(frozen=True)
class ChaosSettings:
    """Kill schedule and deadlines of :func:`run_chaos`."""

    max_delay_s: float = 5.0
    """A kill fires uniformly within this many seconds after it is armed."""
    allow_unfired: bool = False
    """Accept a run that finished before every planned kill fired (else it is a failure)."""
    start_timeout_s: float = 600.0
    """Deadline for every component to be up (first start and each restart)."""
    timeout_s: float = 3600.0
    """Deadline for the whole run."""
    drain_timeout_s: float = 300.0
    """Deadline for the scheduler to drain and exit after the trainer has finished."""
    poll_s: float = 0.5

    def __post_init__(self) -> None:
        if not self.max_delay_s >= 0:
            raise ValueError(f"ChaosSettings.max_delay_s must be >= 0, got {self.max_delay_s!r}")
        for name in ("start_timeout_s", "timeout_s", "drain_timeout_s", "poll_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ChaosSettings.{name} must be > 0, got {getattr(self, name)!r}")


@dataclass
class KillRecord:
    """One SIGKILL and the restart that followed (times in seconds since the run started)."""

    component: str
    pgid: int
    at_s: float
    step: int
    """The step of the newest published weights when it was killed."""
    version: int
    """Newest published weight version when it was killed."""
    restarted_at_s: float
    planned_step: int | None = None
    """The step the plan armed the kill at (it fired once the published weights reached it)."""
    up_at_s: float | None = None
    """When every component was up again (servers registered)."""
    recovered_at_s: float | None = None
    """When a weight version newer than ``version`` was published: the run went on."""


@dataclass
class ChaosReport:
    run: str
    root: str
    seed: int
    kills_per_component: int
    planned: list[str]
    """The kinds of the planned kills, in plan order."""
    kills: list[KillRecord]
    wall_s: float
    steps: int
    """Steps in the final ledger."""
    final_version: int | None
    audit: AuditReport
    problems: list[str] = field(default_factory=list)
    """Run-level failures besides the audit's (planned kills not done, no drain...)."""
    supervisor_restarts: dict[str, int] = field(default_factory=dict)
    """Restarts per component as its supervisor counted them."""
    planned_steps: list[int] = field(default_factory=list)
    """The step each planned kill was armed at (same order as ``planned``)."""
    unfired: list[str] = field(default_factory=list)
    """Planned kills that did not fire ("kind@step"): a problem unless allowed."""
    tokens_received: int = 0
    """Output tokens the run's scheduler processes received, kept or not (:mod:`asyncrl.chaos.token_waste`)."""
    tokens_regenerated: int = 0
    """Of those, the ones received and lost to a kill: generated again. Over the bound is a problem."""
    tokens_regenerated_bound: int = 0
    """What the kills fired may cost with the run's journal settings; per kind of kill below."""
    tokens_regenerated_bound_per_kind: dict[str, int] = field(default_factory=dict)

    @property
    def kills_planned(self) -> int:
        return len(self.planned)

    @property
    def kills_fired(self) -> int:
        return len(self.kills)

    @property
    def ok(self) -> bool:
        return self.audit.ok and not self.problems

    def restarts(self) -> dict[str, int]:
        """Restarts per kind (every kill is followed by one restart)."""
        return {kind: sum(1 for k in self.kills if _kind(k.component) == kind) for kind in KINDS}

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["audit"] = self.audit.to_json()
        out["ok"] = self.ok
        out["restarts"] = self.restarts()
        out["kills_planned"] = self.kills_planned
        out["kills_fired"] = self.kills_fired
        return out


def _kind(component: str) -> str:
    """The kill-plan kind of a component name (rollout-server-1 -> rollout)."""
    return {"reward-service": "reward"}.get(component, component.split("-")[0])


@dataclass(frozen=True)
class PlannedKill:
    """One kill of the plan: a kind of component, armed once the published weights reach ``step``."""

    kind: str
    step: int


def kill_steps_range(max_steps: int) -> tuple[int, int]:
    """The steps kills are planned at: 1..floor(KILL_SPAN * max_steps), below max_steps."""
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(f"max_steps must be an int >= 1, got {max_steps!r}")
    return 1, max(1, min(max_steps - 1, int(KILL_SPAN * max_steps)))


def kill_plan(rng: random.Random, kills_per_component: int, max_steps: int) -> list[PlannedKill]:
    """K of each kind in ``KINDS`` in an order shuffled by ``rng``, each given a training
    step: the range of :func:`kill_steps_range` cut into one slot per kill, the i-th kill at
    a seeded step of the i-th slot, so the steps ascend, spread over the run, and (given as
    many steps as kills) are all distinct. Fewer steps than kills: slots share steps, each
    kind's kills still at distinct steps (``ValueError`` if a kind has more kills than steps)."""
    if isinstance(kills_per_component, bool) or not isinstance(kills_per_component, int) or kills_per_component < 0:
        raise ValueError(f"kills_per_component must be an int >= 0, got {kills_per_component!r}")
    first, last = kill_steps_range(max_steps)
    span = last - first + 1
    if kills_per_component > span:
        raise ValueError(
            f"{kills_per_component} kills of each kind need as many distinct steps; trainer.max_steps = {max_steps} "
            f"gives steps {first}..{last}: raise trainer.max_steps"
        )
    kinds = [kind for kind in KINDS for _ in range(kills_per_component)]
    rng.shuffle(kinds)
    n = len(kinds)
    if n == 0:
        return []
    if n <= span:
        bounds = [first + (i * span) // n for i in range(n + 1)]
        steps = [rng.randrange(bounds[i], bounds[i + 1]) for i in range(n)]
    else:  # fewer steps than kills: the j-th kill of each kind at its own step, slots shared
        order = {kind: i for i, kind in enumerate(dict.fromkeys(kinds))}
        seen: dict[str, int] = {}
        pairs = []
        for kind in kinds:
            j = seen[kind] = seen.get(kind, -1) + 1
            pairs.append((first + (j * span) // kills_per_component, order[kind], kind))
        pairs.sort()
        steps, kinds = [step for step, _, _ in pairs], [kind for _, _, kind in pairs]
    return [PlannedKill(kind, step) for kind, step in zip(kinds, steps)]


class KillPlan:
    """The kill schedule (see the module docstring) as the ``tick`` of :func:`run_rl`: called
    each poll with the components' statuses; the supervisors do the restarts."""

    def __init__(
        self, config: RunConfig, run_paths: RunPaths, plan: list[PlannedKill], rng: random.Random,
        settings: ChaosSettings, say: Callable[[str], None],
    ) -> None:  # fmt: skip
        self.config = config
        self.paths = run_paths
        self.plan = list(plan)
        self.rng = rng
        self.settings = settings
        self.say = say
        self.started = time.monotonic()
        self.store = WeightStore(run_paths.root)
        self.ledger = Ledger(run_paths.root)
        self.kills: list[KillRecord] = []
        self.fire_at: float | None = None
        self.progress_mark = -1  # the next kill waits for a version above this one
        self.announced = False
        self._steps: dict[int, int] = {}  # version -> the step of its lineage (published, immutable)

    def now(self) -> float:
        return time.monotonic() - self.started

    def latest(self) -> int:
        return -1 if (v := self.store.latest()) is None else v

    def published_step(self, version: int) -> int:
        """The training step of the weights ``version`` (0 before any RL step)."""
        if version < 0:
            return 0
        if version not in self._steps:
            lineage = read_lineage(self.paths.root, version)
            step = None if lineage is None else lineage.get("step")
            if not isinstance(step, int) or isinstance(step, bool):
                return 0  # not complete yet, or no RL step: ask again next poll
            self._steps[version] = step
        return self._steps[version]

    def __call__(self, statuses: dict[str, ComponentStatus]) -> None:
        """Note recoveries; arm the next kill when the published weights reached its step,
        everything is up and the run progressed since the last kill; fire it when due."""
        latest = self.latest()
        up = all(s.ready for s in statuses.values())
        if up and not self.announced:
            self.announced = True
            shown = ", ".join(f"{k.kind}@{k.step}" for k in self.plan) or "none"
            self.say(f"{self.now():7.1f} s  all components up; kill plan (kind@step): {shown}")
        for record in self.kills:
            if up and record.up_at_s is None and self.now() > record.at_s + 2 * SUPERVISOR_POLL_S:
                record.up_at_s = self.now()
            if latest > record.version and record.recovered_at_s is None:
                record.recovered_at_s = self.now()
        if not self.plan or statuses["trainer"].state == "finished":
            return
        if self.published_step(latest) >= self.config.trainer.max_steps:
            return
        if self.fire_at is None:
            if up and latest > self.progress_mark and self.published_step(latest) >= self.plan[0].step:
                self.fire_at = time.monotonic() + self.rng.uniform(0.0, self.settings.max_delay_s)
            return
        if time.monotonic() >= self.fire_at:
            self.fire_at = None
            self.kill(self.plan.pop(0), statuses, latest)

    def kill(self, planned: PlannedKill, statuses: dict[str, ComponentStatus], latest: int) -> None:
        servers = sorted(name for name in statuses if name.startswith("rollout-server"))
        name = {"trainer": "trainer", "scheduler": "scheduler", "reward": "reward-service"}.get(
            planned.kind
        ) or self.rng.choice(servers)
        status = statuses[name]
        version, step = latest, self.published_step(latest)
        at = self.now()
        sigkill_group(status.pgid)
        self.progress_mark = version
        self.kills.append(KillRecord(name, status.pgid, at, step, version, restarted_at_s=at, planned_step=planned.step))
        self.say(f"{at:7.1f} s  SIGKILL {name} (process group {status.pgid}) at step {step} (planned at step "
                 f"{planned.step}), version {version}; its supervisor restarts it")  # fmt: skip


def run_chaos(
    config: RunConfig,
    kills_per_component: int,
    seed: int,
    settings: ChaosSettings | None = None,
    progress: Callable[[str], None] | None = None,
) -> ChaosReport:
    """Run ``config`` to ``trainer.max_steps`` under the run's own supervisors (the ones the
    `train` flow uses) with every kind of component SIGKILLed ``kills_per_component`` times
    (see the module docstring); audit the run root, write the report to ``chaos.json``
    there, and return it. Raises :class:`ChaosError` if the run cannot finish."""
    settings = settings or ChaosSettings()
    say = progress or (lambda line: None)
    rng = random.Random(seed)
    plan = kill_plan(rng, kills_per_component, config.trainer.max_steps)
    prepare_inputs(config)  # the tiny model and synthetic task, where the config asks for them
    run_paths = prepare_run(config)
    shutil.rmtree(run_paths.token_counts, ignore_errors=True)  # this run's schedulers' counts only
    kill_plan_tick = KillPlan(config, run_paths, plan, rng, settings, say)
    policy = RestartPolicy(
        max_restarts=kills_per_component + config.run.max_restarts, backoff_s=0.0,
        start_timeout_s=settings.start_timeout_s, poll_s=SUPERVISOR_POLL_S,
    )  # fmt: skip
    rl_settings = RLRunSettings(policy, drain=True, drain_timeout_s=settings.drain_timeout_s, poll_s=settings.poll_s)
    deadline = time.monotonic() + settings.timeout_s

    def tick(statuses: dict[str, ComponentStatus]) -> None:
        if time.monotonic() > deadline:
            raise ChaosError(f"the run did not finish within {settings.timeout_s:.0f} s")
        kill_plan_tick(statuses)

    try:
        result = run_rl(config, run_paths, rl_settings, thread_runner, tick=tick)
    except ComponentFailed as exc:
        raise ChaosError(str(exc)) from exc
    say(f"{kill_plan_tick.now():7.1f} s  trainer finished and the scheduler drained")
    problems = []
    unfired = [f"{k.kind}@{k.step}" for k in kill_plan_tick.plan]
    if unfired and not settings.allow_unfired:
        problems.append(
            f"{len(unfired)} of {len(plan)} planned kills did not fire ({', '.join(unfired)}): the run finished "
            "first; raise trainer.max_steps or lower --max-delay (or pass --allow-unfired)"
        )
    audit = audit_run(run_paths.root, config.name, config.max_staleness, in_flight_ok=False)
    steps = Ledger(run_paths.root).last_step() or 0
    if steps != config.trainer.max_steps:
        problems.append(f"the ledger ends at step {steps}, not trainer.max_steps = {config.trainer.max_steps}")
    rollout = config.rollout
    bound = regeneration_bound(
        [_kind(k.component) for k in kill_plan_tick.kills], rollout.eta, config.trainer.batch_groups,
        rollout.n_samples, rollout.max_new_tokens, rollout.journal_tokens,
    )  # fmt: skip
    waste = token_waste(
        read_counts(run_paths.token_counts, DELIVERED_PREFIX), audit.shard_tokens, audit.left_out_tokens, bound
    )
    problems += waste.problems()
    report = ChaosReport(
        run=config.name,
        root=run_paths.root.uri,
        seed=seed,
        kills_per_component=kills_per_component,
        planned=[k.kind for k in plan],
        kills=kill_plan_tick.kills,
        wall_s=kill_plan_tick.now(),
        steps=steps,
        final_version=WeightStore(run_paths.root).latest(),
        audit=audit,
        problems=problems,
        supervisor_restarts=result.restarts,
        planned_steps=[k.step for k in plan],
        unfired=unfired,
        tokens_received=waste.received,
        tokens_regenerated=waste.regenerated,
        tokens_regenerated_bound=waste.bound,
        tokens_regenerated_bound_per_kind=waste.bound_per_kind,
    )
    fs.put_atomic_replace(run_paths.root, paths.join(CHAOS_REPORT), json.dumps(report.to_json(), indent=1).encode())
    return report
