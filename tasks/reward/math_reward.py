"""Math answers checked with math-verify, within a time budget.

math-verify interrupts itself with ``signal.alarm``, so it only works in a process's
main thread (the pool's workers and the CLI call it there). It is asked to raise
rather than return False on errors: an error is a ``verifier_error``, a timeout a
``timeout``, never a silent wrong answer.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from itertools import product
from typing import Any

from asyncrl.configs.reward import MathRewardConfig
from asyncrl.tasks.reward.types import Reason, RewardResult, failure

GSM8K_MARKER = "####"
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(,\d{3})+(\.\d+)?$")
_DELIMITED = re.compile(r"\$|\\boxed|\\\(|\\\[")


class _BudgetExceeded(Exception):
    """The math budget ran out between math-verify calls."""


def extract_gsm8k_answer(text: str) -> str | None:
    """The final answer of a GSM8K-style text: what follows the last ``####`` on its line.

    Returns None when there is no ``####`` or nothing follows it.
    """
    position = text.rfind(GSM8K_MARKER)
    if position < 0:
        return None
    answer = text[position + len(GSM8K_MARKER) :].strip().splitlines()
    if not answer:
        return None
    return answer[0].strip() or None


def normalise_answer_text(answer: str) -> str:
    """A bare answer as math-verify should read it.

    Thousands separators are dropped from plain numbers (``1,000`` -> ``1000``; inside
    ``$...$`` a comma would make a tuple), a trailing full stop is dropped, and an
    answer without LaTeX delimiters is wrapped in ``$...$`` so LaTeX such as
    ``\\sqrt{2}`` is found.
    """
    text = answer.strip().rstrip(".").strip()
    if _THOUSANDS.match(text):
        text = text.replace(",", "")
    if _DELIMITED.search(text):
        return text
    return f"${text}$"


def score_math(response: str, answer: str, config: MathRewardConfig) -> RewardResult:
    """Reward 1.0 if the response's final answer equals the gold answer, else 0.0 with a reason.

    The gold answer may be bare (``42``, ``\\frac{1}{2}``, ``0.5``), delimited
    (``$x^2$``, ``\\boxed{3}``) or a GSM8K solution ending in ``#### 42``. A response
    containing ``####`` is judged on what follows its last ``####``; otherwise
    math-verify extracts the final answer (``\\boxed{}`` first, then LaTeX, then plain
    expressions). The whole verification shares one budget of ``config.timeout_s``.
    """
    from math_verify import parse  # heavy (sympy): imported on first use, outside the budget

    start = time.monotonic()
    deadline = start + config.timeout_s
    gold_text = extract_gsm8k_answer(answer) or answer.strip()
    if not gold_text:
        return failure(Reason.BAD_REQUEST, "the gold answer is empty")
    try:
        gold = _call(deadline, lambda seconds: parse(normalise_answer_text(gold_text), parsing_timeout=seconds, raise_on_error=True))
        if not gold:
            gold = _call(deadline, lambda seconds: parse(gold_text, parsing_timeout=seconds, raise_on_error=True))
        if not gold:
            return failure(Reason.BAD_REQUEST, f"math-verify found no answer in the gold answer {gold_text!r}", _since(start))
        response_answer = extract_gsm8k_answer(response)
        if response_answer is not None:
            text = normalise_answer_text(response_answer)
            predicted = _call(deadline, lambda seconds: parse(text, parsing_timeout=seconds, raise_on_error=True))
        else:
            predicted = _call(deadline, lambda seconds: parse(response, parsing_timeout=seconds, raise_on_error=True))
        if not predicted:
            return failure(Reason.NO_ANSWER, "no final answer found in the response", _since(start))
        return _compare(gold, predicted, deadline, start, config)
    except _BudgetExceeded:
        return failure(Reason.TIMEOUT, f"math verification exceeded {config.timeout_s} s", _since(start))
    except Exception as exc:  # noqa: BLE001 - reported as verifier_error with its type and message
        return failure(Reason.VERIFIER_ERROR, f"math-verify raised {type(exc).__name__}: {exc}", _since(start))
    except BaseException as exc:
        # math-verify's TimeoutException derives from BaseException.
        if _is_timeout(exc):
            return failure(Reason.TIMEOUT, f"math-verify timed out (budget {config.timeout_s} s)", _since(start))
        raise


def _compare(gold: list[Any], predicted: list[Any], deadline: float, start: float, config: MathRewardConfig) -> RewardResult:
    """Any (gold, predicted) pair that math-verify finds equal makes the answer correct."""
    from math_verify import verify

    errors: list[str] = []
    for g, p in product(gold, predicted):
        try:
            equal = _call(deadline, lambda seconds: verify(g, p, timeout_seconds=seconds, raise_on_error=True))
        except (_BudgetExceeded, KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:  # noqa: BLE001 - collected and reported below
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        if equal:
            return RewardResult(reward=1.0, reason=Reason.OK, detail=f"answer {_shown(predicted)}", elapsed_s=_since(start))
    pairs = len(gold) * len(predicted)
    if errors and len(errors) == pairs:
        return failure(Reason.VERIFIER_ERROR, f"every comparison raised; first: {errors[0]}", _since(start))
    return failure(
        Reason.WRONG_ANSWER, f"expected {_shown(gold)}, got {_shown(predicted)}", _since(start)
    )


def _call(deadline: float, fn: Callable[[int], Any]) -> Any:
    """Call ``fn(seconds)`` with the whole seconds left in the budget (math-verify's alarm unit)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise _BudgetExceeded
    return fn(max(1, math.ceil(left)))


def _is_timeout(exc: BaseException) -> bool:
    from math_verify.errors import TimeoutException

    return isinstance(exc, TimeoutException)


def _shown(parsed: list[Any]) -> str:
    """The string math-verify extracted (parse() appends it last), shortened.

    Never str() of a sympy value: printing a huge expression can itself hang.
    """
    text = parsed[-1] if parsed and isinstance(parsed[-1], str) else "<expression>"
    return repr(text if len(text) <= 80 else text[:77] + "...")


def _since(start: float) -> float:
    return time.monotonic() - start
