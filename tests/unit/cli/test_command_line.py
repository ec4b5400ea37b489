"""KEY=VALUE overrides are taken before and after a command's options; anything else left
over is refused by name."""

from __future__ import annotations

import pytest

from asyncrl.cli.main import build_parser, parse_command_line


def test_overrides_after_the_options_join_those_before_them() -> None:
    args = parse_command_line(build_parser(), ["bench", "learning", "c.yaml", "a.b=1", "--repeats", "1", "rollout.eta=0"])
    assert args.config == "c.yaml" and args.repeats == 1
    assert args.overrides == ["a.b=1", "rollout.eta=0"]


def test_options_first_parse_as_before() -> None:
    args = parse_command_line(build_parser(), ["bench", "learning", "--repeats", "2", "c.yaml", "rollout.eta=0"])
    assert args.repeats == 2 and args.overrides == ["rollout.eta=0"]


@pytest.mark.parametrize(
    "argv, named",
    [
        (["bench", "learning", "c.yaml", "--repeats", "1", "--bogus"], "--bogus"),
        (["bench", "learning", "c.yaml", "--repeats", "1", "stray"], "stray"),
        (["init-model", "out", "--seed", "1", "a=b"], "a=b"),  # a command without overrides
    ],
)
def test_what_is_neither_an_option_nor_an_override_is_refused(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_command_line(build_parser(), argv)
    assert exit_info.value.code == 2
    assert f"unrecognized arguments: {named}" in capsys.readouterr().err
