"""The validated configuration of one asyncrl run: :class:`RunConfig` composes the sections
(one module each under ``asyncrl.configs``) and holds the rules that span sections.

Every field is typed and bounded; cross-field rules name the dotted fields they
involve. This module imports no heavy library, so `asyncrl --help` and config checks
stay instant.
"""

from __future__ import annotations

from pathlib import Path

from typing import Any

from pydantic import Field, model_validator

from asyncrl.configs.base import StrictModel
from asyncrl.configs.data import DataConfig
from asyncrl.configs.inference import InferenceConfig, moved_keys_error
from asyncrl.configs.model import ModelConfig
from asyncrl.configs.pipeline import PipelineConfig
from asyncrl.configs.placement import PlacementConfig, RunSettings
from asyncrl.configs.reward import RewardConfig
from asyncrl.configs.rollout import RolloutConfig
from asyncrl.configs.storage import StorageConfig
from asyncrl.configs.tracking import TrackingConfig
from asyncrl.configs.trainer import TrainerConfig


class RunConfig(StrictModel):
    name: str = Field(
        "asyncrl-run",
        min_length=1,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="Run name: the run's id in its records, and its scratch directory `<work_dir>/<name>/`.",
    )
    seed: int = Field(0, ge=0, description="Seed of the run's random choices (data, sampling, initialisation).")
    work_dir: str = Field("runs", description="Local scratch root: this run's logs, caches and metrics go under `<work_dir>/<name>/`.")
    model: ModelConfig = Field(description="The model the run starts from.")
    data: DataConfig = Field(description="Prompt files: RL, held-out and warm-start.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Generation: sampling, staleness, episodes, shards.")
    inference: InferenceConfig = Field(
        default_factory=InferenceConfig, description="The vLLM servers: how many, where they listen, their devices."
    )
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="RL training: batches, objective, optimizer, placement.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="The reward service: verifiers, sandbox, pool, plug-ins.")
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig, description="Stages around RL: data, SFT warm start, evaluation, registry.")
    storage: StorageConfig = Field(description="The run root (weights, trajectories, checkpoints) and how to reach it.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow tracking, pass@k and the mismatch canary.")
    run: RunSettings = Field(default_factory=RunSettings, description="Supervision of the components: restarts and start timeouts.")
    placement: PlacementConfig = Field(default_factory=PlacementConfig, description="Where each component runs: locally or as deployment flow runs.")

    @model_validator(mode="before")
    @classmethod
    def _no_moved_keys(cls, raw: Any) -> Any:  # noqa: ANN401 - the raw input
        """A config written before a key moved fails naming the key's new place
        (:data:`~asyncrl.configs.inference.MOVED_KEYS`), not as an unknown key."""
        moved = moved_keys_error(raw)
        if moved:
            raise ValueError(moved)
        return raw

    @model_validator(mode="after")
    def _placement_rules(self) -> RunConfig:
        if self.trainer.nodes > 1 and self.placement.trainer == "local":
            raise ValueError(
                f"trainer.nodes: {self.trainer.nodes} nodes need placement.trainer to name a deployment "
                "(one flow run per node); a local trainer runs on this machine only"
            )
        if self.placement.share_devices:
            return self
        servers = enumerate(self.inference.devices or [])
        sets = [(f"inference.devices[{k}]", self.placement.rollout_server, ids) for k, ids in servers]
        if self.trainer.devices is not None:
            sets.append(("trainer.devices", self.placement.trainer, self.trainer.devices))
        evaluator = self.pipeline.training_eval.devices
        if self.pipeline.eval_every and evaluator is not None:
            # the evaluator runs where the train flow runs: the local placement
            sets.append(("pipeline.training_eval.devices", "local", evaluator))
        for i, (name_a, place_a, ids_a) in enumerate(sets):
            for name_b, place_b, ids_b in sets[i + 1 :]:
                shared = sorted(set(ids_a) & set(ids_b))
                if shared and place_a == place_b:
                    raise ValueError(
                        f"{name_b}: devices {shared} are also in {name_a} on the same placement; give each "
                        "component its own devices, or set placement.share_devices: true to share them"
                    )
        return self

    @property
    def longest_sequence(self) -> int:
        """The longest prompt + output a server generates and the trainer takes:
        data.max_prompt_tokens + rollout.max_new_tokens, or with agent episodes the larger of
        that and rollout.episode.max_context_tokens (a later turn's prompt holds the earlier
        turns)."""
        single_turn = self.data.max_prompt_tokens + self.rollout.max_new_tokens
        episode = self.rollout.episode
        return single_turn if episode is None else max(single_turn, episode.max_context_tokens)

    @model_validator(mode="after")
    def _cross_field_rules(self) -> RunConfig:
        single_turn = self.data.max_prompt_tokens + self.rollout.max_new_tokens
        if self.trainer.micro_batch_tokens < single_turn:
            raise ValueError(
                f"trainer.micro_batch_tokens: {self.trainer.micro_batch_tokens} is smaller than one "
                f"sequence's maximum, data.max_prompt_tokens + rollout.max_new_tokens = {single_turn}"
            )
        episode = self.rollout.episode
        if episode is not None and self.trainer.micro_batch_tokens < episode.max_context_tokens:
            raise ValueError(
                f"trainer.micro_batch_tokens: {self.trainer.micro_batch_tokens} is smaller than one episode's "
                f"maximum, rollout.episode.max_context_tokens = {episode.max_context_tokens}"
            )
        for k in self.tracking.pass_k:
            if k > self.rollout.n_samples or k > self.pipeline.eval_samples:
                raise ValueError(
                    f"tracking.pass_k: pass@{k} needs at least {k} samples per prompt; rollout.n_samples = "
                    f"{self.rollout.n_samples}, pipeline.eval_samples = {self.pipeline.eval_samples}"
                )
        if self.trainer.advantage == "rloo" and self.rollout.n_samples < 2:
            raise ValueError("trainer.advantage: 'rloo' needs rollout.n_samples >= 2 (leave-one-out baseline)")
        if self.pipeline.synthetic_data is None and self.data.eval_path is None and self.pipeline.eval_prompts:
            raise ValueError("pipeline.eval_prompts: set data.eval_path to evaluate")
        if self.pipeline.eval_every and self.data.eval_path is None:
            raise ValueError(
                f"pipeline.eval_every: {self.pipeline.eval_every} evaluates held-out prompts during training; "
                "set data.eval_path (or set pipeline.eval_every: 0)"
            )
        evaluator = self.pipeline.training_eval.devices
        tp = self.inference.tensor_parallel_size
        if self.pipeline.eval_every and evaluator is not None and len(evaluator) != tp:
            raise ValueError(
                f"pipeline.training_eval.devices: {list(evaluator)} must be {tp} device ids "
                f"(inference.tensor_parallel_size={tp}): the evaluator's server shards the model as the rollout servers do"
            )
        synthetic = self.pipeline.synthetic_data
        if synthetic is not None and synthetic.task == "tool" and synthetic.n_sft > 0:
            tools = episode.options.get("tools") if episode is not None else None
            names = [t.get("function", {}).get("name") for t in tools if isinstance(t, dict)] if isinstance(tools, list) else []
            if "calc" not in names:
                raise ValueError(
                    "rollout.episode.options.tools: the tool task's demonstrations call the `calc` tool with the "
                    "tools the episode offers the model; list them there (OpenAI tool schemas, one named calc: "
                    "configs/demo-tool.yaml has it)"
                )
        if synthetic is not None and synthetic.n_sft > 0 and self.data.sft_path is None:
            raise ValueError("pipeline.synthetic_data.n_sft: set data.sft_path, where the warm-start problems go")
        for name in ("sft_answer_only_share", "sft_styles"):
            if synthetic is not None and getattr(synthetic, name) and synthetic.n_sft == 0:
                raise ValueError(
                    f"pipeline.synthetic_data.{name}: needs n_sft > 0 (it shapes the separate warm-start set)"
                )
        if self.data.train_folder and synthetic is not None:
            raise ValueError(
                f"data.train_path: {self.data.train_path!r} names a folder; pipeline.synthetic_data writes one "
                "file there: name a .parquet or .jsonl file, or remove pipeline.synthetic_data"
            )
        if self.data.require_new_files and synthetic is not None:
            raise ValueError(
                "data.require_new_files: pipeline.synthetic_data writes data.train_path in the data stage, after "
                "the run looked for new files; remove one of the two"
            )
        if self.data.train_folder and self.pipeline.sft_steps and self.data.sft_path is None:
            raise ValueError(
                "pipeline.sft_steps: the warm start would train on data.train_path, a folder whose files each "
                "run selects anew; set data.sft_path to the warm-start examples (or pipeline.sft_steps: 0)"
            )
        if self.trainer.mini_batches > self.trainer.batch_groups:
            raise ValueError(
                f"trainer.mini_batches: {self.trainer.mini_batches} exceeds trainer.batch_groups "
                f"{self.trainer.batch_groups}; each mini-batch needs at least one prompt group"
            )
        return self

    @property
    def run_work_dir(self) -> Path:
        """This run's local scratch directory: ``<work_dir>/<name>``."""
        return Path(self.work_dir) / self.name

    @property
    def max_staleness(self) -> int:
        """Bound on per-sample staleness: trainer.max_staleness, else rollout.eta."""
        return self.rollout.eta if self.trainer.max_staleness is None else self.trainer.max_staleness
