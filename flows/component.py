"""The `component` flow: one long-lived component of a run (a rollout server, one trainer node,
or the scheduler with its reward service) on whatever machine its deployment's work pool
gives it. The `train` flow starts it with ``run_deployment`` when the run's ``placement``
names a deployment for that component, and supervises it through this flow run's state and
its heartbeat in the run root (:mod:`asyncrl.flows.prefect_api.remote_component`).

The flow run's state tells the truth: Running while the component runs, Completed on its
normal end (or when its run asked it to stop; a rollout server added to a running run with
``asyncrl fleet add`` also when the run's last step is published), Failed with exit status and log tail
otherwise, Cancelled when the run stopped it. Its cancel and crash hooks kill the process
groups it recorded, so nothing outlives it on its machine. Details: ``docs/internals/flows.md``.
"""

from __future__ import annotations

import threading
from typing import Any

from prefect import flow, get_run_logger, runtime

from asyncrl.flows.prefect_api.credentials import apply_storage_credentials
from asyncrl.configs.run_config import RunConfig
from asyncrl.storage.heartbeats import clear_stop_request, stop_requested
from asyncrl.tasks.launch.component_host import heartbeat_writer, hosted_components, hosted_groups_file, run_hosted
from asyncrl.tasks.launch.context import prepare_run
from asyncrl.tasks.launch.fleet import added_server_done
from asyncrl.tasks.launch.kinds import ComponentKind, component_name
from asyncrl.flows.prefect_api.prefect_reporting import kill_hosted_processes
from asyncrl.tasks.launch.rl import ProcessGroupFile


@flow(name="component", log_prints=True, on_cancellation=[kill_hosted_processes], on_crashed=[kill_hosted_processes])
def component(
    config: RunConfig, kind: ComponentKind, index: int = 0, replica: int = 0, start_id: str = "", drain: bool = False
) -> dict[str, Any]:
    """Run one component of ``config``'s run here until it ends or this flow run is cancelled
    (see the module docstring). ``start_id`` ties the heartbeat to the start that launched
    this flow run; ``replica`` is the trainer node (0 for the others)."""
    logger = get_run_logger()
    apply_storage_credentials(config.storage)
    paths = prepare_run(config)
    name = component_name(kind, index)
    groups = ProcessGroupFile(paths.work_dir / hosted_groups_file(kind, index, replica))
    beat = heartbeat_writer(paths, kind, index, replica, start_id, str(runtime.flow_run.id))
    stop = threading.Event()
    components = hosted_components(config, paths, kind, index, drain)
    logger.info("%s (replica %d, start %s): starting %s", name, replica, start_id, [c.name for c in components])

    def asked_to_stop() -> bool:
        return stop_requested(paths.root, name, replica, start_id) or added_server_done(config, paths.root, kind, index)

    try:
        code = run_hosted(components, stop, beat, config.placement.heartbeat_s,
                          on_started=lambda c: groups.update(c.name, c.pgid()),
                          stop_requested=asked_to_stop)  # fmt: skip
    finally:
        stop.set()
        for hosted in components:
            groups.update(hosted.name, None)
        # The heartbeat stays: this flow run is still Running until Prefect finalises it, and
        # a Running replica without its heartbeat counts as lost. The run's supervisor deletes
        # it when it stops the component (RemoteComponent.stop).
    if code is None:
        clear_stop_request(paths.root, name, replica)
        logger.info("%s (replica %d) stopped: its run finished", name, replica)
    else:
        logger.info("%s (replica %d) finished with exit status %s", name, replica, code)
    return {"component": name, "replica": replica, "exit_code": code}
