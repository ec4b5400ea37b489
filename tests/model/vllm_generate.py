"""Load a model directory in vLLM (CPU, float32), sample a few tokens, print JSON.

Run as a script (vLLM spawns its engine process, hence the __main__ guard):
    python vllm_generate.py MODEL_DIR PROMPT MAX_TOKENS
The last stdout line is ``RESULT_JSON {...}`` with the prompt token ids, the sampled
token ids, each sampled token's log-probability and the detokenised text.
"""

from __future__ import annotations

import json
import sys

RESULT_PREFIX = "RESULT_JSON "


def generate(model_dir: str, prompt: str, max_tokens: int) -> dict[str, object]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, logprobs=1, ignore_eos=True, seed=0)
    output = llm.generate([prompt], params)[0]
    completion = output.outputs[0]
    token_ids = list(completion.token_ids)
    assert completion.logprobs is not None
    logprobs = [position[token].logprob for position, token in zip(completion.logprobs, token_ids, strict=True)]
    return {
        "prompt_token_ids": list(output.prompt_token_ids or []),
        "token_ids": token_ids,
        "logprobs": logprobs,
        "text": completion.text,
        "finish_reason": completion.finish_reason,
    }


if __name__ == "__main__":
    result = generate(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    print(RESULT_PREFIX + json.dumps(result), flush=True)
