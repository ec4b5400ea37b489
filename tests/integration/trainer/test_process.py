"""The trainer process under the one supervisor: failure status, cancellation, no orphan after a killed supervisor."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from process_config_files import write_process_config
from trainer_runs import run_trainer

from asyncrl.tasks.launch.supervisor import ComponentFailed
from asyncrl.tasks.trainer.process import TrainerLaunch, trainer_command, trainer_env
from asyncrl.tasks.system.process_group import group_alive


def _bad_config(tmp_path: Path) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nmodel: {path: m}\ndata: {train_path: d}\nstorage: {root: s}\ntrainer: {batch_groups: 0}\n")
    return path


def _waiting_config(tmp_path: Path, tiny_model_dir: Path) -> Path:
    """A valid config whose run root never gets trajectories: the trainer would wait forever."""
    run = {"name": "t", "work_dir": str(tmp_path / "runs"), "model": {"path": str(tiny_model_dir)},
           "data": {"train_path": "d.parquet", "max_prompt_tokens": 8}, "rollout": {"max_new_tokens": 8},
           "trainer": {"micro_batch_tokens": 64}, "storage": {"root": str(tmp_path / "store")}}  # fmt: skip
    return write_process_config(tmp_path / "wait.yaml", run, "trainer")


def test_command_line() -> None:
    launch = TrainerLaunch(Path("c.yaml"), Path("logs/l.log"), overrides=("trainer.max_steps=2",), nproc=2, python="py")
    assert trainer_command(launch) == [
        "py", "-m", "torch.distributed.run", "--log-dir=logs/torchrun", "--standalone", "--nproc-per-node=2",
        "-m", "asyncrl.tasks.trainer.main",
        "--config", "c.yaml", "--mode", "rl", "trainer.max_steps=2",
    ]


def test_command_line_of_one_node_of_several() -> None:
    launch = TrainerLaunch(Path("c.yaml"), Path("l.log"), nproc=2, nnodes=3, rendezvous="head:29400", python="py",
                           work_dir=Path("/local/w"))  # fmt: skip
    assert trainer_command(launch) == [
        "py", "-m", "torch.distributed.run", "--log-dir=torchrun", "--nnodes=3", "--nproc-per-node=2", "--rdzv-backend=c10d",
        "--rdzv-endpoint=head:29400", "-m", "asyncrl.tasks.trainer.main",
        "--config", "c.yaml", "--mode", "rl", "--work-dir", "/local/w",
    ]  # fmt: skip
    # One process per node on several nodes still needs torchrun's rendezvous.
    single = trainer_command(TrainerLaunch(Path("c.yaml"), Path("l.log"), nnodes=2, rendezvous="10.0.0.1:29400", python="py"))
    assert single[4:7] == ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d"]
    assert trainer_command(TrainerLaunch(Path("c.yaml"), Path("l.log"), python="py"))[:3] == ["py", "-m", "asyncrl.tasks.trainer.main"]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"nnodes": 2}, "nnodes=2 needs a rendezvous host:port"),
        ({"nproc": 0}, "nproc must be >= 1, got 0"),
        ({"nnodes": 0}, "nnodes must be >= 1, got 0"),
    ],
)
def test_command_line_refuses_bad_process_counts(fields: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        trainer_command(TrainerLaunch(Path("c.yaml"), Path("l.log"), **fields))


def test_jit_ops_build_inside_the_venv_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer started by a Prefect worker (not by `make`) builds DeepSpeed's ops in this venv, not ~/.cache."""
    launch = TrainerLaunch(Path("c.yaml"), Path("l.log"))
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert trainer_env(launch)["TORCH_EXTENSIONS_DIR"] == str(Path(sys.prefix) / "torch_extensions")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/elsewhere")
    assert trainer_env(launch)["TORCH_EXTENSIONS_DIR"] == "/elsewhere"


def test_failure_status_raises_with_the_log_tail(tmp_path: Path) -> None:
    launch = TrainerLaunch(_bad_config(tmp_path), tmp_path / "trainer.log")
    with pytest.raises(ComponentFailed, match="trainer.batch_groups") as caught:
        run_trainer(launch)
    assert caught.value.reason == "exited with status 2" and caught.value.restarts == 0


def test_stop_kills_the_process_group(tmp_path: Path, tiny_model_dir: Path) -> None:
    launch = TrainerLaunch(_waiting_config(tmp_path, tiny_model_dir), tmp_path / "trainer.log")
    stop = threading.Event()
    errors: list[BaseException] = []
    codes: list[int | None] = []

    def run() -> None:
        try:
            codes.append(run_trainer(launch, stop=stop))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    pid = _wait_for_pid(tmp_path / "trainer.log", launch)
    stop.set()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert errors == [] and codes == [None]  # stopped while it ran: no exit status of its own
    assert not group_alive(pid)


def test_trainer_dies_with_a_killed_supervisor(tmp_path: Path, tiny_model_dir: Path) -> None:
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from asyncrl.tasks.trainer.process import TrainerLaunch, start_trainer\n"
        f"p = start_trainer(TrainerLaunch(Path({str(_waiting_config(tmp_path, tiny_model_dir))!r}), Path({str(tmp_path / 't.log')!r})))\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    supervisor = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert supervisor.stdout is not None
    pid = int(supervisor.stdout.readline())
    assert group_alive(pid)
    supervisor.send_signal(signal.SIGKILL)
    supervisor.wait()
    deadline = time.monotonic() + 20
    while group_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_alive(pid)


def _wait_for_pid(log: Path, launch: TrainerLaunch) -> int:
    """The trainer's pid, found as the process whose command line is the launch's."""
    wanted = "\0".join(["-m", "asyncrl.tasks.trainer.main", "--config", str(launch.config_path)])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
                except OSError:
                    continue
                if wanted in cmdline:
                    return int(entry)
        time.sleep(0.05)
    raise AssertionError(f"trainer process did not appear; log: {log.read_text() if log.exists() else ''}")
