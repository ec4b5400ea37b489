"""The calculator task's data: distinct problems in three splits, demonstrations of both
kinds in the asked share, read back through the prompt loader (which refuses a bad
``conversation`` by row and field), and the example's tool itself."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl.examples.calculator import calc, run_tool
from asyncrl.tasks.data.loader import load_prompts
from asyncrl.tasks.data.records import DatasetError
from asyncrl.tasks.data.synthetic_tool import demonstration, make_calc_dataset, write_calc_splits
from asyncrl.configs.loading import load_config

TOOLS = load_config(str(Path(__file__).resolve().parents[3] / "configs" / "demo-tool.yaml")).rollout.episode.options["tools"]  # type: ignore[union-attr]
"""The tools configs/demo-tool.yaml offers the calculator episode, and its demonstrations use."""


def test_splits_are_disjoint_and_demonstrations_follow_the_share(tmp_path: Path) -> None:
    paths = write_calc_splits(
        train_path=tmp_path / "train.parquet", heldout_path=tmp_path / "heldout.parquet", sft_path=tmp_path / "sft.parquet",
        n_train=300, n_heldout=50, n_sft=400, seed=3, tool_share=0.25, tools=TOOLS,
    )  # fmt: skip
    train, heldout, sft = (load_prompts(str(paths[k])) for k in ("train", "heldout", "sft"))
    prompts = [{r.prompt for r in split} for split in (train, heldout, sft)]
    assert [len(p) for p in prompts] == [300, 50, 400]
    assert not (prompts[0] & prompts[1]) and not (prompts[0] & prompts[2]) and not (prompts[1] & prompts[2])
    assert all(r.conversation is None and r.task == "math" for r in train + heldout)
    tool_calls = 0
    for record in sft:
        assert record.conversation is not None and record.conversation["tools"] == TOOLS
        messages = record.conversation["messages"]
        assert messages[0] == {"role": "user", "content": record.prompt}
        assert messages[-1] == {"role": "assistant", "content": f"#### {record.answer}"}
        if len(messages) == 4:
            tool_calls += 1
            arguments = json.loads(messages[1]["tool_calls"][0]["function"]["arguments"])
            assert str(calc(arguments["expr"])) == record.answer == messages[2]["content"]
    assert 0.15 < tool_calls / len(sft) < 0.35


def test_problems_are_products_the_model_cannot_do_in_its_head() -> None:
    for problem in make_calc_dataset(50, seed=0):
        assert 100 <= problem.a <= 999 and 10 <= problem.b <= 99 and 1 <= problem.c <= 9
        assert int(problem.answer) == problem.a * problem.b + problem.c == calc(problem.expression)
    with pytest.raises(ValueError, match="kind must be"):
        demonstration(make_calc_dataset(1, seed=0)[0], "maybe", TOOLS)


@pytest.mark.parametrize(
    ("conversation", "message"),
    [
        ("{not json", "field 'conversation' is not JSON"),
        (json.dumps({"messages": []}), "non-empty list 'messages'"),
        (json.dumps({"messages": [{"role": "robot", "content": "x"}]}), r"messages\[0\] must be an object whose role"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}]}), "no assistant message"),
        (json.dumps({"messages": [{"role": "assistant", "content": "x"}], "tools": {}}), "'tools' must be a list"),
    ],
)
def test_a_bad_conversation_is_refused_with_file_row_and_field(tmp_path: Path, conversation: str, message: str) -> None:
    good = json.dumps({"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "#### 2"}]})
    path = tmp_path / "sft.parquet"
    pq.write_table(pa.table({"prompt": ["1+1?", "2+2?"], "answer": ["2", "4"], "conversation": [good, conversation]}), path)
    with pytest.raises(DatasetError, match=message) as caught:
        load_prompts(str(path))
    assert str(path) in str(caught.value) and "row 1" in str(caught.value)


def test_the_calculator_tool_evaluates_integers_and_nothing_else() -> None:
    assert calc("482*37+5") == 482 * 37 + 5 and calc("-(3-10)*2") == 14
    for bad in ("__import__('os')", "2/3", "2**99999", "x+1", "1.5*2", ""):
        with pytest.raises(ValueError):
            calc(bad)
    assert run_tool("calc", json.dumps({"expr": "12*3"})) == "36"
    assert run_tool("calc", "{oops").startswith("error:")
    assert run_tool("calc", json.dumps({"expression": "1"})).startswith("error:")
    assert run_tool("shell", "{}") == "error: unknown tool 'shell'"
