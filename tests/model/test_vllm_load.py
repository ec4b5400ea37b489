"""The tiny model loads in vLLM (CPU, float32) and its sampled log-probs match transformers'."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("vllm_generate.py")
RESULT_PREFIX = "RESULT_JSON "
PROMPT = "What is 3+4*2-5?"
MAX_TOKENS = 8


def run_vllm(model_dir: Path) -> dict[str, object]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), str(model_dir), PROMPT, str(MAX_TOKENS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,  # ~2 min alone on 2 cores; several times that beside other heavy jobs
    )
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    lines = [line for line in completed.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    assert len(lines) == 1, completed.stdout[-4000:]
    return json.loads(lines[0][len(RESULT_PREFIX) :])


@pytest.mark.slow
def test_vllm_generates_with_logprobs_matching_transformers(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = run_vllm(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    token_ids = result["token_ids"]
    assert result["prompt_token_ids"] == prompt_ids
    assert isinstance(token_ids, list) and len(token_ids) == MAX_TOKENS
    assert result["finish_reason"] == "length"

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.tensor([prompt_ids + token_ids])  # (1, P + G)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].double(), dim=-1)  # (P + G, V)
    positions = torch.arange(len(prompt_ids) - 1, len(prompt_ids) - 1 + MAX_TOKENS)
    expected = logprobs[positions, torch.tensor(token_ids)]  # (G,)
    vllm_logprobs = torch.tensor(result["logprobs"], dtype=torch.float64)
    # The tolerance is far below the spread of this model's log-probs over the vocabulary.
    assert logprobs[positions].std(dim=-1).min() > 0.05
    assert torch.allclose(vllm_logprobs, expected, atol=2e-3), (vllm_logprobs, expected)

    # vLLM holds back a trailing incomplete UTF-8 sequence that transformers shows as U+FFFD.
    decoded = tokenizer.decode(token_ids, skip_special_tokens=True)
    assert str(result["text"]).rstrip("\ufffd") == decoded.rstrip("\ufffd")
