"""`asyncrl reward math|code` and `asyncrl bench reward`, through the argparse wiring the
top-level CLI uses (add_reward_commands / add_reward_bench)."""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest

from asyncrl.cli.reward import add_reward_bench, add_reward_commands


def run_cli(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="asyncrl")
    commands = parser.add_subparsers(dest="command", required=True)
    add_reward_commands(commands)
    bench = commands.add_parser("bench")
    add_reward_bench(bench.add_subparsers(dest="bench_command", required=True))
    args = parser.parse_args(list(argv))
    status: int = args.handler(args)
    return status


def test_reward_math_text_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    response = tmp_path / "response.txt"
    response.write_text("So the answer is \\boxed{\\frac{1}{2}}.")
    assert run_cli(["reward", "math", "--answer", "0.5", "--response", str(response)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("reward 1  reason ok")
    assert run_cli(["reward", "math", "--answer", "#### 3", "--response", str(response), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["reward"] == 0.0 and payload["reason"] == "wrong_answer"


def test_reward_code_json_lists_every_test(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed: apt-get install bubblewrap")
    response = tmp_path / "response.md"
    response.write_text(
        "```python\ndef double(x):\n    return 2 * x\n\nif __name__ == '__main__':\n    print(double(int(input())))\n```"
    )
    tests = tmp_path / "tests.json"
    tests.write_text(
        json.dumps({"stdio": [{"input": "2\n", "output": "4\n"}, {"input": "5\n", "output": "11\n"}],
                    "asserts": ["assert double(3) == 6"]})
    )  # fmt: skip
    assert run_cli(["reward", "code", "--tests", str(tests), "--response", str(response), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["reward"] == pytest.approx(2 / 3)
    assert payload["reason"] == "wrong_answer" and payload["sandboxed"] is True
    assert [(t["name"], t["passed"]) for t in payload["tests"]] == [("stdio[0]", True), ("stdio[1]", False), ("assert[0]", True)]
    assert run_cli(["reward", "code", "--tests", str(tests), "--response", str(response), "--scoring", "all"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("reward 0  reason wrong_answer") and "stdio[1]: FAIL wrong_answer" in out


def test_reward_code_bad_input_names_the_file(tmp_path: Path) -> None:
    response = tmp_path / "response.md"
    response.write_text("```python\nprint(1)\n```")
    tests = tmp_path / "tests.json"
    tests.write_text(json.dumps({"stdio": [{"input": "", "out": "1"}]}))
    with pytest.raises(ValueError, match=r"tests.json: stdio\[0\] must be an object"):
        run_cli(["reward", "code", "--tests", str(tests), "--response", str(response)])
    tests.write_text(json.dumps({"stdio": [{"input": "", "output": "1"}]}))
    with pytest.raises(FileNotFoundError, match="missing.md"):
        run_cli(["reward", "code", "--tests", str(tests), "--response", str(tmp_path / "missing.md")])


def test_bench_reward_prints_a_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "bench.json"
    argv = ["bench", "reward", "--workers", "1", "2", "--math-items", "8", "--code-items", "2", "--json-out", str(out_file)]
    assert run_cli(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split() == ["kind", "workers", "items", "seconds", "verif/s", "reasons"]
    payload = json.loads(lines[-1])
    assert payload == json.loads(out_file.read_text())
    rows = {(r["kind"], r["workers"]): r for r in payload["rows"]}
    assert set(rows) == {("math", 1), ("code", 1), ("math", 2), ("code", 2)}
    for row in rows.values():
        assert row["verifications_per_s"] == pytest.approx(row["items"] / row["seconds"])
        assert sum(row["reasons"].values()) == row["items"]
    assert set(rows[("math", 1)]["reasons"]) <= {"ok", "wrong_answer"}


def test_reward_code_non_utf8_files_are_named(tmp_path: Path) -> None:
    response = tmp_path / "response.md"
    response.write_text("```python\nprint(1)\n```")
    tests = tmp_path / "tests.json"
    tests.write_bytes(b'{"stdio": [{"input": "", "output": "\xff1"}]}')
    with pytest.raises(ValueError, match=r"tests.json: not UTF-8 text: byte 0xff at offset 36"):
        run_cli(["reward", "code", "--tests", str(tests), "--response", str(response)])
    tests.write_text(json.dumps({"stdio": [{"input": "", "output": "1"}]}))
    response.write_bytes(b"```python\nprint('\xe9')\n```")
    with pytest.raises(ValueError, match=r"--response .*response.md: not UTF-8 text: byte 0xe9 at offset 17"):
        run_cli(["reward", "code", "--tests", str(tests), "--response", str(response)])
    with pytest.raises(ValueError, match=r"--response .*response.md: not UTF-8 text"):
        run_cli(["reward", "math", "--answer", "1", "--response", str(response)])


def test_reward_code_text_output_escapes_control_characters(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed: apt-get install bubblewrap")
    response = tmp_path / "response.md"
    response.write_text("```python\nimport sys\nsys.stderr.write('\\x1b]0;owned\\x07\\x1b[2J')\nsys.exit(1)\n```")
    tests = tmp_path / "tests.json"
    tests.write_text(json.dumps({"stdio": [{"input": "", "output": "1\n"}]}))
    assert run_cli(["reward", "code", "--tests", str(tests), "--response", str(response)]) == 0
    out = capsys.readouterr().out
    assert "\\x1b]0;owned\\x07\\x1b[2J" in out, out
    assert "\x1b" not in out and "\x07" not in out


def test_bench_reward_code_tests_and_sandbox_per(capsys: pytest.CaptureFixture[str]) -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed: apt-get install bubblewrap")
    with pytest.raises(ValueError, match="--code-tests: must be >= 1, got 0"):
        run_cli(["bench", "reward", "--workers", "1", "--math-items", "0", "--code-tests", "0"])
    for per in ("program", "test"):
        argv = ["bench", "reward", "--workers", "1", "--math-items", "0", "--code-items", "3", "--code-tests", "3",
                "--sandbox-per", per]  # fmt: skip
        assert run_cli(argv) == 0
        (row,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
        assert (row["kind"], row["items"]) == ("code", 3)
        assert set(row["reasons"]) <= {"ok", "wrong_answer"}, row


def test_reward_code_runs_call_cases_with_the_problem_time_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed: apt-get install bubblewrap")
    response = tmp_path / "response.md"
    response.write_text("```python\nimport time\ndef add(a, b):\n    if a < 0:\n        time.sleep(5)\n    return a + b\n```")
    tests = tmp_path / "tests.json"
    calls = [{"function": "add", "arguments": "[1, 2]", "expected": "3"},
             {"function": "add", "arguments": "[-1, 2]", "expected": "1"}]  # fmt: skip
    tests.write_text(json.dumps({"calls": calls, "time_limit_s": 0.5}))
    assert run_cli(["reward", "code", "--tests", str(tests), "--response", str(response), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert (payload["reward"], payload["reason"]) == (0.5, "timeout")
    assert [(t["name"], t["reason"]) for t in payload["tests"]] == [("call[0]", "ok"), ("call[1]", "timeout")]
    assert "wall time limit of 0.5 s" in payload["tests"][1]["detail"]
