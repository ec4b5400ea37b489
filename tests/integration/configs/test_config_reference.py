"""The config's field reference: every field has a one-line help text, `asyncrl config show
[SECTION] [--markdown]` prints it, and docs/reference/configuration.md is its current form."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from asyncrl.cli.main import main
from asyncrl.configs.reference import TOP_LEVEL, markdown_reference, sections, text_reference
from asyncrl.configs.run_config import RunConfig

REPO = Path(__file__).resolve().parents[3]
REFERENCE_DOC = REPO / "docs" / "reference" / "configuration.md"
MAX_HELP_CHARS = 100


def config_classes() -> list[type[BaseModel]]:
    """Every config class reachable from RunConfig (each once)."""
    return list(dict.fromkeys(sections().values()))


def test_sections_reach_every_part_of_the_run_config() -> None:
    keys = set(sections())
    assert {TOP_LEVEL, "model", "data", "rollout", "inference", "trainer", "trainer.optimizer", "reward", "reward.code.limits",
            "pipeline", "pipeline.synthetic_data", "pipeline.training_eval", "storage", "tracking",
            "tracking.mismatch_canary", "run", "placement", "placement.trainer", "rollout.episode",
            "rollout.adaptive_staleness", "reward.plugins.<name>"} <= keys  # fmt: skip
    assert sections()[TOP_LEVEL] is RunConfig


@pytest.mark.parametrize("model", config_classes(), ids=lambda m: m.__name__)
def test_every_field_has_a_one_line_description(model: type[BaseModel]) -> None:
    for name, field in model.model_fields.items():
        where = f"{model.__name__}.{name}"
        assert field.description and field.description.strip(), f"{where}: no description"
        assert "\n" not in field.description, f"{where}: the description is one line"
        assert len(field.description) <= MAX_HELP_CHARS, f"{where}: description over {MAX_HELP_CHARS} characters"


def test_the_checked_in_reference_is_current() -> None:
    """Regenerate with `asyncrl config show --markdown > docs/reference/configuration.md`."""
    assert REFERENCE_DOC.read_text(encoding="utf-8") == markdown_reference()


def test_the_command_prints_the_checked_in_reference() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli.main", "config", "show", "--markdown"],
        capture_output=True, text=True, check=True, cwd=REPO,
    )  # fmt: skip
    assert done.stdout == REFERENCE_DOC.read_text(encoding="utf-8")


def test_show_without_a_config_prints_every_section(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show"]) == 0
    out = capsys.readouterr().out
    assert out == text_reference()
    for key in ("name:", "trainer.batch_groups:", "trainer.optimizer.lr:", "pipeline.synthetic_data.task:", "reward.pool.workers:"):
        assert f"\n{key}" in out


@pytest.mark.parametrize("section", ["trainer", "rollout", "inference", "trainer.optimizer", "pipeline.synthetic_data"])
def test_show_a_section_prints_its_fields_only(section: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", section]) == 0
    out = capsys.readouterr().out
    model = sections()[section]
    keys = [line.split(":")[0] for line in out.splitlines() if line and not line.startswith((" ", "["))]
    assert keys == [f"{section}.{name}" for name in model.model_fields]
    for name, field in model.model_fields.items():
        assert f"    {field.description}\n" in out, name


def test_show_a_section_as_markdown(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "trainer.optimizer", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("## trainer.optimizer (OptimizerConfig)\n")
    assert "| `trainer.optimizer.lr` | `float, > 0.0, <= 1.0` | `1e-05` | Peak learning rate. |" in out
    assert "trainer.batch_groups" not in out


@pytest.mark.parametrize("section", ["trainr", "trainer.optimiser", "name"])
def test_an_unknown_section_is_one_clear_line(section: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", section]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    [line] = captured.err.splitlines()
    assert line.startswith(f"asyncrl config: error: {section!r} is neither a config file nor a config section")
    assert "sections: model, data, rollout," in line and "trainer.optimizer" in line and "pipeline.synthetic_data" in line


def test_an_unknown_section_fails_without_a_traceback() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli.main", "config", "show", "no_such_section"],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "'no_such_section'" in done.stderr and "trainer.optimizer" in done.stderr


def test_a_config_file_is_still_shown_resolved(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", str(REPO / "configs" / "demo.yaml"), "trainer.max_steps=3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("name: ") and "max_steps: 3" in out


def test_a_missing_yaml_is_a_missing_config_not_a_section(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", str(tmp_path / "absent.yml")]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_an_existing_file_without_yaml_suffix_is_a_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "trainer"
    path.write_text((REPO / "configs" / "demo.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    assert main(["config", "show", str(path)]) == 0
    assert capsys.readouterr().out.startswith("name: ")


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["config", "show", "trainer", "trainer.max_steps=3"], "overrides apply to a config file"),
        (["config", "show", str(REPO / "configs" / "demo.yaml"), "--markdown"], "--markdown prints the field reference"),
    ],
)
def test_reference_and_config_options_do_not_mix(argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert expected in capsys.readouterr().err
