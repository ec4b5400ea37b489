"""Fixtures of the trainer tests (a pytest plugin listed in tests/conftest.py, so they reach
tests/unit/trainer and tests/integration/trainer alike): a tiny model, one shared DeepSpeed
engine, synthetic trajectories.

The trainer tests' tiny model has its own shape (``TINY_SPEC``): it is ``trainer_model_dir``
here, and the conftest.py of tests/unit/trainer and tests/integration/trainer hands it to
their tests as ``tiny_model_dir`` (in place of the session's, tests/conftest.py).

DeepSpeed starts are expensive (seconds each, ~70 s the first time on a machine), so the
in-process tests share one engine for the whole session and reset it to its initial
state (weights, optimizer, scheduler) from a local DeepSpeed checkpoint.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from asyncrl.configs.trainer import OptimizerConfig
from asyncrl.storage.fs import RunRoot, open_root
from asyncrl.storage.schema import Sample
from asyncrl.tasks.model.tiny import TinyModelSpec, write_tiny_model

TINY_SPEC = TinyModelSpec(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=352)
TEST_LR = 1e-3
RUN_ID = "trainer-test"


@pytest.fixture(scope="session")
def trainer_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trainer tests' tiny model (``TINY_SPEC``), written once per session."""
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0, spec=TINY_SPEC)


@dataclass
class SharedEngine:
    engine: Any  # TrainEngine
    initial_dir: Path

    def reset(self) -> Any:
        """Restore the initial weights, optimizer and scheduler state; return the engine."""
        path, _ = self.engine.ds.load_checkpoint(str(self.initial_dir), tag="initial")
        assert path is not None
        return self.engine


@pytest.fixture(scope="session")
def shared_engine(trainer_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> SharedEngine:
    from asyncrl.tasks.trainer.engine import EngineSettings, build_engine

    # Logits in chunks of 64 positions (a run's default is 1024): the steps the trainer tests
    # take go through the chunked path with several chunks per micro-batch.
    settings = EngineSettings(optimizer=OptimizerConfig(lr=TEST_LR, grad_clip=1.0), zero_stage=1, logit_chunk_tokens=64)
    engine = build_engine(trainer_model_dir, settings)
    initial_dir = tmp_path_factory.mktemp("initial-ckpt")
    engine.ds.save_checkpoint(str(initial_dir), tag="initial", save_latest=False)
    return SharedEngine(engine, initial_dir)


@pytest.fixture
def engine(shared_engine: SharedEngine) -> Any:
    """The shared engine, reset to its initial state."""
    return shared_engine.reset()


@pytest.fixture
def run_root(tmp_path: Path) -> RunRoot:
    return open_root(str(tmp_path / "store"))


class Trajectories:
    """Builds synthetic prompt groups: prompts from the tiny tokenizer, random outputs."""

    def __init__(self, tokenizer: Any, seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)

    def prompt_ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def group(
        self,
        group_id: str,
        rewards: Sequence[float],
        *,
        prompt: str = "What is 3+4*2?\n",
        output_len: tuple[int, int] = (4, 12),
        versions: Sequence[int] | int = 0,
        logprobs: Callable[[list[int], list[int]], list[float]] | None = None,
    ) -> list[Sample]:
        """One group of len(rewards) samples. ``versions``: one version for all tokens, or
        per sample the version of its first token (later tokens one newer each 3 tokens,
        capped, so trajectories span versions). ``logprobs(prompt, output)`` gives the
        behaviour log-probs; default: random values in [-6, -0.05]."""
        prompt_ids = self.prompt_ids(prompt)
        samples = []
        for k, reward in enumerate(rewards):
            length = self.rng.randint(*output_len)
            output = [self.rng.randrange(32, 127) for _ in range(length)]
            if isinstance(versions, int):
                token_versions = [versions] * length
            else:
                token_versions = [versions[k]] * length
            behav = logprobs(prompt_ids, output) if logprobs else [-self.rng.uniform(0.05, 6.0) for _ in output]
            now = time.time()
            samples.append(
                Sample(
                    prompt_id=f"p-{group_id}",
                    group_id=group_id,
                    prompt_token_ids=prompt_ids,
                    output_token_ids=output,
                    behaviour_logprobs=behav,
                    token_versions=token_versions,
                    reward=float(reward),
                    finish_reason="stop",
                    submit_time=now - 1.0,
                    finish_time=now,
                )
            )
        return samples


@pytest.fixture
def trajectories(trainer_model_dir: Path) -> Trajectories:
    from transformers import AutoTokenizer

    return Trajectories(AutoTokenizer.from_pretrained(trainer_model_dir))


@pytest.fixture
def model_logprobs(engine: Any) -> Callable[[list[int], list[int]], list[float]]:
    """Behaviour log-probs from the (reset) engine's own policy, as a rollout would report."""
    from asyncrl.tasks.trainer.batch import TokenSequence
    from asyncrl.tasks.trainer.logprobs import sequence_logprobs

    def compute(prompt: list[int], output: list[int]) -> list[float]:
        values = sequence_logprobs(engine.ds, [TokenSequence(tuple(prompt), tuple(output))], [[0]])[0]
        return [min(float(v), 0.0) for v in values]

    return compute


@pytest.fixture(scope="session")
def hf_model(trainer_model_dir: Path) -> Iterator[Any]:
    from transformers import AutoModelForCausalLM

    yield AutoModelForCausalLM.from_pretrained(trainer_model_dir, attn_implementation="sdpa").eval()


def write_run_config(path: Path, *, model: Path, store: Path, data: Path, trainer: dict[str, Any]) -> Path:
    """The trainer's process config of a small run (small budgets, local storage), as the
    launcher writes it."""
    from process_config_files import write_process_config

    config = {
        "name": RUN_ID,
        "seed": 0,
        "work_dir": str(path.parent / "runs"),
        "model": {"path": str(model)},
        "data": {"train_path": str(data), "max_prompt_tokens": 64},
        "rollout": {"n_samples": 2, "max_new_tokens": 64, "eta": 4},
        "trainer": {"micro_batch_tokens": 256, "optimizer": {"lr": TEST_LR}, **trainer},
        "storage": {"root": str(store)},
    }
    return write_process_config(path, config, "trainer")


@pytest.fixture
def run_config_writer() -> Callable[..., Path]:
    return write_run_config
