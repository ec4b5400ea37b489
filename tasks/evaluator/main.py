"""The evaluator as an OS process of its own (:mod:`asyncrl.tasks.evaluator.loop`):
``python -m asyncrl.tasks.evaluator.main --config PROCESS_CONFIG``.

``PROCESS_CONFIG`` is the evaluator's config, written by the launcher
(:class:`~asyncrl.configs.processes.EvaluatorProcessConfig`). The process lowers
its whole session's CPU priority to ``pipeline.training_eval.nice`` first (its reward workers
inherit it; its vLLM server, a session of its own, gets the same), so that on a machine with
few cores generation and training keep the CPUs when they compete.

Exit status: 0 when the run's last step is published and every multiple of
``pipeline.eval_every`` up to it is evaluated or skipped, or on SIGTERM/SIGINT (a version in
evaluation is abandoned; the log says which); 2 bad config; 1 any other error (the run's
supervisor restarts it, and it resumes after its last record).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from asyncrl.configs.loading import ConfigError, frozen_yaml, load_process_config
from asyncrl.configs.processes import EvaluatorProcessConfig
from asyncrl.tasks.evaluator.process import MODULE
from asyncrl.tasks.system.process_group import lower_own_session_priority
from asyncrl.tasks.system.run_paths import run_paths
from asyncrl.tasks.system.stop_signal import StopSignal

EXIT_OK, EXIT_ERROR, EXIT_CONFIG = 0, 1, 2
logger = logging.getLogger("asyncrl.evaluator")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the evaluator's process config (RunPaths.process_config)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per generation request drowns the log
    try:
        config = load_process_config(args.config, EvaluatorProcessConfig)
    except ConfigError as exc:
        print(f"evaluator: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    logger.info("config (secrets redacted):\n%s", frozen_yaml(config))
    if config.pipeline.eval_every < 1:
        print("evaluator: config error: pipeline.eval_every is 0 (evaluation during training is off)", file=sys.stderr)
        return EXIT_CONFIG
    lower_own_session_priority(config.pipeline.training_eval.nice)
    stop = StopSignal()
    stop.install()
    from asyncrl.tasks.evaluator.loop import serve  # the heavy imports once the config is known good

    try:
        serve(config, run_paths(config), stop.event)
    except Exception:  # noqa: BLE001 - the traceback goes to the log the supervisor shows
        logger.exception("evaluator failed")
        return EXIT_ERROR
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
