"""A rehearsal of recurring training on the real stack (docs/recurring.md): a Prefect server, a
process worker, the deployments of prefect.yaml and an MLflow server. It starts a worker on the
`asyncrl-process` pool, deploys, then runs, each through its deployment as a user or a schedule
would, and waits for each to finish:

1. `pipeline`: the first run (the demo's task, a short RL phase); it registers version 1 as `best`;
2. three `train-nightly` runs, each created with the date its schedule would give it
   (``scheduled_time``), each after a new prompt file lands in the data folder:
   - night 1 continues from `best` with the demo's settings: it should be promoted;
   - night 2 uses a learning rate that breaks the model: it must be rejected, `best` unchanged;
   - night 3 trains on its new file plus ``--replay-fraction`` of the earlier ones;
3. `rollback`: `best` goes back to the version the last promotion replaced.

    infra/local-stack.sh start          # Prefect on :4200, MLflow on :5000
    PREFECT_API_URL=http://127.0.0.1:4200/api .venv/bin/python infra/nightly_rehearsal.py --work runs/rehearsal

Prints one line per run and writes ``<work>/rehearsal.json`` (states, messages, registry).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
POOL = "asyncrl-process"
NIGHTS = tuple(dt.date.today() - dt.timedelta(days=back) for back in (3, 2, 1))
"""The last three nights: a run scheduled in the past starts at once, as a late one would."""
BREAKING_LR = 1.0
"""One step at the largest rate the config allows ruins the tiny model (night 2)."""


def prefect(*args: str) -> subprocess.CompletedProcess[str]:
    """One ``prefect`` CLI command from the repository root (where prefect.yaml is)."""
    env = {**os.environ, "ASYNCRL_HOME": str(REPO)}
    return subprocess.run([str(Path(sys.executable).parent / "prefect"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL)  # fmt: skip


def deploy() -> None:
    """The work pool (if absent) and every deployment of prefect.yaml."""
    if prefect("work-pool", "inspect", POOL).returncode != 0:
        created = prefect("work-pool", "create", POOL, "--type", "process")
        if created.returncode != 0:
            raise SystemExit(f"prefect work-pool create failed:\n{created.stdout}{created.stderr}")
    done = prefect("deploy", "--all")
    if done.returncode != 0:
        raise SystemExit(f"prefect deploy --all failed:\n{done.stdout}{done.stderr}")


def run_config(args: argparse.Namespace, overrides: list[str]) -> dict[str, Any]:
    """configs/demo.yaml with the rehearsal's paths, MLflow server and model name, plus ``overrides``."""
    from asyncrl.configs.loading import load_config

    work = args.work.resolve()
    base = [
        "name=rehearsal", f"work_dir={work / 'work'}", f"model.path={work / 'model'}",
        f"data.train_path={work / 'data' / 'train.parquet'}", f"data.eval_path={work / 'data' / 'heldout.parquet'}",
        f"data.sft_path={work / 'data' / 'sft.parquet'}", f"storage.root={work / 'store' / 'rehearsal'}",
        f"tracking.mlflow_uri={args.mlflow_uri}", "tracking.experiment=asyncrl-rehearsal",
        f"pipeline.registered_model={args.model}", f"inference.base_port={args.base_port}",
    ]  # fmt: skip
    return load_config(REPO / "configs" / "demo.yaml", base + overrides).model_dump(mode="json")


def night_config(args: argparse.Namespace, overrides: list[str]) -> dict[str, Any]:
    """A night's config: the data folder instead of the first run's file, no synthetic data."""
    config = run_config(args, [f"trainer.max_steps={args.night_steps}", f"data.replay_fraction={args.replay_fraction}", *overrides])
    config["data"]["train_path"] = str(args.work.resolve() / "prompts") + "/"
    config["pipeline"]["synthetic_data"] = None
    return config


def land_new_file(args: argparse.Namespace, night: dt.date, index: int) -> Path:
    """Tonight's prompt file: one third of the first run's RL prompts (never held out), as Parquet."""
    import pyarrow.parquet as pq

    table = pq.read_table(args.work / "data" / "train.parquet")
    share = table.num_rows // len(NIGHTS)
    path = args.work / "prompts" / f"{night.isoformat()}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table.slice(index * share, share), path)
    return path


def run(name: str, parameters: dict[str, Any], scheduled: dt.datetime | None = None) -> dict[str, Any]:
    """Start deployment ``name`` (optionally as scheduled for ``scheduled``) and wait for its end."""
    from prefect.deployments import run_deployment

    started = time.monotonic()
    flow_run = run_deployment(name, parameters=parameters, scheduled_time=scheduled, timeout=None)
    state = flow_run.state
    record = {"deployment": name, "flow_run": str(flow_run.id), "flow_run_name": flow_run.name,
              "scheduled": scheduled.isoformat() if scheduled else None, "state": state.name if state else None,
              "message": state.message if state else None, "wall_s": round(time.monotonic() - started, 1)}  # fmt: skip
    print(f"{name} {record['scheduled'] or ''} -> {record['state']} in {record['wall_s']} s: {record['message']}", flush=True)
    return record


def registered_best(args: argparse.Namespace) -> str | None:
    """The version number of ``models:/<model>@best``, None if there is none yet."""
    from asyncrl.tasks.tracking.promotion_registry import aliased_version

    found = aliased_version(args.mlflow_uri, args.model, "best")
    return None if found is None else found.number


def registry(args: argparse.Namespace) -> dict[str, Any]:
    """The registered model's versions (tags) and aliases."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=args.mlflow_uri, registry_uri=args.mlflow_uri)
    model = client.get_registered_model(args.model)
    versions = client.search_model_versions(f"name='{args.model}'")
    return {
        "aliases": dict(model.aliases),
        "versions": {v.version: {k: t for k, t in v.tags.items() if k.startswith("asyncrl.promotion")} for v in versions},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("runs/rehearsal"))
    parser.add_argument("--mlflow-uri", default="http://127.0.0.1:5000")
    parser.add_argument("--model", default="asyncrl-rehearsal-policy")
    parser.add_argument("--first-steps", type=int, default=5, help="RL steps of the first run")
    parser.add_argument("--night-steps", type=int, default=30, help="RL steps of each night")
    parser.add_argument("--replay-fraction", type=float, default=0.25)
    parser.add_argument("--base-port", type=int, default=8700)
    args = parser.parse_args()
    if not os.environ.get("PREFECT_API_URL"):
        raise SystemExit("set PREFECT_API_URL to the Prefect server (infra/local-stack.sh start prints it)")
    args.work.mkdir(parents=True, exist_ok=True)
    deploy()
    worker_log = (args.work / "worker.log").open("ab")
    env = {**os.environ, "ASYNCRL_HOME": str(REPO), "PREFECT_WORKER_QUERY_SECONDS": "2"}
    worker = subprocess.Popen([str(Path(sys.executable).parent / "prefect"), "worker", "start", "--pool", POOL,
                               "--name", "rehearsal"], cwd=REPO, env=env, stdout=worker_log,
                              stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    records = []
    try:
        if registered_best(args) is None:
            records.append(run("pipeline/pipeline", {"config": run_config(args, [f"trainer.max_steps={args.first_steps}"])}))
        else:  # a rehearsal run again: its first run registered the model already
            print(f"models:/{args.model}@best exists: the first run is not run again", flush=True)
        for index, night in enumerate(NIGHTS):
            land_new_file(args, night, index)
            overrides = [f"trainer.optimizer.lr={BREAKING_LR}", "trainer.max_steps=2"] if index == 1 else []
            scheduled = dt.datetime.combine(night, dt.time(2, 0), tzinfo=dt.UTC)
            records.append(run("train-nightly/train-nightly", {"config": night_config(args, overrides),
                                                               "registered_model": args.model}, scheduled))  # fmt: skip
            records[-1]["registry"] = registry(args)
            (args.work / "rehearsal.json").write_text(json.dumps(records, indent=2))
        records.append(run("rollback/rollback", {"config": run_config(args, []), "registered_model": args.model}))
        records[-1]["registry"] = registry(args)
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(60)
    out = args.work / "rehearsal.json"
    out.write_text(json.dumps(records, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
