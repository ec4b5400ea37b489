"""The ``trainer`` section and its optimizer (also the SFT stage's, ``pipeline.sft_optimizer``)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from asyncrl.configs.base import StrictModel
from asyncrl.configs.cpus import check_cpu_cores

ZERO3_LIVE_ELEMENTS = 100_000_000
"""``trainer.zero3_live_elements``'s default (see there)."""


class OptimizerConfig(StrictModel):
    type: Literal["adamw"] = Field("adamw", description="Optimizer (AdamW only).")
    lr: float = Field(1e-5, gt=0.0, le=1.0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    betas: tuple[Annotated[float, Field(ge=0.0, lt=1.0)], Annotated[float, Field(ge=0.0, lt=1.0)]] = Field(
        (0.9, 0.999), description="AdamW (beta1, beta2)."
    )
    grad_clip: float | None = Field(1.0, gt=0.0, description="Clip the gradient norm to this; None: no clipping.")
    warmup_steps: int = Field(0, ge=0, description="Updates of linear learning-rate warm-up.")
    decay: Literal["constant", "cosine"] = Field(
        "constant", description="After warm-up: keep lr, or cosine-decay it to min_lr_ratio * lr by the last update."
    )
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="Final learning rate of the cosine decay, as a share of lr.")


LORA_TARGETS_QWEN2 = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(StrictModel):
    """Low-rank adapters (``trainer.lora``): each target linear W (d_out x d_in) becomes

        W x + (alpha / rank) * B A x,   A: rank x d_in,  B: d_out x rank,  B = 0 at the start

    so the first version equals the base model. Only A and B train (the optimizer holds
    nothing else) and a weight version is the adapter alone; rollout servers keep the base
    model and load each version as a vLLM LoRA adapter."""

    rank: int = Field(16, ge=1, le=512, description="r: rank of each adapter (vLLM serves ranks up to 512).")
    alpha: float = Field(32.0, gt=0.0, description="Scale numerator: the update is (alpha / rank) * B A.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input in training.")
    target_modules: tuple[str, ...] = Field(
        LORA_TARGETS_QWEN2, min_length=1, description="Names of the linear modules adapted (Qwen2's attention and MLP)."
    )


class TrainerConfig(StrictModel):
    batch_groups: int = Field(8, ge=1, description="B: prompt groups per training step.")
    mini_batches: int = Field(
        1, ge=1, description="Optimizer updates per step (the B groups are split into this many mini-batches)."
    )
    max_steps: int = Field(20, ge=1, description="Training steps of the RL stage.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Optimizer of the RL trainer.")
    objective: Literal["decoupled", "standard"] = Field(
        "decoupled", description="Decoupled PPO (behaviour / proximal / theta) or standard PPO for ablations."
    )
    eps_clip: float = Field(0.2, gt=0.0, lt=1.0, description="PPO clip range.")
    eps_clip_high: float | None = Field(
        None, gt=0.0, description="Separate upper clip (clip-higher); None uses eps_clip on both sides."
    )
    behav_weight_cap: float | None = Field(
        5.0, gt=1.0, description="Upper bound on the behaviour weight rho; None: no upper bound."
    )
    """rho = pi_prox / pi_behav at ``behav_weight_level``."""
    behav_cap_mode: Literal["mask", "clamp"] = Field(
        "mask", description="Outside the bounds: drop the token (`mask`) or truncate rho to the bound (`clamp`)."
    )
    """``mask`` drops the token (at a sequence level, the whole sample; "MIS", IcePop when
    two-sided); ``clamp`` truncates rho to the bound ("TIS")."""
    behav_weight_floor: float | None = Field(
        None, gt=0.0, lt=1.0, description="Lower bound on rho, making the bounds two-sided; None: upper bound only."
    )
    """Two-sided bounds [floor, cap] need ``behav_weight_cap``."""
    behav_weight_level: Literal["token", "sequence_product", "sequence_geo_mean"] = Field(
        "token", description="Which behaviour weight the bounds and the objective use: per token or per sample."
    )
    """Each token's w_t = pi_prox / pi_behav, or per sample (over its output tokens) their
    product prod_t w_t or geometric mean exp(mean_t log w_t), then carried by every token of
    the sample (:mod:`asyncrl.tasks.algo.corrections` has the formulas)."""
    advantage: Literal["grpo", "drgrpo", "rloo"] = Field("grpo", description="Group advantage estimator.")
    negative_advantage_scale: float = Field(
        1.0, ge=0.0, le=1.0, description="Factor on below-mean advantages; 0 trains on better-than-mean samples only."
    )
    """A' = A for A >= 0, scale * A for A < 0 (:func:`asyncrl.tasks.algo.advantages.scale_negative_advantages`)."""
    kl_coef: float = Field(
        0.0, ge=0.0, description="beta of the KL penalty to the reference policy (the run's first weights); 0: none."
    )
    """loss += beta * mean_t k3_t, k3_t = exp(d_t) - d_t - 1, d_t = log pi_ref - log pi_theta
    (:func:`asyncrl.tasks.algo.loss.reference_kl_loss`). The trainer holds a frozen full copy of
    the reference on each rank (LoRA: none, the base with its adapters off)."""
    micro_batch_tokens: int = Field(4096, ge=1, description="Token budget of one micro-batch (dynamic micro-batching).")
    logit_chunk_tokens: int | None = Field(
        1024,
        ge=1,
        description="Positions whose logits are computed at once (recomputed in backward); None: a micro-batch at once.",
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each decoder layer's activations in backward instead of keeping them."
    )
    """Transformers' gradient checkpointing (non-reentrant): a micro-batch keeps each layer's
    input (tokens x hidden) instead of all its intermediate activations, for one more forward
    pass of the decoder in backward; gradients are unchanged."""
    deterministic: bool = Field(True, description="Deterministic kernels, so that `asyncrl replay` reproduces a run bit for bit.")
    """On GPUs torch's deterministic algorithms and a fixed cuBLAS workspace; CPU kernels
    already are deterministic (docs/replay.md)."""
    lora: LoraConfig | None = Field(None, description="Train low-rank adapters instead of every weight; None: full fine-tuning.")
    packer: Literal["ffd"] = Field("ffd", description="How sequences are packed into micro-batches (first-fit decreasing).")
    zero_stage: Literal[0, 1, 2, 3] = Field(
        1,
        description="DeepSpeed ZeRO stage; 3 also partitions the parameters.",
    )
    """Stage 1 partitions the optimizer state over the data-parallel ranks, 2 the gradients
    too, 3 the parameters too: the model is built partitioned, every forward pass gathers
    each layer's parameters from all ranks, and a publish gathers one parameter at a time,
    so no rank holds the whole model; ``logit_chunk_tokens`` holds at every stage. Checkpoints of every
    stage resume at another world size (re-partitioned on load). With one process, stage 0
    holds the least: there is nothing to partition, and the stage 1-2 optimizer keeps its own
    float32 copy of the parameters beside the model's."""
    zero3_live_elements: int | None = Field(
        ZERO3_LIVE_ELEMENTS,
        ge=1_000_000,
        description="ZeRO 3: parameter elements a rank keeps gathered or buffered at once; None: DeepSpeed's defaults.",
    )
    """Sets DeepSpeed's ``stage3_max_live_parameters``, ``stage3_max_reuse_distance`` and
    ``sub_group_size`` to N and ``reduce_bucket_size`` to N / 2, so a rank holds beyond its
    partition at most about N gathered parameters, an N / 2 gradient bucket and an N-element
    optimizer sub-group: 4 x 2.5 N bytes in float32 (DeepSpeed's defaults, 1e9 and 5e8, are
    sized for accelerators with memory to spare and let a rank gather the whole model).
    Fewer elements mean more, smaller gathers; stages 0-2 ignore it."""
    checkpoint_every: int = Field(5, ge=1, description="Save a trainer checkpoint every this many steps.")
    keep_versions: int = Field(0, ge=0, description="Weight versions kept in the store beyond those the run still needs.")
    """Those the run needs: the current one, those within max_staleness + 1 updates of it,
    checkpoints', registered and the initial one; 0 prunes everything else after each publish."""
    max_staleness: int | None = Field(None, ge=0, description="Drop samples staler than this (default: rollout.eta).")
    cpu_cores: tuple[int, ...] | None = Field(
        None, description="CPU ids the trainer process (and its workers) is pinned to; None = no pinning."
    )
    threads: int | None = Field(
        None, ge=1, description="CPU threads of each RL trainer process (OMP_NUM_THREADS); None: shared out."
    )
    """PyTorch's intra-op threads. None: the trainer's CPUs shared out among the processes
    computing on them at once (see ``trainer_threads``); spinning OpenMP threads on CPUs
    that a rollout server also uses slows training steps many times over. The SFT stage, alone
    on the machine, uses every CPU."""

    processes: int = Field(1, ge=1, description="Data-parallel trainer processes per node, one per device.")
    """Above 1 the trainer runs under ``torchrun`` with DeepSpeed ZeRO (``zero_stage``) across
    them, gloo on CPU and NCCL on GPUs."""
    nodes: int = Field(1, ge=1, description="Trainer nodes, `processes` each.")
    """Above 1 every node is one flow run of ``placement.trainer``'s deployment and they meet at
    ``rendezvous``."""
    rendezvous: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.:\[\]-]+:[0-9]{1,5}$",
        description="`host:port` of torchrun's c10d rendezvous (`trainer.nodes` > 1).",
    )
    devices: tuple[int, ...] | None = Field(
        None, description="Device ids of the trainer on its node, one per process; None: no placement."
    )
    """``processes`` of them: GPU ids (``CUDA_VISIBLE_DEVICES``) on a GPU machine, CPU ids
    (pinning) on a machine without GPUs."""

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
    def _lora_stage(self) -> TrainerConfig:
        # ZeRO 3 partitions the base weights; publishing an adapter or merging one would
        # need gathers the LoRA path does not do (stages 0-2 hold whole weights on every rank).
        if self.lora is not None and self.zero_stage == 3:
            raise ValueError("trainer.lora: not supported with trainer.zero_stage 3; use 0-2")
        return self

    @model_validator(mode="after")
    def _kl_stage(self) -> TrainerConfig:
        if self.kl_coef > 0 and self.zero_stage == 3 and self.lora is None:
            raise ValueError(
                "trainer.kl_coef: the reference policy is a whole model on every rank, which ZeRO stage 3 "
                "exists to avoid; use trainer.zero_stage 0-2 or kl_coef 0"
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
