"""``asyncrl chaos CONFIG [KEY=VALUE ...] --kills N --seed S``: the run with every kind of
component SIGKILLed N times and restarted, then the audit of its run root (see
:mod:`asyncrl.chaos.run`). Prints the kills and restarts and the audit; the report is
also written to ``chaos.json`` in the run root. Exit status 0 when the run finished, every
planned kill fired (unless ``--allow-unfired``) and the audit is clean (no sample dropped as
too stale included), 1 otherwise. Heavy modules are imported only when the command runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncrl.chaos.run import ChaosReport


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_report(report: ChaosReport) -> str:
    """The kills table, restarts per kind, the run's end and the audit's verdict."""
    lines = [
        "| # | component | killed at (s) | step | version | process group | all up (s) | next version (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for index, kill in enumerate(report.kills, start=1):
        lines.append(
            f"| {index} | {kill.component} | {kill.at_s:.1f} | {kill.step} | {kill.version} | {kill.pgid} "
            f"| {_seconds(kill.up_at_s)} | {_seconds(kill.recovered_at_s)} |"
        )
    restarts = ", ".join(f"{kind} {count}" for kind, count in report.restarts().items())
    lines.append(f"restarts: {restarts} (planned: {report.kills_planned} kills, fired: {report.kills_fired})")
    if report.unfired:
        lines.append(f"unfired kills (kind@step): {', '.join(report.unfired)}")
    lines.append(
        f"run {report.run}: {report.steps} steps, final weight version {report.final_version}, "
        f"wall {report.wall_s:.0f} s"
    )
    audit = report.audit
    lines.append(
        f"audit: {audit.admitted} groups admitted, {audit.groups_written} written, {len(audit.unwritten_groups)} unwritten; "
        f"{audit.shards} shards, {audit.consumed_shards} consumed by {audit.ledger_steps} steps; "
        f"{len(audit.versions)} weight versions; {audit.trained_samples} samples trained, staleness counts "
        f"{audit.staleness_counts} (bound {audit.max_staleness}), {audit.dropped_stale} dropped as too stale "
        f"(trainer's record {audit.trainer_dropped_stale}; admission records {audit.admission_dropped_stale}, "
        f"{audit.unrecorded_admissions} trained groups without one)"
    )
    lines.append(
        f"tokens: {report.tokens_received} received by the schedulers, {report.tokens_regenerated} of them lost to "
        f"kills and generated again (bound {report.tokens_regenerated_bound}: {report.tokens_regenerated_bound_per_kind})"
    )
    for problem in [*report.problems, *audit.violations]:
        lines.append(f"  VIOLATION {problem}")
    lines.append("result: OK" if report.ok else f"result: FAILED ({len(report.problems) + len(audit.violations)} problems)")
    lines.append(f"report: {report.root.rstrip('/')}/chaos.json")
    return "\n".join(lines)


def cmd_chaos(args: argparse.Namespace) -> int:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from asyncrl.configs.loading import load_config
    from asyncrl.chaos.run import ChaosError, ChaosSettings, run_chaos

    config = load_config(args.config, args.overrides)
    settings = ChaosSettings(max_delay_s=args.max_delay, timeout_s=args.timeout, allow_unfired=args.allow_unfired)
    try:
        report = run_chaos(config, args.kills, args.seed, settings, progress=lambda line: print(line, flush=True))
    except ChaosError as exc:
        print(f"asyncrl chaos: the run failed: {exc}", file=sys.stderr)
        return 1
    print(format_report(report))
    return 0 if report.ok else 1


def add_chaos_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Register ``chaos`` on the top-level commands."""
    parser = commands.add_parser(
        "chaos", help="run with the trainer, a rollout server and the scheduler SIGKILLed and restarted; audit the run root"
    )
    parser.add_argument("config", help="YAML run config; use a fresh storage.root")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides such as trainer.max_steps=12")
    parser.add_argument("--kills", type=int, default=2, help="SIGKILLs of each kind of component (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill plan and the kill moments")
    parser.add_argument("--max-delay", type=float, default=5.0, help="a kill fires within this many seconds once armed")
    parser.add_argument(
        "--allow-unfired", action="store_true", help="accept a run that finished before every planned kill fired"
    )
    parser.add_argument("--timeout", type=float, default=3600.0, help="give up after this many seconds")
    parser.set_defaults(handler=cmd_chaos)
    return parser
