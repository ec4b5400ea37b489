"""Agent episodes on the real stack: a short RL run (tiny model, vLLM server, DeepSpeed
trainer, reward pool, MLflow) whose groups are runs of a user's two-turn episode written
with the official ``openai`` client. Each episode becomes one masked row: the tokens of
both model turns trained, the inserted user turn masked, turn boundaries recorded; an
episode that raises is recorded with reward 0 and its reason, the run goes on; the audit
(exactly-once, staleness rule) is clean."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ports import restartable_base_port

from asyncrl.configs.run_config import RunConfig
from asyncrl.storage.fs import open_root
from asyncrl.storage.shards import ShardReader
from asyncrl.chaos.audit import audit_run
from asyncrl.tasks.launch.rl import train_run

pytestmark = pytest.mark.slow

STEPS, ETA, B, N = 3, 1, 2, 4
FOLLOW_UP = "Say it again, shorter."

EPISODE = f'''
from openai import AsyncOpenAI

async def two_turns(context):
    client = AsyncOpenAI(base_url=context.base_url, api_key=context.api_key, max_retries=0)
    messages = [{{"role": "user", "content": context.row.prompt}}]
    first = await client.chat.completions.create(model=context.model, messages=messages, max_tokens=12)
    if context.sample_index == {N - 1}:  # one episode of every group fails after its first turn
        raise RuntimeError("the tool backend is down")
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({{"role": "user", "content": {FOLLOW_UP!r}}})
    second = await client.chat.completions.create(model=context.model, messages=messages, max_tokens=12)
    text = second.choices[0].message.content or ""
    return float(sum(ch in "aeiou" for ch in text) % 2)
'''


def test_a_run_of_two_turn_episodes_trains_on_the_model_tokens_only(tmp_path: Path, tiny_model_dir: Path) -> None:
    episode = tmp_path / "episodes.py"
    episode.write_text(EPISODE)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"Write {k}:", "answer": "0"}) + "\n" for k in range(16)))
    config = RunConfig.model_validate({
        "name": "episodes",
        "work_dir": str(tmp_path / "work"),
        "model": {"path": str(tiny_model_dir)},
        # a later turn's prompt (~90 tokens) is longer than max_prompt_tokens + max_new_tokens:
        # the servers must take rollout.episode.max_context_tokens
        "data": {"train_path": str(train), "max_prompt_tokens": 32},
        "rollout": {"n_samples": N, "max_new_tokens": 24, "eta": ETA, "shard_groups": B, "shard_seconds": 2.0,
                    "episode": {"function": f"{episode}:two_turns", "timeout_s": 120, "max_context_tokens": 256}},
        "inference": {"base_port": restartable_base_port()},
        "trainer": {"batch_groups": B, "max_steps": STEPS, "micro_batch_tokens": 512, "checkpoint_every": STEPS,
                    "optimizer": {"lr": 1.0e-3}},
        "reward": {"pool": {"workers": 1}},
        "storage": {"root": str(tmp_path / "store")},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "episodes"},
    })  # fmt: skip
    result = train_run(config)
    assert result.steps == STEPS

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    root = open_root(config.storage.root)
    reader = ShardReader(root, config.name)
    rows = [s for info in reader.list_shards() for group in reader.read_groups(info) for s in group]
    assert len(rows) >= STEPS * B * N - 1
    failed = [s for s in rows if s.finish_reason == "episode_error"]
    for sample in rows:
        mask, starts = sample.output_mask, sample.turn_starts
        assert mask is not None and starts is not None and len(mask) == len(sample.output_token_ids)
        if sample in failed:
            continue
        assert len(starts) == 2 and starts[0] == 0, starts  # two model turns
        inserted = [t for t, trained in zip(sample.output_token_ids, mask) if not trained]
        text = tokenizer.decode(inserted)
        assert FOLLOW_UP in text and "user" in text, text  # the follow-up is context, not trained
        assert all(lp == 0.0 for lp, trained in zip(sample.behaviour_logprobs, mask) if not trained)
        assert all(lp <= 0.0 for lp in sample.behaviour_logprobs)
    # the episode that raised after its first turn is recorded, with reward 0 and its reason;
    # no other episode failed
    groups = {s.group_id for s in rows}
    assert len(failed) == len(groups) and all(s.reward == 0.0 and s.turn_starts == [0] for s in failed)
    figures = result.scheduler
    assert figures["reasons/math/episode_error"] >= 1
    assert figures["context_tokens"] > 0
    report = audit_run(root, config.name, ETA, in_flight_ok=True)  # groups generating at the stop are in no shard
    assert report.ok, report.violations
