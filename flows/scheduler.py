"""The `scheduler` flow: the run's staleness gate and rollout controller (the scheduler
process, :mod:`asyncrl.tasks.scheduler.main`) under the run's supervisor.

Inside `train` it is a child flow run beside the component task runs (``work`` is the
train run's supervision of the scheduler). On its own it runs against a run root whose
rollout servers, reward service and trainer run elsewhere (registered in the run root):
it supervises the scheduler process, restarting it from ``scheduler/state.json`` on a
crash, until the last step's weights are out and every admitted group is written.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from prefect import flow

from asyncrl.flows.prefect_api.credentials import apply_storage_credentials
from asyncrl.configs.run_config import RunConfig
from asyncrl.tasks.reward.service_registry import TOKEN_ENV
from asyncrl.tasks.launch.components import scheduler_component
from asyncrl.tasks.launch.context import prepare_run
from asyncrl.flows.prefect_api.prefect_reporting import event_reporter, kill_run_processes, outcome_state
from asyncrl.tasks.launch.rl import RunStop, restart_policy
from asyncrl.tasks.launch.supervisor import ComponentOutcome, supervise


@flow(name="scheduler", log_prints=True, on_cancellation=[kill_run_processes], on_crashed=[kill_run_processes])
def scheduler(
    config: RunConfig,
    drain: bool = True,
    work: Callable[[], ComponentOutcome] | None = None,
    stop: RunStop | None = None,
) -> Any:  # noqa: ANN401 - the outcome as a dict, or a Cancelled state
    """Supervise the run's scheduler (see the module docstring); ``work`` and ``stop`` are
    given by the `train` flow only."""
    if work is None:
        apply_storage_credentials(config.storage)
        paths = prepare_run(config)
        stop = RunStop()
        token = os.environ.get(TOKEN_ENV, "")  # the token of the reward service that runs elsewhere
        component = scheduler_component(config, paths, drain, reward_token=token)
        outcome = supervise(component, stop.event, restart_policy(config), event_reporter(config.name))
    else:
        outcome = work()
    return outcome_state(outcome, stop)

