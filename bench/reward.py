"""`asyncrl bench reward`: verifications per second for math and code, by worker count.

Each row scores a fixed batch through a started, warmed-up pool:
verifications/s = items / wall seconds from submit to the batch's last result.
Pool start-up (interpreters, math-verify import) is excluded. ``--code-tests`` sets the
stdin/stdout tests per code item and ``--sandbox-per`` compares one sandbox per program with
one per test (``code.sandbox_per``).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from asyncrl.configs.reward import RewardConfig
from asyncrl.tasks.reward.pool import RewardPool
from asyncrl.tasks.reward.types import CodeTests, RewardRequest, StdioCase

_MATH_FORMS = (
    ("\\boxed{{{v}}}", "{v}"),
    ("The answer is $\\frac{{{n}}}{{{d}}}$.", "{q}"),
    ("so we get {v}", "{v}"),
    ("step...\n#### {v}", "#### {v}"),
)
_SUM_PROGRAM = "```python\na, b = map(int, input().split())\nprint(a {op} b)\n```"


@dataclass(frozen=True)
class BenchRow:
    kind: str
    workers: int
    items: int
    seconds: float
    verifications_per_s: float
    reasons: dict[str, int]


def math_requests(n: int, seed: int = 0) -> list[RewardRequest]:
    """n math items over the supported forms; about a third have a wrong answer."""
    rng = random.Random(seed)
    requests = []
    for i in range(n):
        response_form, answer_form = _MATH_FORMS[i % len(_MATH_FORMS)]
        d = rng.randint(2, 9)
        n_ = d * rng.randint(1, 50)
        v = n_ // d
        wrong = rng.random() < 1 / 3
        shown = v + 1 if wrong else v
        response = response_form.format(v=shown, n=shown * d, d=d)
        answer = answer_form.format(v=v, q=v)
        requests.append(RewardRequest("math", response, answer))
    return requests


def code_requests(n: int, seed: int = 0, tests_per_item: int = 2) -> list[RewardRequest]:
    """n code items (sum of two numbers, ``tests_per_item`` stdin/stdout tests); about a third are wrong."""
    if tests_per_item < 1:
        raise ValueError(f"code_requests: tests_per_item must be >= 1, got {tests_per_item}")
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        pairs = [(rng.randint(-100, 100), rng.randint(-100, 100)) for _ in range(tests_per_item)]
        tests = CodeTests(stdio=tuple(StdioCase(f"{a} {b}\n", f"{a + b}\n") for a, b in pairs))
        op = "-" if rng.random() < 1 / 3 else "+"
        requests.append(RewardRequest("code", _SUM_PROGRAM.format(op=op), tests))
    return requests


def run_reward_bench(
    config: RewardConfig,
    worker_counts: Sequence[int] = (1, 2),
    math_items: int = 200,
    code_items: int = 20,
    code_tests: int = 2,
) -> list[BenchRow]:
    """One row per (kind, worker count): verifications_per_s = items / seconds, where seconds
    runs from submitting the batch to its last result, in a started pool after a warm-up
    batch (so interpreter start and the math-verify import are not counted). A code item
    has ``code_tests`` stdin/stdout tests and counts as one verification."""
    rows: list[BenchRow] = []
    batches = {"math": math_requests(math_items), "code": code_requests(code_items, tests_per_item=code_tests)}
    for workers in worker_counts:
        with RewardPool(config, workers=workers) as pool:
            pool.score_sync(math_requests(2 * workers, seed=1) + code_requests(workers, seed=1))  # warm-up
            for kind, batch in batches.items():
                if not batch:
                    continue
                start = time.perf_counter()
                results = pool.score_sync(batch)
                seconds = time.perf_counter() - start
                reasons = Counter(r.reason.value for r in results)
                rows.append(BenchRow(kind, workers, len(batch), seconds, len(batch) / seconds, dict(reasons)))
    return rows


def format_bench_table(rows: Sequence[BenchRow]) -> str:
    header = f"{'kind':<6} {'workers':>7} {'items':>6} {'seconds':>8} {'verif/s':>9}  reasons"
    lines = [header, "-" * len(header)]
    for r in rows:
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(r.reasons.items()))
        lines.append(f"{r.kind:<6} {r.workers:>7} {r.items:>6} {r.seconds:>8.2f} {r.verifications_per_s:>9.1f}  {reasons}")
    return "\n".join(lines)


def bench_json(rows: Sequence[BenchRow]) -> dict[str, Any]:
    return {"benchmark": "reward", "rows": [asdict(r) for r in rows]}
