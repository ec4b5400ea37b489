"""Math rewards with the real math-verify: every answer form, right and wrong, and its failures."""

from __future__ import annotations

import threading
import time

import pytest

from asyncrl.configs.reward import MathRewardConfig
from asyncrl.tasks.reward.math_reward import extract_gsm8k_answer, normalise_answer_text, score_math
from asyncrl.tasks.reward.types import Reason, RewardResult

CONFIG = MathRewardConfig(timeout_s=5)
GSM8K_GOLD = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)

# (form, response, gold answer)
CORRECT = [
    ("boxed", "Adding up, the total is \\boxed{42}.", "42"),
    ("boxed-expression", "So $x = \\boxed{2\\sqrt{3}}$", "2\\sqrt{3}"),
    ("fraction-latex", "The probability is $\\frac{3}{4}$.", "0.75"),
    ("fraction-dfrac", "Hence \\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}"),
    ("fraction-slash", "The ratio is 3/4", "\\frac{3}{4}"),
    ("latex-sqrt", "We get $\\sqrt{2}$ in the end.", "2^{1/2}"),
    ("latex-polynomial", "Expanding gives $\\boxed{x^2 + 2x + 1}$", "(x+1)^2"),
    ("plain-integer", "The final answer is 17.", "17"),
    ("plain-negative", "So the result is -3", "-3"),
    ("plain-decimal", "It costs 2.50 dollars, so 2.50", "2.5"),
    ("plain-thousands", "They sold 1,000 tickets in total: 1,000", "1000"),
    ("gsm8k-marker", "48/2 = 24 in May, 48 + 24 = 72 in total.\n#### 72", GSM8K_GOLD),
    ("gsm8k-marker-plain-gold", "reasoning...\n#### 1,250", "1250"),
]
WRONG = [
    ("boxed", "Adding up, the total is \\boxed{41}.", "42"),
    ("boxed-expression", "So $x = \\boxed{3\\sqrt{2}}$", "2\\sqrt{3}"),
    ("fraction-latex", "The probability is $\\frac{2}{3}$.", "0.75"),
    ("fraction-slash", "The ratio is 4/3", "\\frac{3}{4}"),
    ("latex-sqrt", "We get $\\sqrt{3}$ in the end.", "\\sqrt{2}"),
    ("latex-polynomial", "Expanding gives $\\boxed{x^2 + x + 1}$", "(x+1)^2"),
    ("plain-integer", "The final answer is 18.", "17"),
    ("plain-negative", "So the result is 3", "-3"),
    ("gsm8k-marker", "48 + 24 = 73\n#### 73", GSM8K_GOLD),
    # The number after the last #### decides, not a correct number elsewhere.
    ("gsm8k-last-marker", "I first thought 72.\n#### 70", GSM8K_GOLD),
]


@pytest.mark.parametrize(("form", "response", "answer"), CORRECT, ids=[c[0] for c in CORRECT])
def test_correct_answers_score_one(form: str, response: str, answer: str) -> None:
    result = score_math(response, answer, CONFIG)
    assert (result.reward, result.reason) == (1.0, Reason.OK), (form, result)


@pytest.mark.parametrize(("form", "response", "answer"), WRONG, ids=[c[0] for c in WRONG])
def test_wrong_answers_score_zero_with_reason(form: str, response: str, answer: str) -> None:
    result = score_math(response, answer, CONFIG)
    assert (result.reward, result.reason) == (0.0, Reason.WRONG_ANSWER), (form, result)
    assert result.detail.startswith("expected ")


def test_response_without_an_answer() -> None:
    result = score_math("I am not sure how to solve this.", "42", CONFIG)
    assert (result.reward, result.reason) == (0.0, Reason.NO_ANSWER)


def test_empty_gold_answer_is_a_bad_request() -> None:
    result = score_math("\\boxed{1}", "  ", CONFIG)
    assert (result.reward, result.reason) == (0.0, Reason.BAD_REQUEST)


def test_pathological_expression_times_out_within_budget() -> None:
    start = time.monotonic()
    result = score_math("\\boxed{9^{9^{9^{9}}}}", "5", MathRewardConfig(timeout_s=1))
    elapsed = time.monotonic() - start
    assert (result.reward, result.reason) == (0.0, Reason.TIMEOUT), result
    assert elapsed < 5


def test_verifier_crash_is_reported_not_swallowed() -> None:
    # math-verify's signal-based timeout cannot work outside the main thread: it raises.
    results: list[RewardResult] = []
    thread = threading.Thread(target=lambda: results.append(score_math("\\boxed{1}", "1", CONFIG)))
    thread.start()
    thread.join()
    (result,) = results
    assert (result.reward, result.reason) == (0.0, Reason.VERIFIER_ERROR)
    assert "threaded environment" in result.detail


@pytest.mark.parametrize(
    ("text", "expected"),
    [("x\n#### 72", "72"), ("#### 1\nmore\n#### 2 \n", "2"), ("no marker", None), ("ends ####", None)],
)
def test_extract_gsm8k_answer(text: str, expected: str | None) -> None:
    assert extract_gsm8k_answer(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1,000", "$1000$"), ("\\frac{1}{2}", "$\\frac{1}{2}$"), ("$x$", "$x$"), ("\\boxed{3}", "\\boxed{3}"), ("7.", "$7$")],
)
def test_normalise_answer_text(text: str, expected: str) -> None:
    assert normalise_answer_text(text) == expected
