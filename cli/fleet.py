"""``asyncrl fleet list|add|drain CONFIG``: the rollout servers of a running run, one more
joining it, one leaving it (:mod:`asyncrl.tasks.launch.fleet`).

``add`` runs rollout server ``--index`` (past the run's own ``inference.num_servers``) as a run
of the ``component`` flow: here, until it is drained, or with ``--deployment`` as a run of that
deployment (``component/rollout-server``) on its work pool, returning at once. ``drain``
takes it out without losing a token and stops its flow run (Completed). Both name what is
wrong (an index of the run's own, a server already registered or not registered)."""

from __future__ import annotations

import argparse
import datetime
import os
from typing import Any


def _run_root(args: argparse.Namespace) -> tuple[Any, Any]:  # noqa: ANN401 - (RunConfig, RunRoot), imported late
    from asyncrl.configs.loading import load_config
    from asyncrl.flows.prefect_api.credentials import apply_storage_credentials
    from asyncrl.storage.fs import open_root

    config = load_config(args.config, args.overrides)
    apply_storage_credentials(config.storage)
    return config, open_root(config.storage.root, dict(config.storage.options))


def cmd_fleet_list(args: argparse.Namespace) -> int:
    from asyncrl.tasks.inference.server_registry import list_servers

    config, root = _run_root(args)
    records = list_servers(root)
    print(f"run {config.name}: {len(records)} rollout server(s) registered")
    for record in records:
        since = datetime.datetime.fromtimestamp(record.registered_at, datetime.timezone.utc).strftime("%H:%M:%S UTC")
        print(f"  {record.name}  {record.url}  pid {record.pid} on {record.hostname}, since {since}")
    return 0


def cmd_fleet_add(args: argparse.Namespace) -> int:
    from asyncrl.configs.loading import parameter_dict
    from asyncrl.storage.heartbeats import clear_stop_request
    from asyncrl.tasks.inference.server_registry import list_servers, server_name
    from asyncrl.tasks.launch.kinds import component_name

    config, root = _run_root(args)
    own = config.inference.num_servers
    if args.index < own:
        raise ValueError(
            f"--index {args.index}: rollout servers 0..{own - 1} are the run's own (inference.num_servers {own}); "
            f"add one at index {own} or above"
        )
    name = server_name(args.index)
    if name in {record.name for record in list_servers(root)}:
        raise ValueError(
            f"--index {args.index}: {name} is already registered in run {config.name} (`asyncrl fleet list`)"
        )
    clear_stop_request(root, component_name("rollout-server", args.index), 0)  # a drained earlier one's
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if args.deployment:
        from prefect.deployments import run_deployment

        parameters = {"config": parameter_dict(config), "kind": "rollout-server", "index": args.index}
        flow_run = run_deployment(args.deployment, parameters=parameters, timeout=0)
        print(f"started flow run {flow_run.name} ({flow_run.id}) of {args.deployment}: {name} joins run "
              f"{config.name} once healthy; `asyncrl fleet drain` takes it out")  # fmt: skip
        return 0
    from asyncrl.flows.component import component

    print(f"{name} joins run {config.name} once healthy; `asyncrl fleet drain` (another shell) takes it out")
    result = component(config, "rollout-server", args.index)
    code = result["exit_code"]
    print(f"{name} stopped" + ("" if code is None else f" with exit status {code}"))
    return 0 if code in (None, 0) else 1


def cmd_fleet_drain(args: argparse.Namespace) -> int:
    from asyncrl.tasks.inference.server_registry import server_name
    from asyncrl.tasks.launch.fleet import drain_server

    config, root = _run_root(args)
    try:
        report = drain_server(root, args.index, config.inference.api_key_value(), timeout_s=args.timeout)
    except FileNotFoundError:
        name = server_name(args.index)
        raise ValueError(f"--index {args.index}: {name} is not registered in run {config.name}") from None
    state = "idle" if report.idle else f"busy after {args.timeout:.0f} s (its requests were cut and resumed elsewhere)"
    print(f"{report.server} ({report.url}) left run {config.name}: {state} after {report.waited_s:.1f} s; "
          "its flow run was asked to stop")  # fmt: skip
    return 0


def add_fleet_commands(commands: Any, add_debug_flag: Any) -> None:  # noqa: ANN401 - argparse's subparsers
    fleet = commands.add_parser("fleet", help="the rollout servers of a running run: list, add one, drain one")
    actions = fleet.add_subparsers(dest="fleet_command", required=True, metavar="ACTION")
    for action, help_text, handler in (
        ("list", "the servers registered in the run root", cmd_fleet_list),
        ("add", "start one more rollout server for the running run (here, or as a deployment run)", cmd_fleet_add),
        ("drain", "take a rollout server out of the running run without losing a token, then stop it", cmd_fleet_drain),
    ):
        parser = actions.add_parser(action, help=help_text)
        parser.add_argument("config", help="the run's YAML config (the one it was started with)")
        parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="the run's overrides, as given to it")
        if action != "list":
            parser.add_argument("--index", type=int, required=True, help="the server's index (port base_port + index)")
        if action == "add":
            parser.add_argument(
                "--deployment", default=None,
                help="run it as a flow run of this deployment (e.g. component/rollout-server) instead of here",
            )  # fmt: skip
        if action == "drain":
            parser.add_argument("--timeout", type=float, default=120.0, help="longest wait for its requests to end, s")
        parser.set_defaults(handler=handler)
        add_debug_flag(parser)
