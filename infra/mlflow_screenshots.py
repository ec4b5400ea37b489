"""Screenshots of the MLflow UI on a run's store (how the README's MLflow pictures were taken):
the run page, its plots, the experiment's model list, the registered model (every version with
its aliases) and its best version's page, plus any ``--version`` asked for.

    .venv/bin/python infra/mlflow_screenshots.py sqlite:///runs/demo/mlflow.db docs/ --model asyncrl-demo-policy

Starts ``mlflow server`` on the store (loopback, a free port), waits for ``/health``, finds the
newest run of the registered model's best version and takes each page with headless Chromium
(:func:`ui_screenshot.screenshot`; needs Debian's ``chromium``). Writes ``mlflow-*.png``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ui_screenshot import free_port, screenshot  # noqa: E402 - the sibling script

UI_PREFERENCES = """try {
  localStorage.setItem('mlflow.workflowType_v1', JSON.stringify('machine_learning'));
  localStorage.setItem('mlflow.assistant.panelOpen_v1', 'false');
  localStorage.setItem('mlflow.assistant.fab.autoOpenedOnFirstLoad_v1', 'true');
} catch (e) {}"""
"""The UI's "Model training" view without its assistant panel (its hooks keep
``JSON.stringify(value)`` under ``<key>_v<version>``)."""


@contextmanager
def mlflow_ui(store_uri: str, start_timeout_s: float = 120.0) -> Iterator[str]:
    """``mlflow server`` on ``store_uri`` in its own process group; its base URL. The group is
    killed on exit."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", store_uri, "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                opener.open(f"{base}/health", timeout=5).read()
                break
            except OSError:
                if server.poll() is not None:
                    raise RuntimeError(f"mlflow server on {store_uri} exited with status {server.returncode}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"mlflow server on {store_uri} not healthy in {start_timeout_s:.0f} s") from None
                time.sleep(0.5)
        yield base
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(10)


def pages(store_uri: str, model: str, alias: str, versions: tuple[str, ...] = ()) -> dict[str, str]:
    """File name -> UI route (after ``#``) of each page to take; ``versions`` adds
    ``mlflow-version-<v>.png`` for each (a rejected candidate's tags and description)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=store_uri, registry_uri=store_uri)
    version = client.get_model_version_by_alias(model, alias)
    run = client.get_run(version.run_id)
    experiment, run_id = run.info.experiment_id, run.info.run_id
    return {
        "mlflow-run.png": f"/experiments/{experiment}/runs/{run_id}",
        "mlflow-run-plots.png": f"/experiments/{experiment}/runs/{run_id}/artifacts/plots/pass_at_1.png",
        "mlflow-models.png": f"/experiments/{experiment}/models",
        "mlflow-registered-model.png": f"/models/{model}",
        "mlflow-registered-version.png": f"/models/{model}/versions/{version.version}",
        **{f"mlflow-version-{v}.png": f"/models/{model}/versions/{client.get_model_version(model, v).version}"
           for v in versions},
    }  # fmt: skip


def take_screenshots(
    store_uri: str, out_dir: Path, model: str, alias: str = "best", wait_s: float = 10.0, versions: tuple[str, ...] = ()
) -> list[Path]:
    """Each page of :func:`pages` as ``out_dir/<name>`` (1600 x 1000)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    taken = []
    with mlflow_ui(store_uri) as base:
        for name, route in pages(store_uri, model, alias, versions).items():
            screenshot(f"{base}/#{route}", out_dir / name, None, 1600, 1000, wait_s, UI_PREFERENCES)
            taken.append(out_dir / name)
    return taken


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("store_uri", help="the MLflow tracking URI of the run, e.g. sqlite:///runs/demo/mlflow.db")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--model", required=True, help="registered model name")
    parser.add_argument("--alias", default="best")
    parser.add_argument("--version", action="append", default=[], help="also a page of this version (repeatable)")
    parser.add_argument("--wait", type=float, default=10.0, help="seconds for each page to render")
    args = parser.parse_args()
    for path in take_screenshots(
        args.store_uri, args.out_dir, args.model, args.alias, args.wait, tuple(args.version)
    ):
        print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
