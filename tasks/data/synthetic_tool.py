"""Synthetic calculator problems: the tool-use demo's task (``examples/calculator.py``).

A problem is ``What is a*b+c?`` with a in [100, 999], b in [10, 99] and c in [1, 9]: a
product the tiny model gets wrong in its head, right with the ``calc`` tool. RL and held-out
prompts are math rows; warm-start rows add a ``conversation`` demonstration in OpenAI
messages, of kind ``tool`` (call ``calc``, read the result, answer ``#### <answer>``) or
``direct`` (answer at once), mixed in ``tool_share``. RL rewards the calls, which is what the
demo measures. Demonstrations go through the recording endpoint's conversation code
(:func:`asyncrl.tasks.agent.demonstration.demonstration_tokens`), so the warm start sees
the exact tokens the model will produce and read at RL time.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.tasks.data.synthetic import FINAL_ANSWER_MARKER, draw_distinct, split_train_heldout, write_table_atomic

CONVERSATION_FIELD = "conversation"
TOOL_CALL_ID = "call_0"


@dataclass(frozen=True)
class CalcProblem:
    """``a*b+c`` (module docstring)."""

    a: int
    b: int
    c: int

    @property
    def expression(self) -> str:
        return f"{self.a}*{self.b}+{self.c}"

    @property
    def prompt(self) -> str:
        return f"What is {self.expression}?"

    @property
    def answer(self) -> str:
        return str(self.a * self.b + self.c)

    @property
    def num_steps(self) -> int:
        return 2


def sample_calc_problem(rng: random.Random) -> CalcProblem:
    return CalcProblem(rng.randint(100, 999), rng.randint(10, 99), rng.randint(1, 9))


def make_calc_dataset(n: int, seed: int) -> list[CalcProblem]:
    """``n`` problems with distinct prompts, deterministic in (n, seed)."""
    rng = random.Random(seed)
    return draw_distinct(n, lambda: sample_calc_problem(rng), lambda p: p.prompt, "CalcProblem(a*b+c)")


def demonstration(problem: CalcProblem, kind: str, tools: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The warm-start conversation of ``problem``: ``tool`` or ``direct`` (module docstring)."""
    final = {"role": "assistant", "content": f"{FINAL_ANSWER_MARKER} {problem.answer}"}
    user = {"role": "user", "content": problem.prompt}
    if kind == "direct":
        return {"messages": [user, final], "tools": list(tools)}
    if kind != "tool":
        raise ValueError(f"demonstration: kind must be 'tool' or 'direct', got {kind!r}")
    call = {
        "id": TOOL_CALL_ID,
        "type": "function",
        "function": {"name": "calc", "arguments": json.dumps({"expr": problem.expression})},
    }
    return {
        "messages": [
            user,
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": TOOL_CALL_ID, "content": problem.answer},
            final,
        ],
        "tools": list(tools),
    }


def write_calc_problems(path: Path, problems: Sequence[CalcProblem], conversations: Sequence[dict[str, Any]] | None = None) -> Path:
    """Parquet ``prompt``, ``answer``, ``num_steps`` (and ``conversation`` JSON when given); atomic."""
    import pyarrow as pa

    columns: dict[str, Any] = {
        "prompt": pa.array([p.prompt for p in problems], pa.string()),
        "answer": pa.array([p.answer for p in problems], pa.string()),
        "num_steps": pa.array([p.num_steps for p in problems], pa.int32()),
    }
    if conversations is not None:
        columns[CONVERSATION_FIELD] = pa.array([json.dumps(c) for c in conversations], pa.string())
    return write_table_atomic(path, pa.table(columns))


def write_calc_splits(
    *,
    train_path: Path,
    heldout_path: Path | None,
    sft_path: Path | None,
    n_train: int,
    n_heldout: int,
    n_sft: int,
    seed: int,
    tool_share: float,
    tools: Sequence[dict[str, Any]],
) -> dict[str, Path]:
    """One draw of distinct problems split into RL prompts, held-out prompts and warm-start
    demonstrations (``tool`` with probability ``tool_share``, else ``direct``)."""
    if not 0.0 <= tool_share <= 1.0:
        raise ValueError(f"tool_share must be in [0, 1], got {tool_share}")
    problems = make_calc_dataset(n_train + n_heldout + n_sft, seed)
    rest, sft = split_train_heldout(problems, n_sft, seed + 1)
    train, heldout = split_train_heldout(rest, n_heldout, seed)
    written = {"train": write_calc_problems(Path(train_path), train)}
    if heldout_path is not None:
        written["heldout"] = write_calc_problems(Path(heldout_path), heldout)
    if sft_path is not None and sft:
        rng = random.Random(seed + 2)
        kinds = ["tool" if rng.random() < tool_share else "direct" for _ in sft]
        written["sft"] = write_calc_problems(
            Path(sft_path), sft, [demonstration(p, k, tools) for p, k in zip(sft, kinds, strict=True)]
        )
    return written
