"""``asyncrl lineage`` (follow a weight version or a dataset through MLflow and the run root)
and ``asyncrl register`` (register any weight version so that it loads through MLflow).

Both open a run root by ``--root URI`` or by a run config (``--config CONFIG``,
which also gives the store options and the MLflow URI); the MLflow run is the one the run
root's ``tracking.json`` names, at its recorded URI unless ``--mlflow-uri`` is given.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any


def _run_store(args: argparse.Namespace) -> Any:  # noqa: ANN401 - a RunStore (imported lazily)
    from asyncrl.storage.fs import open_root
    from asyncrl.tasks.tracking.lineage_query import open_run_store

    if args.config:
        from asyncrl.configs.loading import load_config

        config = load_config(args.config)
        root = open_root(config.storage.root, config.storage.options)
        return open_run_store(root, args.mlflow_uri or config.tracking.mlflow_uri)
    if not args.root:
        raise ValueError("name the run: --root URI or --config CONFIG")
    return open_run_store(open_root(args.root), args.mlflow_uri)


def cmd_lineage(args: argparse.Namespace) -> int:
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one small manifest: no bar on stderr
    from asyncrl.tasks.tracking.lineage_query import dataset_lineage, version_lineage

    if (args.version is None) == (args.dataset is None):
        raise ValueError("give a VERSION (weight version, models:/NAME/N or models:/NAME@ALIAS) or --dataset FILE, not both")
    if args.dataset is not None:
        uri = args.mlflow_uri or _run_store(args).lineage.tracking_uri
        lines = dataset_lineage(uri, args.dataset)
    elif args.version.startswith("models:/") and not (args.root or args.config):
        from asyncrl.tasks.tracking.lineage_query import model_history

        uri = args.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            raise ValueError(f"{args.version}: name the MLflow store (--mlflow-uri or $MLFLOW_TRACKING_URI) or the run")
        lines = model_history(uri, args.version)
    else:
        lines = version_lineage(_run_store(args), args.version)
    print("\n".join(lines))
    return 0


def cmd_register(args: argparse.Namespace) -> int:
    from asyncrl.tasks.tracking.model_registry import logged_model_id, register_version

    store = _run_store(args)
    model_id = logged_model_id(store.lineage, args.version)
    base = args.base_model
    if base is None and args.config:  # a LoRA run's adapters apply to its model.path
        from asyncrl.configs.loading import load_config

        base = load_config(args.config).model.path
    base_dir = None if base is None else Path(base)
    number = register_version(store.root, store.lineage, args.version, model_id, args.name, args.alias, base_model_dir=base_dir)
    aliases = "".join(f", models:/{args.name}@{alias}" for alias in args.alias)
    print(f"weight version {args.version} (LoggedModel {model_id}) registered as models:/{args.name}/{number}{aliases}")
    return 0


def _run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--root", help="the run root (a directory or s3:// URI)")
    parser.add_argument("--config", help="the run's YAML config (gives the run root, its options and the MLflow URI)")
    parser.add_argument("--mlflow-uri", help="the MLflow tracking URI (default: the one the run root records)")


def add_lineage_commands(commands: Any, add_debug_flag: Any) -> None:  # noqa: ANN401 - argparse's subparsers
    lineage = commands.add_parser(
        "lineage", help="a weight version's chain: registered version, LoggedModel, weights, step, shards, dataset"
    )
    lineage.add_argument("version", nargs="?", help="weight version number, models:/NAME/N or models:/NAME@ALIAS")
    lineage.add_argument("--dataset", help="instead: the runs and versions that used this dataset file")
    _run_arguments(lineage)
    lineage.set_defaults(handler=cmd_lineage)
    add_debug_flag(lineage)

    register = commands.add_parser("register", help="register a weight version so that MLflow loads and serves it")
    register.add_argument("version", type=int, help="weight version number")
    register.add_argument("--name", required=True, help="registered model name")
    register.add_argument("--alias", action="append", default=[], help="alias to point at it (repeatable)")
    register.add_argument(
        "--base-model", help="a LoRA run's base model directory (default: the --config's model.path), merged with the adapter"
    )
    _run_arguments(register)
    register.set_defaults(handler=cmd_register)
    add_debug_flag(register)
