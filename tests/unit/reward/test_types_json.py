"""The JSON form of requests and results is exact: every field comes back equal, floats unrounded."""

from __future__ import annotations

import json
from typing import Any

import pytest

from asyncrl.tasks.reward.types import (
    CallCase,
    CodeTests,
    Reason,
    RewardRequest,
    RewardResult,
    StdioCase,
    TestOutcome,
)


def through_json(data: dict[str, Any]) -> Any:
    """What the other side of an HTTP connection parses."""
    return json.loads(json.dumps(data))


REQUESTS = [
    RewardRequest("math", "so the answer is \\boxed{\\frac{1}{2}}", "0.5"),
    RewardRequest("math", "Natalia sold 48 clips... #### 72", "#### 72", {"prompt_id": "gsm8k-17", "sample": 3}),
    RewardRequest(
        "code",
        "```python\nprint(sum(map(int, input().split())))\n```",
        CodeTests(
            stdio=(StdioCase("1 2\n", "3\n"), StdioCase("", "0\n")),
            asserts=("assert add(1, 2) == 3", "import sys\nassert sys.version_info >= (3,)"),
        ),
        {"problem": "add", "unicode": "naïve ∑"},
    ),
    RewardRequest("code", "no program here", CodeTests()),
    RewardRequest(
        "code",
        "```python\nclass Solution:\n    def twoSum(self, nums, target): ...\n```",
        CodeTests(
            calls=(
                CallCase("twoSum", "[[2, 7, 11, 15], 9]", "[0, 1]"),
                CallCase("twoSum", '[[3, 3], 6, "naïve \\"quoted\\""]', "[[0, 1]]"),
            ),
            time_limit_s=1.25,
        ),
    ),
    RewardRequest("code", "x", CodeTests(stdio=(StdioCase("", ""),), time_limit_s=0.1 + 0.2)),
    RewardRequest(
        "plugin", "x", {"expected": [1, 2], "tolerance": 0.1}, {"nested": {"a": [None, True]}}, plugin="judge"
    ),
    RewardRequest("plugin", "y", None, plugin="style_2"),
]

RESULTS = [
    RewardResult(1.0, Reason.OK, "answer 1/2", elapsed_s=0.123456789012345),
    RewardResult(0.0, Reason.WRONG_ANSWER, "answer 5, expected 4", elapsed_s=1e-7),
    RewardResult(
        0.5,
        Reason.TIMEOUT,
        "1 of 2 tests failed",
        tests=(
            TestOutcome("stdio[0]", True, Reason.OK, "", 0.0421337),
            TestOutcome("asserts[0]", False, Reason.TIMEOUT, "killed after 3.0 s", 3.0000001),
        ),
        sandboxed=True,
        elapsed_s=3.14159,
    ),
    RewardResult(0.0, Reason.SANDBOX_UNAVAILABLE, "bwrap missing", sandboxed=False),
    RewardResult(1.0 / 3.0, Reason.VERIFIER_ERROR),
]


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: r.plugin or r.kind)
def test_requests_round_trip(request_: RewardRequest) -> None:
    assert RewardRequest.from_json(through_json(request_.to_json())) == request_


@pytest.mark.parametrize("result", RESULTS, ids=lambda r: r.reason.value)
def test_results_round_trip_exactly(result: RewardResult) -> None:
    assert RewardResult.from_json(through_json(result.to_json())) == result


def test_code_reference_is_the_tests_file_format() -> None:
    data = REQUESTS[2].to_json()
    assert data["reference"] == {
        "stdio": [{"input": "1 2\n", "output": "3\n"}, {"input": "", "output": "0\n"}],
        "asserts": ["assert add(1, 2) == 3", "import sys\nassert sys.version_info >= (3,)"],
    }


def test_calls_time_limit_and_plugin_in_the_json_form() -> None:
    calls = REQUESTS[4].to_json()
    assert calls["reference"] == {
        "stdio": [],
        "asserts": [],
        "calls": [
            {"function": "twoSum", "arguments": "[[2, 7, 11, 15], 9]", "expected": "[0, 1]"},
            {"function": "twoSum", "arguments": '[[3, 3], 6, "naïve \\"quoted\\""]', "expected": "[[0, 1]]"},
        ],
        "time_limit_s": 1.25,
    }
    assert "calls" not in REQUESTS[2].to_json()["reference"]  # absent when empty: older readers still parse it
    assert REQUESTS[6].to_json()["plugin"] == "judge"
    assert "plugin" not in REQUESTS[0].to_json()
    # An integral time limit comes back as the same float.
    data = {"kind": "code", "response": "x", "reference": {"calls": calls["reference"]["calls"], "time_limit_s": 2}}
    assert RewardRequest.from_json(data).reference.time_limit_s == 2.0


def test_a_plugin_request_must_name_its_plugin_and_no_other_may() -> None:
    with pytest.raises(ValueError, match="RewardRequest.plugin: a plugin request names its plug-in"):
        RewardRequest("plugin", "x", "y")
    with pytest.raises(ValueError, match="RewardRequest.plugin: a plugin request names its plug-in"):
        RewardRequest("math", "x", "y", plugin="judge")
    with pytest.raises(ValueError, match="RewardRequest.plugin"):
        RewardRequest.from_json({"kind": "plugin", "response": "x", "reference": None})


def test_optional_fields_take_their_defaults() -> None:
    assert RewardRequest.from_json({"kind": "math", "response": "4", "reference": "4"}) == RewardRequest("math", "4", "4")
    assert RewardResult.from_json({"reward": 1, "reason": "ok"}) == RewardResult(1.0, Reason.OK)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"kind": "poem", "response": "x", "reference": "y"}, r"requests\[2\]\.kind: 'poem' is not one of"),
        ({"kind": "math", "response": 4, "reference": "4"}, r"requests\[2\]\.response: expected str, got int"),
        ({"kind": "math", "response": "4"}, r"requests\[2\]: missing key\(s\) \['reference'\]"),
        ({"kind": "math", "response": "4", "reference": "4", "extra": 1}, r"requests\[2\]: unknown key\(s\) \['extra'\]"),
        ({"kind": "code", "response": "x", "reference": {"stdio": [{"input": "1"}]}}, r"requests\[2\]\.reference\.stdio\[0\]: missing"),
        ({"kind": "code", "response": "x", "reference": {"asserts": [3]}}, r"requests\[2\]\.reference\.asserts\[0\]: expected str"),
        ({"kind": "code", "response": "x", "reference": {"calls": [{"function": "f", "arguments": "[]"}]}},
         r"requests\[2\]\.reference\.calls\[0\]: missing key\(s\) \['expected'\]"),
        ({"kind": "code", "response": "x", "reference": {"calls": [{"function": "f", "arguments": [], "expected": "1"}]}},
         r"requests\[2\]\.reference\.calls\[0\]\.arguments: expected str, got list"),
        ({"kind": "code", "response": "x", "reference": {"stdio": [], "time_limit_s": "2"}},
         r"requests\[2\]\.reference\.time_limit_s: expected int or float or null, got str"),
        ({"kind": "code", "response": "x", "reference": {"stdio": [], "time_limit_s": -1}},
         r"requests\[2\]\.reference\.time_limit_s: must be a positive number"),
        ({"kind": "plugin", "response": "x", "reference": None, "plugin": 3}, r"requests\[2\]\.plugin: expected str, got int"),
        ({"kind": "math", "response": "4", "reference": "4", "metadata": []}, r"requests\[2\]\.metadata: expected dict"),
        ([], r"requests\[2\]: expected a JSON object, got list"),
    ],
)  # fmt: skip
def test_bad_requests_name_the_field(data: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RewardRequest.from_json(data, "requests[2]")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"reward": True, "reason": "ok"}, r"RewardResult\.reward: expected int or float, got bool"),
        ({"reward": 1.0, "reason": "fine"}, r"RewardResult\.reason: 'fine' is not one of"),
        ({"reward": 1.0, "reason": "ok", "sandboxed": "yes"}, r"RewardResult\.sandboxed: expected bool or null"),
        ({"reward": 1.0, "reason": "ok", "tests": [{"name": "t", "passed": 1, "reason": "ok"}]},
         r"RewardResult\.tests\[0\]\.passed: expected bool, got int"),
    ],
)  # fmt: skip
def test_bad_results_name_the_field(data: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RewardResult.from_json(data)
