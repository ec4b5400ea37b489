"""Chaos run: the asynchronous RL run under the same supervisors as the `train` flow
(:mod:`asyncrl.tasks.launch.rl`), plus a seeded kill plan, then an audit of the run root
(:mod:`asyncrl.tasks.launch.audit`).

Each kind of component (trainer, rollout server, scheduler, reward service) is SIGKILLed
K times at random moments; the next kill is armed only once every component is up again
and the run has progressed, and no kill fires once the last step's weights are out. The
supervisors restart each victim, which resumes from storage. The run ends when the trainer
finishes; the scheduler drains, and the audit counts in-flight groups as violations, so a
clean report shows exactly-once and the staleness bound survive the kills. The report goes
to ``chaos.json`` in the run root. Kill schedule in detail: ``docs/internals/chaos.md``.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from asyncrl.configs.run_config import RunConfig
from asyncrl.storage import fs, paths
from asyncrl.storage.ledger import Ledger
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.launch.audit import AuditReport, audit_run
from asyncrl.tasks.launch.components import sigkill_group
from asyncrl.tasks.launch.context import prepare_run
from asyncrl.tasks.system.run_paths import RunPaths
from asyncrl.tasks.launch.rl import RLRunSettings, run_rl, thread_runner
from asyncrl.tasks.launch.stages import prepare_inputs
from asyncrl.tasks.launch.supervisor import ComponentFailed, ComponentStatus, RestartPolicy
from asyncrl.tasks.scheduler.main import final_step_published

CHAOS_REPORT = "chaos.json"
KINDS = ("trainer", "rollout", "scheduler", "reward")
SUPERVISOR_POLL_S = 0.25


class ChaosError(RuntimeError):
    """The chaos run could not finish: a component failed on its own, or a deadline passed."""


@dataclass(frozen=True)
class ChaosSettings:
    """Kill schedule and deadlines of :func:`run_chaos`."""

    max_delay_s: float = 5.0
    """A kill fires uniformly within this many seconds after it is armed."""
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
    """Last step in the ledger when it was killed."""
    version: int
    """Newest published weight version when it was killed."""
    restarted_at_s: float
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
        return out


def _kind(component: str) -> str:
    """The kill-plan kind of a component name (rollout-server-1 -> rollout)."""
    return {"reward-service": "reward"}.get(component, component.split("-")[0])


def kill_plan(rng: random.Random, kills_per_component: int) -> list[str]:
    """K of each kind in ``KINDS``, shuffled by ``rng``."""
    if isinstance(kills_per_component, bool) or not isinstance(kills_per_component, int) or kills_per_component < 0:
        raise ValueError(f"kills_per_component must be an int >= 0, got {kills_per_component!r}")
    plan = [kind for kind in KINDS for _ in range(kills_per_component)]
    rng.shuffle(plan)
    return plan


class KillPlan:
    """The kill schedule (see the module docstring) as the ``tick`` of :func:`run_rl`: called
    each poll with the components' statuses; the supervisors do the restarts."""

    def __init__(
        self, config: RunConfig, run_paths: RunPaths, plan: list[str], rng: random.Random, settings: ChaosSettings,
        say: Callable[[str], None],
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
        self.progress_mark = 0  # the next kill waits for a version above this one
        self.announced = False

    def now(self) -> float:
        return time.monotonic() - self.started

    def latest(self) -> int:
        return -1 if (v := self.store.latest()) is None else v

    def __call__(self, statuses: dict[str, ComponentStatus]) -> None:
        """Note recoveries; arm the next kill when everything is up and the run progressed;
        fire it when due."""
        latest = self.latest()
        up = all(s.ready for s in statuses.values())
        if up and not self.announced:
            self.announced = True
            self.say(f"{self.now():7.1f} s  all components up; kill plan: {', '.join(self.plan) or 'none'}")
        for record in self.kills:
            if up and record.up_at_s is None and self.now() > record.at_s + 2 * SUPERVISOR_POLL_S:
                record.up_at_s = self.now()
            if latest > record.version and record.recovered_at_s is None:
                record.recovered_at_s = self.now()
        if not self.plan or statuses["trainer"].state == "finished":
            return
        if final_step_published(self.paths.root, self.config.trainer.max_steps):
            return
        if self.fire_at is None:
            if up and latest > self.progress_mark:
                self.fire_at = time.monotonic() + self.rng.uniform(0.0, self.settings.max_delay_s)
            return
        if time.monotonic() >= self.fire_at:
            self.fire_at = None
            self.kill(self.plan.pop(0), statuses)

    def kill(self, kind: str, statuses: dict[str, ComponentStatus]) -> None:
        servers = sorted(name for name in statuses if name.startswith("rollout-server"))
        name = {"trainer": "trainer", "scheduler": "scheduler", "reward": "reward-service"}.get(kind) or self.rng.choice(
            servers
        )
        status = statuses[name]
        version, step = self.latest(), self.ledger.last_step() or 0
        at = self.now()
        sigkill_group(status.pgid)
        self.progress_mark = version
        self.kills.append(KillRecord(name, status.pgid, at, step, version, restarted_at_s=at))
        self.say(f"{at:7.1f} s  SIGKILL {name} (process group {status.pgid}) at step {step}, version {version}; "
                 "its supervisor restarts it")  # fmt: skip


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
    plan = kill_plan(rng, kills_per_component)
    prepare_inputs(config)  # the tiny model and synthetic task, where the config asks for them
    run_paths = prepare_run(config)
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
    if kill_plan_tick.plan:
        problems.append(
            f"{len(kill_plan_tick.plan)} planned kills were not done ({', '.join(kill_plan_tick.plan)}): the run "
            "finished first; raise trainer.max_steps"
        )
    audit = audit_run(run_paths.root, config.name, config.max_staleness, in_flight_ok=False)
    steps = Ledger(run_paths.root).last_step() or 0
    if steps != config.trainer.max_steps:
        problems.append(f"the ledger ends at step {steps}, not trainer.max_steps = {config.trainer.max_steps}")
    report = ChaosReport(
        run=config.name,
        root=run_paths.root.uri,
        seed=seed,
        kills_per_component=kills_per_component,
        planned=plan,
        kills=kill_plan_tick.kills,
        wall_s=kill_plan_tick.now(),
        steps=steps,
        final_version=WeightStore(run_paths.root).latest(),
        audit=audit,
        problems=problems,
        supervisor_restarts=result.restarts,
    )
    fs.put_atomic_replace(run_paths.root, paths.join(CHAOS_REPORT), json.dumps(report.to_json(), indent=1).encode())
    return report
