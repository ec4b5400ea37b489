"""``asyncrl promote NAME VERSION`` and ``asyncrl rollback NAME``: move a registered model's
``best`` and ``current`` by hand, keeping the promotion history in the registry's tags
(:mod:`asyncrl.tasks.tracking.promotion_registry`). The same operations run from the Prefect
UI as the ``promote`` and ``rollback`` deployments."""

from __future__ import annotations

import argparse
import os
from typing import Any


def _store(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """(MLflow tracking URI, storage options): from ``--config`` (its tracking and storage
    sections), ``--mlflow-uri`` winning, else ``$MLFLOW_TRACKING_URI``."""
    options: dict[str, Any] = {}
    uri = args.mlflow_uri
    if args.config:
        from asyncrl.configs.loading import load_config

        config = load_config(args.config)
        uri, options = uri or config.tracking.mlflow_uri, dict(config.storage.options)
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise ValueError("name the MLflow store: --mlflow-uri URI, --config CONFIG or $MLFLOW_TRACKING_URI")
    return uri, options


def cmd_promote(args: argparse.Namespace) -> int:
    from asyncrl.tasks.tracking.promotion_registry import promote

    uri, options = _store(args)
    print(promote(uri, args.name, args.version, options))
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    from asyncrl.tasks.tracking.promotion_registry import rollback

    uri, options = _store(args)
    print(rollback(uri, args.name, options))
    return 0


def _store_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mlflow-uri", help="the MLflow tracking URI (default: the --config's, else $MLFLOW_TRACKING_URI)")
    parser.add_argument("--config", help="a run config: its MLflow URI and the storage options to check the weights with")


def add_registry_commands(commands: Any, add_debug_flag: Any) -> None:  # noqa: ANN401 - argparse's subparsers
    promote = commands.add_parser(
        "promote", help="make a registered version @best and @current by hand (refused if it or its weights are gone)"
    )
    promote.add_argument("name", help="registered model name")
    promote.add_argument("version", help="registered version number")
    _store_arguments(promote)
    promote.set_defaults(handler=cmd_promote)
    add_debug_flag(promote)

    rollback = commands.add_parser(
        "rollback", help="move @best and @current back to the version the promoted one replaced"
    )
    rollback.add_argument("name", help="registered model name")
    _store_arguments(rollback)
    rollback.set_defaults(handler=cmd_rollback)
    add_debug_flag(rollback)
