"""Chaos run: the whole asynchronous RL run as separate process groups (rollout servers,
trainer, scheduler), with each kind SIGKILLed K times at random moments and restarted,
then an audit of the run root (:mod:`asyncrl.storage.audit`).

Kill schedule (seeded: the same seed gives the same plan and delays):

- the plan is K x ``trainer``, K x ``rollout`` (a random server each time), K x
  ``scheduler``, shuffled;
- the next kill is armed once every component is up again (processes running, servers
  registered) and the run has progressed since the last kill: a weight version newer
  than the one published at that kill (at first: a version >= 1, one RL step done);
- it then fires after a delay drawn uniformly from [0, ``max_delay_s``], so kills land
  in generation, training, publishing, checkpointing or weight updates alike;
- the victim's whole process group gets SIGKILL and it is restarted at once: the trainer
  resumes from its newest complete checkpoint (ledger entries after it are rolled back),
  a rollout server starts on the newest published weights and registers again (the
  scheduler starts a new cycle on the new set of servers, see
  :mod:`asyncrl.flows.scheduler_main`), the scheduler resumes from its state;
- no kill fires once the weights of the last step are published.

The run ends when the trainer exits 0 after ``trainer.max_steps``; the scheduler then
drains (finishes and writes every admitted group) and exits, the servers are stopped, and
the run root is audited with in-flight groups counted as violations. Every process group
is killed in a ``finally``. The report goes to ``chaos.json`` in the run root.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from asyncrl.configs.run_config import RunConfig
from asyncrl.flows.chaos_components import (
    Component,
    RolloutComponent,
    log_tail,
    scheduler_component,
    trainer_component,
)
from asyncrl.flows.run_components import rl_trainer_launch
from asyncrl.flows.run_setup import RunPaths, prepare_run
from asyncrl.flows.scheduler_main import final_step_published
from asyncrl.storage import fs, paths
from asyncrl.storage.audit import AuditReport, audit_run
from asyncrl.storage.ledger import Ledger
from asyncrl.storage.weights import WeightStore

CHAOS_REPORT = "chaos.json"
KINDS = ("trainer", "rollout", "scheduler")


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

    @property
    def ok(self) -> bool:
        return self.audit.ok and not self.problems

    def restarts(self) -> dict[str, int]:
        """Restarts per kind (every kill is followed by one restart)."""
        return {kind: sum(1 for k in self.kills if k.component.split("-")[0] == kind) for kind in KINDS}

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["audit"] = self.audit.to_json()
        out["ok"] = self.ok
        out["restarts"] = self.restarts()
        return out


def kill_plan(rng: random.Random, kills_per_component: int) -> list[str]:
    """K of each kind in ``KINDS``, shuffled by ``rng``."""
    if isinstance(kills_per_component, bool) or not isinstance(kills_per_component, int) or kills_per_component < 0:
        raise ValueError(f"kills_per_component must be an int >= 0, got {kills_per_component!r}")
    plan = [kind for kind in KINDS for _ in range(kills_per_component)]
    rng.shuffle(plan)
    return plan


class ChaosRun:
    """The components of one run, the kill schedule and its records (see the module docstring)."""

    def __init__(
        self, config: RunConfig, paths: RunPaths, plan: list[str], rng: random.Random, settings: ChaosSettings,
        say: Callable[[str], None],
    ) -> None:  # fmt: skip
        self.config = config
        self.paths = paths
        self.plan = list(plan)
        self.rng = rng
        self.settings = settings
        self.say = say
        self.started = time.monotonic()
        self.store = WeightStore(paths.root)
        self.ledger = Ledger(paths.root)
        self.trainer = trainer_component(rl_trainer_launch(config, paths))
        self.scheduler = scheduler_component(paths.private_config, paths.log("scheduler.log"))
        self.servers = [RolloutComponent(i, config, paths) for i in range(config.rollout.num_servers)]
        self.kills: list[KillRecord] = []
        self.fire_at: float | None = None
        self.progress_mark = 0  # the next kill waits for a version above this one

    def now(self) -> float:
        return time.monotonic() - self.started

    def components(self) -> list[Component]:
        return [*self.servers, self.trainer, self.scheduler]

    def latest(self) -> int:
        return -1 if (v := self.store.latest()) is None else v

    # ----- the run -----

    def run(self) -> None:
        """Start, kill and restart until the trainer has finished and the scheduler drained."""
        for server in self.servers:
            server.start()
        self.trainer.start()
        self.wait_up([*self.servers, self.trainer])
        self.scheduler.start()
        self.say(f"{self.now():7.1f} s  all components up; kill plan: {', '.join(self.plan) or 'none'}")
        deadline = self.started + self.settings.timeout_s
        while self.trainer.poll() != 0:
            self.check_components()
            self.schedule_kill()
            if time.monotonic() > deadline:
                raise ChaosError(f"the run did not finish within {self.settings.timeout_s:.0f} s")
            time.sleep(self.settings.poll_s)
        self.say(f"{self.now():7.1f} s  trainer finished; waiting for the scheduler to drain")
        self.wait_drained()

    def wait_up(self, components: list[Component]) -> None:
        deadline = time.monotonic() + self.settings.start_timeout_s
        while not all(c.ready() for c in components):
            for component in components:
                if component.poll() is not None:
                    raise ChaosError(
                        f"{component.name} exited with status {component.poll()} while starting\n"
                        f"--- log ---\n{log_tail(component)}"
                    )
            if time.monotonic() > deadline:
                down = [c.name for c in components if not c.ready()]
                raise ChaosError(f"{', '.join(down)} not up within {self.settings.start_timeout_s:.0f} s of the start")
            time.sleep(self.settings.poll_s)

    def check_components(self) -> None:
        """Raise :class:`ChaosError` (with its log tail) for a component that exited on its own.
        The trainer's 0 is its end; the scheduler's 0 is its end once the last step is out."""
        for component in self.components():
            code = component.poll()
            if code is None or (code == 0 and component is self.trainer):
                continue
            if code == 0 and component is self.scheduler and final_step_published(
                self.paths.root, self.config.trainer.max_steps
            ):
                continue
            raise ChaosError(f"{component.name} exited with status {code} on its own\n--- log ---\n{log_tail(component)}")

    def schedule_kill(self) -> None:
        """Arm the next kill when everything is up and the run progressed; fire it when due."""
        latest = self.latest()
        up = all(c.ready() for c in self.components())
        for record in self.kills:
            if up and record.up_at_s is None:
                record.up_at_s = self.now()
            if record.up_at_s is None and self.now() - record.restarted_at_s > self.settings.start_timeout_s:
                down = ", ".join(c.name for c in self.components() if not c.ready())
                raise ChaosError(
                    f"{down} not up within {self.settings.start_timeout_s:.0f} s of the restart of {record.component}"
                )
            if latest > record.version and record.recovered_at_s is None:
                record.recovered_at_s = self.now()
        if not self.plan or self.trainer.poll() is not None:
            return
        if final_step_published(self.paths.root, self.config.trainer.max_steps):
            return
        if self.fire_at is None:
            if up and latest > self.progress_mark:
                self.fire_at = time.monotonic() + self.rng.uniform(0.0, self.settings.max_delay_s)
            return
        if time.monotonic() >= self.fire_at:
            self.fire_at = None
            self.kill_and_restart(self.plan.pop(0))

    def kill_and_restart(self, kind: str) -> None:
        victim: Component = {"trainer": self.trainer, "scheduler": self.scheduler}.get(kind) or self.rng.choice(
            self.servers
        )
        version, step = self.latest(), self.ledger.last_step() or 0
        pgid = victim.pgid()
        at = self.now()
        victim.kill()
        victim.start()
        self.progress_mark = version
        self.kills.append(KillRecord(victim.name, pgid, at, step, version, restarted_at_s=self.now()))
        self.say(f"{at:7.1f} s  SIGKILL {victim.name} (process group {pgid}) at step {step}, version {version}; restarted")

    def wait_drained(self) -> None:
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while self.scheduler.poll() is None:
            for server in self.servers:  # a restarting server must come up: the drain needs it
                server.ready()
            if time.monotonic() > deadline:
                raise ChaosError(
                    f"the scheduler did not drain within {self.settings.drain_timeout_s:.0f} s after the trainer "
                    f"finished\n--- log ---\n{log_tail(self.scheduler)}"
                )
            time.sleep(self.settings.poll_s)
        self.check_components()
        self.say(f"{self.now():7.1f} s  scheduler drained and exited")

    def stop_all(self) -> list[str]:
        """Stop every component (scheduler first, so that it never sees its servers vanish);
        return what failed to stop (each one is tried)."""
        errors = []
        for component in (self.scheduler, *self.servers, self.trainer):
            try:
                component.stop()
            except Exception as exc:  # noqa: BLE001 - every component must still be stopped
                errors.append(f"{component.name}: {exc!r}")
        return errors


def run_chaos(
    config: RunConfig,
    kills_per_component: int,
    seed: int,
    settings: ChaosSettings | None = None,
    progress: Callable[[str], None] | None = None,
) -> ChaosReport:
    """Run ``config`` to ``trainer.max_steps`` with every kind of component SIGKILLed
    ``kills_per_component`` times (see the module docstring); audit the run root, write the
    report to ``chaos.json`` there, and return it. Raises :class:`ChaosError` if the run
    cannot finish."""
    settings = settings or ChaosSettings()
    say = progress or (lambda line: None)
    rng = random.Random(seed)
    plan = kill_plan(rng, kills_per_component)
    run_paths = prepare_run(config)
    chaos = ChaosRun(config, run_paths, plan, rng, settings, say)
    try:
        chaos.run()
    finally:
        stop_errors = chaos.stop_all()  # a failure of the run itself propagates first
    if stop_errors:
        raise ChaosError(f"stopping components failed: {'; '.join(stop_errors)}")
    problems = []
    if chaos.plan:
        problems.append(
            f"{len(chaos.plan)} planned kills were not done ({', '.join(chaos.plan)}): the run finished first; "
            "raise trainer.max_steps"
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
        kills=chaos.kills,
        wall_s=chaos.now(),
        steps=steps,
        final_version=WeightStore(run_paths.root).latest(),
        audit=audit,
        problems=problems,
    )
    fs.put_atomic_replace(run_paths.root, paths.join(CHAOS_REPORT), json.dumps(report.to_json(), indent=1).encode())
    return report
