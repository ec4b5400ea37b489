"""What a user sees when a command fails: one line on stderr, ``asyncrl COMMAND: error: ...``,
naming the file, flag or key and what to do, and exit status 2 (fix the input) or 1 (the
environment failed); ``--debug`` / ``ASYNCRL_DEBUG=1`` show the traceback instead. Nothing
here starts Prefect or vLLM: the checks run before either."""

from __future__ import annotations

import errno
import io
import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from asyncrl.cli.main import console_without_user_tracebacks, main
from asyncrl.configs.loading import ConfigError
from asyncrl.storage.errors import StorageOperationError
from asyncrl.tasks.data.records import DatasetError


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    status = main(argv)
    err = capsys.readouterr().err
    return status, err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


# ----- make-data -----


def test_make_data_under_a_file_names_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file")
    status, err = run_cli(["make-data", str(blocker / "data")], capsys)
    line = one_line(err)
    assert status == 2
    assert line == (
        f"asyncrl make-data: error: {blocker / 'data'}: is under {blocker}, a file, not a directory; "
        "choose another output directory"
    )
    status, err = run_cli(["make-data", str(blocker)], capsys)
    assert status == 2 and f"{blocker}: is a file, not a directory" in one_line(err)
    assert blocker.read_text() == "a file"


@pytest.mark.parametrize(("flag", "value"), [("--n-train", "0"), ("--n-train", "-5"), ("--n-heldout", "0"), ("--n-train", "many")])
def test_make_data_counts_must_be_positive(flag: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["make-data", str(tmp_path / "data"), flag, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {flag}: must be an integer >= 1, got " in err and "Traceback" not in err
    assert not (tmp_path / "data").exists()


def test_make_data_keeps_existing_files_unless_told(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "data"
    assert main(["make-data", str(out), "--n-train", "8", "--n-heldout", "2"]) == 0
    before = (out / "train.parquet").read_bytes()
    status, err = run_cli(["make-data", str(out), "--n-train", "9", "--n-heldout", "2"], capsys)
    assert status == 2 and "already exist; pass --overwrite to replace" in one_line(err)
    assert (out / "train.parquet").read_bytes() == before
    assert main(["make-data", str(out), "--n-train", "9", "--n-heldout", "2", "--overwrite"]) == 0
    assert (out / "train.parquet").read_bytes() != before


def test_make_data_on_a_full_disk_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import pyarrow.parquet as pq

    def full_disk(table: object, where: str, **kwargs: object) -> None:
        Path(where).write_bytes(b"PAR1")  # a few bytes got out before the disk filled up
        raise OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device")  # pyarrow's

    monkeypatch.setattr(pq, "write_table", full_disk)
    out = tmp_path / "data"
    status, err = run_cli(["make-data", str(out), "--n-train", "8", "--n-heldout", "2"], capsys)
    assert status == 1
    assert one_line(err) == (
        f"asyncrl make-data: error: {out / 'train.parquet'}: no space left on device; "
        "free some space or choose another location"
    )
    assert list(out.iterdir()) == []  # no half-written or temporary file is left


# ----- run: checks before Prefect starts -----


@pytest.fixture
def run_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """`asyncrl run` sets these with setdefault; set here, the test restores them."""
    monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    monkeypatch.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    monkeypatch.delenv("ASYNCRL_DEBUG", raising=False)


def write_config(tmp_path: Path, **changes: Any) -> Path:
    raw: dict[str, Any] = {
        "name": "cli-errors",
        "work_dir": str(tmp_path / "work"),
        "model": {"path": str(tmp_path / "model")},
        "data": {"train_path": str(tmp_path / "train.parquet")},
        "storage": {"root": str(tmp_path / "store")},
    }
    for section, values in changes.items():
        raw[section] = {**raw.get(section, {}), **values}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_run_with_a_missing_model_directory_names_model_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], run_env: None
) -> None:
    status, err = run_cli(["run", str(write_config(tmp_path))], capsys)
    assert status == 2
    assert one_line(err) == (
        f"asyncrl run: error: model.path: {tmp_path / 'model'} does not exist (run init-model or fix the path)"
    )
    assert not (tmp_path / "store" / "config.yaml").exists() and not (tmp_path / "work").exists()  # nothing started


def test_load_codec_names_a_missing_model_path(tmp_path: Path) -> None:
    from asyncrl.tasks.model.checks import ModelPathError
    from asyncrl.tasks.model.codec import load_codec

    with pytest.raises(ModelPathError, match=rf"^model.path: {tmp_path / 'nope'} does not exist \(run init-model"):
        load_codec(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelPathError, match="has no config.json"):
        load_codec(str(tmp_path / "empty"))


def test_run_resuming_with_other_trajectory_settings_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], run_env: None
) -> None:
    from asyncrl.configs.loading import load_config
    from asyncrl.tasks.launch.context import prepare_run

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    prepare_run(load_config(str(write_config(tmp_path))))
    frozen = (tmp_path / "store" / "config.yaml").read_bytes()
    status, err = run_cli(["run", str(write_config(tmp_path)), "rollout.temperature=0.5", "trainer.eps_clip=0.1"], capsys)
    line = one_line(err)
    assert status == 2
    assert "rollout.temperature: 1.0 -> 0.5" in line and "trainer.eps_clip: 0.2 -> 0.1" in line
    assert "start a new run (another name and storage.root)" in line
    assert (tmp_path / "store" / "config.yaml").read_bytes() == frozen


# ----- one handler for every command -----


@pytest.mark.parametrize(
    ("error", "status", "expected"),
    [
        (ConfigError("trainer.batch_groups: must be >= 1"), 2, "trainer.batch_groups: must be >= 1"),
        (FileNotFoundError(errno.ENOENT, "No such file or directory", "/data/run.yaml"), 2, "/data/run.yaml: No such file or directory"),
        (PermissionError(errno.EACCES, "Permission denied", "/data/run.yaml"), 2, "/data/run.yaml: Permission denied"),
        (
            UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
            2,
            "a file is not UTF-8 text (invalid start byte at byte 0); save it as UTF-8 (--debug or ASYNCRL_DEBUG=1 shows which file)",
        ),
        (DatasetError("/data/train.jsonl, line 3: not UTF-8 text"), 2, "/data/train.jsonl, line 3: not UTF-8 text"),
        (
            StorageOperationError("read", "s3://bucket/run/config.yaml", 5, ConnectionError("reset by peer")),
            1,
            "read s3://bucket/run/config.yaml failed: ConnectionError: reset by peer",
        ),
        (OSError(errno.ENOSPC, "No space left on device", "/runs/demo/logs"), 1, "/runs/demo/logs: no space left on device"),
    ],
)
@pytest.mark.parametrize("command", [["config", "show"], ["run"]])
def test_user_errors_end_in_one_line(
    error: Exception,
    status: int,
    expected: str,
    command: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    run_env: None,
) -> None:
    import asyncrl.cli.main as cli

    def fail(*args: object) -> None:
        raise error

    monkeypatch.setattr(cli, "load_config", fail)
    got, err = run_cli([*command, "run.yaml"], capsys)
    line = one_line(err)
    assert got == status
    assert line.startswith(f"asyncrl {command[0]}: error: {expected}")


@pytest.mark.parametrize("how", ["flag-before", "flag-after", "env"])
def test_debug_shows_the_traceback(how: str, monkeypatch: pytest.MonkeyPatch, run_env: None) -> None:
    import asyncrl.cli.main as cli

    def fail(*args: object) -> None:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", "run.yaml")

    monkeypatch.setattr(cli, "load_config", fail)
    argv = {"flag-before": ["--debug", "run", "run.yaml"], "flag-after": ["run", "--debug", "run.yaml"], "env": ["run", "run.yaml"]}[how]
    if how == "env":
        monkeypatch.setenv("ASYNCRL_DEBUG", "1")
    with pytest.raises(FileNotFoundError):
        main(argv)


def test_a_bug_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch, run_env: None) -> None:
    import asyncrl.cli.main as cli

    def fail(*args: object) -> None:
        raise KeyError("a bug")

    monkeypatch.setattr(cli, "load_config", fail)
    with pytest.raises(KeyError):
        main(["config", "show", "run.yaml"])


def test_a_missing_config_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, err = run_cli(["config", "show", str(tmp_path / "absent.yaml")], capsys)
    assert status == 2 and "absent.yaml" in one_line(err)


def test_flow_logs_of_user_errors_lose_their_traceback_on_the_console() -> None:
    """Prefect logs a failed flow's exception with its traceback to the console (the root
    logger's handlers); during `asyncrl run` a user error's log line comes without it."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    formatter = logging.Formatter("%(message)s")
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.addHandler(handler)
    logger = logging.getLogger("asyncrl-test-flow-runs")
    try:
        with console_without_user_tracebacks(debug=False):
            for error in (DatasetError("/data/train.jsonl, line 3: not UTF-8 text"), RuntimeError("a bug")):
                try:
                    raise error
                except Exception:
                    logger.exception("Encountered exception during execution: %r", error)
        assert handler.formatter is formatter  # restored
    finally:
        root.removeHandler(handler)
    user, bug = stream.getvalue().split("Encountered exception during execution: RuntimeError")
    assert "DatasetError" in user and "Traceback" not in user
    assert "Traceback" in bug


# ----- init-model -----


def test_init_model_under_a_file_names_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file")
    status, err = run_cli(["init-model", str(blocker / "model")], capsys)
    assert status == 2
    assert one_line(err) == (
        f"asyncrl init-model: error: {blocker / 'model'}: is under {blocker}, a file, not a directory; "
        "choose another directory"
    )


def test_init_model_on_a_full_disk_names_the_directory_and_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncrl.tasks.model.tiny as tiny

    def full_disk(target: Path, *args: object) -> None:
        (target / "config.json").write_text("{}")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tiny, "_save_model_files", full_disk)
    status, err = run_cli(["init-model", str(tmp_path / "model")], capsys)
    assert status == 1
    assert one_line(err) == (
        f"asyncrl init-model: error: {tmp_path / 'model'}: no space left on device; free some space or choose another location"
    )
    assert list(tmp_path.iterdir()) == []  # the staging directory is gone
