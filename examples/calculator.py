"""The calculator episode: the template of a user's multi-turn, tool-using episode.

The model gets an arithmetic question it cannot reliably work out in its head (a product
of a 3-digit and a 2-digit number, plus a small term), may call the ``calc`` tool, reads
the tool's result and answers ``#### <number>``; the row's math reward scores that final
message. ``configs/demo-tool.yaml`` trains the tiny model on it.

Everything here is ordinary user code: the official ``openai`` client, a loop over turns,
tools run by the episode itself. asyncrl records the tokens the model sampled at the
endpoint (``context.base_url``), so the trainer trains on exactly those tokens and on
nothing the tools or the chat template added.

Each tool call comes with an idempotency key (its ``id``, ``docs/agents.md``), the same when
the same turn of the same episode runs again. With ``rollout.episode.options.memo_dir`` set,
the tool keeps its results by key (:class:`ToolMemo`) and answers a repeated call from the
record: the template of a tool whose side effect must happen once. ``calc`` itself has none.
"""

from __future__ import annotations

import ast
import hashlib
import json
import operator
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrl.tasks.agent import EpisodeContext

MAX_TURNS = 3
"""Model calls per episode unless ``rollout.episode.options.max_turns`` says otherwise."""

_OPERATORS: dict[type[ast.operator], Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
}
_MAX_DIGITS = 60


def calc(expr: str) -> int:
    """The value of an integer expression over ``+ - *``, unary minus and parentheses;
    ``ValueError`` for anything else (names, calls, division, huge numbers)."""
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            result = _OPERATORS[type(node.op)](value(node.left), value(node.right))
            if len(str(abs(result))) > _MAX_DIGITS:
                raise ValueError("result too large")
            return result
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an expression: {exc.msg}") from None
    return value(tree.body)


class ToolMemo:
    """Results of tool calls by idempotency key, one JSON file per key under ``directory``
    (on disk, so a record outlives a crash of the process that made the call).

    A call whose key was recorded with the same tool and arguments is a repeat (a retry, a
    resumed turn): it gets the recorded result. A key recorded with other arguments is a turn
    the model sampled anew rather than a replay: the call is a new one, and its result
    replaces the record. A record is written under a temporary name and then renamed, so
    a crash leaves no record or a whole one."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    def _path(self, key: str) -> Path:
        return self.directory / f"{hashlib.sha256(key.encode()).hexdigest()}.json"

    def recall(self, key: str, name: str, arguments: str) -> str | None:
        """The result recorded for this call (``key``, same tool and arguments), else None."""
        try:
            record = json.loads(self._path(key).read_text())
        except FileNotFoundError:
            return None
        if record["key"] == key and record["call"] == [name, arguments]:
            return str(record["result"])
        return None

    def record(self, key: str, name: str, arguments: str, result: str) -> None:
        """Record ``result`` as the answer to this call (replacing any record of ``key``)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self._path(key)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps({"key": key, "call": [name, arguments], "result": result}))
        temporary.replace(path)


def run_tool(name: str, arguments: str, key: str | None = None, memo: ToolMemo | None = None) -> str:
    """What the episode sends back for one tool call: the result, or an error text the model
    reads (a bad call is the model's mistake, not the episode's). With a ``memo`` and the
    call's idempotency ``key``, a repeated call gets the first result without running again."""
    if memo is not None and key is not None:
        recalled = memo.recall(key, name, arguments)
        if recalled is not None:
            return recalled
    result = _calc_call(name, arguments)
    if memo is not None and key is not None:
        memo.record(key, name, arguments, result)
    return result


def _calc_call(name: str, arguments: str) -> str:
    """:func:`run_tool` without the memo: one call of ``calc``."""
    if name != "calc":
        return f"error: unknown tool {name!r}"
    try:
        args = json.loads(arguments)
        expr = args["expr"] if isinstance(args, dict) else None
        if not isinstance(expr, str):
            return "error: calc needs a string argument 'expr'"
        return str(calc(expr))
    except (ValueError, KeyError) as exc:
        return f"error: {exc}"


async def solve(context: EpisodeContext) -> float | None:
    """Ask, run the tools the model calls, send their results back; stop when the model
    answers without a tool call (or after ``max_turns`` calls). The row's math reward then
    scores the last assistant message (``return None``). Each call's ``id`` is its
    idempotency key (``context.tool_call_key(turn, index)``); results are kept by it under
    ``options.memo_dir`` when set."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=context.base_url, api_key=context.api_key, max_retries=0)
    tools = context.options["tools"]  # rollout.episode.options.tools: the calculator's schema
    memo_dir = context.options.get("memo_dir")
    memo = ToolMemo(memo_dir) if memo_dir else None
    messages: list[dict[str, Any]] = [{"role": "user", "content": context.row.prompt}]
    for _ in range(int(context.options.get("max_turns", MAX_TURNS))):
        reply = await client.chat.completions.create(model=context.model, messages=messages, tools=tools)  # type: ignore[arg-type]
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls or reply.choices[0].finish_reason == "length":
            break
        for call in message.tool_calls:
            result = run_tool(call.function.name, call.function.arguments, key=call.id, memo=memo)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None
