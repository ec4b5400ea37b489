"""DeepSpeed setup of the trainer: process group, model, optimizer, HF-format export.

One :class:`TrainEngine` holds the DeepSpeed engine of the policy and the facts the
rest of the trainer needs (vocabulary size, tokenizer). Gradient accumulation is
*unmanaged* (``managed_gradient_accumulation: false``): every ``backward`` adds to the
gradients and every ``step`` is an optimizer update, so a mini-batch may have any
number of dynamic micro-batches. ZeRO stage 3 partitions the parameters too: the model
is built partitioned and published by gathering one parameter at a time
(:mod:`asyncrl.tasks.trainer.zero3`), and every forward pass is a collective.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from asyncrl.configs.trainer import ZERO3_LIVE_ELEMENTS, LoraConfig, OptimizerConfig
from asyncrl.tasks.system.network import listen_port
from asyncrl.tasks.trainer.zero3 import (
    WEIGHTS_FILE,
    build_partitioned_model,
    full_shape,
    parameters_partitioned,
    write_gathered_safetensors,
)

if TYPE_CHECKING:
    import torch
    from deepspeed import DeepSpeedEngine
    from transformers import PreTrainedTokenizerBase

Dtype = Literal["float32", "bfloat16", "float16"]
SUPPORTED_ZERO_STAGES = (0, 1, 2, 3)
# Copied byte for byte from the source model directory: re-serialising a tokenizer through
# transformers can rewrite its files (e.g. add a pre-tokenizer), which vLLM would then load.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
DIST_ENV_DEFAULTS = {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}


@dataclass(frozen=True)
class EngineSettings:
    """What building the engine needs besides the model directory."""

    optimizer: OptimizerConfig
    zero_stage: int = 1
    dtype: Dtype = "float32"
    attn_implementation: str = "sdpa"
    """transformers attention kernel; packed sequences are isolated by position_ids, which
    sdpa, eager and flash_attention_2 all honour."""
    seed: int = 0
    total_updates: int | None = None
    """Optimizer updates the run will make (for a decaying learning rate)."""
    logit_chunk_tokens: int | None = None
    """Positions whose logits are computed at once (:func:`asyncrl.tasks.trainer.logprobs.micro_batch_logprobs`)."""
    activation_checkpointing: bool = False
    """Recompute decoder layers' activations in backward (:func:`enable_activation_checkpointing`)."""
    zero3_persistence_threshold: int | None = None
    """ZeRO 3: parameters of at most this many elements stay whole on every rank
    (``stage3_param_persistence_threshold``); None: DeepSpeed's default, 1e5. 0 partitions
    every parameter (the tests' tiny model has none above 1e5)."""
    zero3_live_elements: int | None = ZERO3_LIVE_ELEMENTS
    """ZeRO 3: elements gathered or buffered at once per rank (``trainer.zero3_live_elements``);
    None: DeepSpeed's defaults."""
    lora: LoraConfig | None = None
    """Train low-rank adapters on the frozen model (:mod:`asyncrl.tasks.trainer.lora`);
    None: every weight trains. ZeRO stages 0-2 only."""
    initial_adapter: Path | None = None
    """With ``lora``: a published adapter directory whose A and B the adapters start from
    (a LoRA run's latest version); None: fresh adapters (B = 0)."""
    base_model_reference: str | None = None
    """With ``lora``: what published adapters name as their base model
    (``base_model_name_or_path``, the run's ``model.path``); None: the directory loaded."""
    deterministic: bool = True
    """``trainer.deterministic``: torch's deterministic algorithms (warning, not failing, on an
    op that has none: the replay then names the difference) and no cuDNN autotuning; cuBLAS's
    fixed workspace comes from the launch's environment
    (:data:`~asyncrl.tasks.trainer.process.DETERMINISTIC_ENV`)."""


@dataclass
class TrainEngine:
    """The DeepSpeed engine of the policy and the facts derived from its model."""

    ds: DeepSpeedEngine
    tokenizer: PreTrainedTokenizerBase
    vocab_size: int
    model_dir: Path
    """Directory the weights were first loaded from (its tokenizer is re-published)."""
    logit_chunk_tokens: int | None = None
    """Positions whose logits are computed at once for log-probs (None: a micro-batch at once)."""
    lora: LoraConfig | None = None
    """The adapters trained (``module`` is then a PEFT model over the frozen base in
    ``model_dir``; a weight version is the adapter alone); None: full fine-tuning."""

    @property
    def module(self) -> torch.nn.Module:
        return self.ds.module

    @property
    def rank(self) -> int:
        return int(self.ds.global_rank)

    @property
    def world_size(self) -> int:
        return int(self.ds.world_size)

    @property
    def parameters_partitioned(self) -> bool:
        """Whether ZeRO stage 3 partitions the parameters (forward passes are collective)."""
        return parameters_partitioned(self.module)

    def learning_rate(self) -> float:
        return float(self.ds.get_lr()[0])


def single_process_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables ``torch.distributed`` needs, filled in for one local process where absent.

    MASTER_ADDR=127.0.0.1, MASTER_PORT=<a free port below the outgoing range, :func:`listen_port`>, RANK=0, WORLD_SIZE=1, LOCAL_RANK=0;
    values already set (by ``deepspeed`` or ``torchrun``) are kept.
    """
    source = os.environ if environ is None else environ
    filled = {key: source.get(key, default) for key, default in DIST_ENV_DEFAULTS.items()}
    filled["MASTER_PORT"] = source.get("MASTER_PORT") or str(listen_port())
    return filled


def on_cpu_accelerator() -> bool:
    """Whether DeepSpeed runs on its CPU accelerator (no GPU found)."""
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().device_name() == "cpu")


def init_distributed() -> None:
    """Initialise the process group once: gloo on CPU, the accelerator's backend otherwise.

    On an accelerator the process's device is set first, to its local rank (as the
    DeepSpeed engine sets it later): collectives before the engine exists (e.g. agreeing
    on the initial weights) then use one device per process, not all device 0."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    if dist.is_initialized():
        return
    os.environ.update(single_process_env())
    if on_cpu_accelerator():
        backend = "gloo"
    else:
        get_accelerator().set_device(int(os.environ["LOCAL_RANK"]))
        backend = get_accelerator().communication_backend_name()
    deepspeed.init_distributed(dist_backend=backend)


def deepspeed_config(settings: EngineSettings, *, torch_adam: bool = False) -> dict[str, Any]:
    """The DeepSpeed config dict: AdamW, optional clipping, ZeRO stage, unmanaged accumulation.

    ``torch_adam`` selects ``torch.optim.AdamW`` instead of DeepSpeed's fused Adam. The
    CPU accelerator's fused Adam is a C++ op compiled on first use (about a minute on two
    cores, once per environment); torch's own fused CPU kernel (``fused=True``) needs no
    build and updates each parameter in place, where its default per-tensor path allocates
    two temporaries the size of the largest parameter (the 151,936-row embedding of a Qwen
    model) at every step.
    """
    opt = settings.optimizer
    adam_params: dict[str, Any] = {"lr": opt.lr, "betas": list(opt.betas), "weight_decay": opt.weight_decay, "eps": 1e-8}
    if torch_adam:
        adam_params.update(torch_adam=True, fused=True)
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "optimizer": {
            "type": "AdamW",
            "params": adam_params,
        },
        "gradient_clipping": opt.grad_clip or 0.0,
        "zero_optimization": _zero_config(settings),
        "bf16": {"enabled": settings.dtype == "bfloat16"},
        "fp16": {"enabled": settings.dtype == "float16"},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def _zero_config(settings: EngineSettings) -> dict[str, Any]:
    """The ``zero_optimization`` section: the stage, and for stage 3 the persistence threshold
    and the live elements N (``stage3_max_live_parameters`` = ``stage3_max_reuse_distance`` =
    ``sub_group_size`` = N, ``reduce_bucket_size`` = N / 2).

    Stage 3 keeps DeepSpeed's ``memory_efficient_linear`` (on): its ``zero.Init`` then
    replaces ``torch.nn.functional.linear`` for the rest of the process with a version
    whose autograd saves the parameter, not the gathered weight, so backward re-gathers it
    instead of every layer's full weight staying alive from forward to backward. Checkpoint
    saves keep the parameters partitioned (no ``gather_16bit_weights_on_model_save``)."""
    zero: dict[str, Any] = {"stage": settings.zero_stage}
    if settings.zero_stage == 3 and settings.zero3_persistence_threshold is not None:
        zero["stage3_param_persistence_threshold"] = settings.zero3_persistence_threshold
    if settings.zero_stage == 3 and settings.zero3_live_elements is not None:
        live = settings.zero3_live_elements
        zero.update(stage3_max_live_parameters=live, stage3_max_reuse_distance=live, sub_group_size=live,
                    reduce_bucket_size=live // 2)  # fmt: skip
    return zero


def lr_factor(update: int, optimizer: OptimizerConfig, total_updates: int | None) -> float:
    """Learning-rate multiplier of optimizer update ``update`` (0-based), W = warmup_steps:

        warm-up (update < W):   (update + 1) / W          (the first update already moves)
        constant after W:       1
        cosine after W:         m + (1 - m) * (1 + cos(pi * p)) / 2,
                                p = min(1, (update - W) / max(1, T - W - 1)), m = min_lr_ratio

    with T = ``total_updates``; cosine needs T (without it the rate stays constant).
    """
    warmup = optimizer.warmup_steps
    if update < warmup:
        return (update + 1) / warmup
    if optimizer.decay == "constant" or total_updates is None:
        return 1.0
    progress = min(1.0, (update - warmup) / max(1, total_updates - warmup - 1))
    low = optimizer.min_lr_ratio
    return low + (1.0 - low) * (1.0 + math.cos(math.pi * progress)) / 2.0


def _lr_scheduler(optimizer_config: OptimizerConfig, total_updates: int | None) -> Any:
    import torch

    def make(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda update: lr_factor(update, optimizer_config, total_updates)
        )

    return make


def build_engine(model_dir: Path, settings: EngineSettings) -> TrainEngine:
    """Load the HF causal LM in ``model_dir`` and wrap it in a DeepSpeed engine.

    ZeRO stage 3 builds the model partitioned (no rank ever holds all of it:
    :func:`~asyncrl.tasks.trainer.zero3.build_partitioned_model`); collective with several
    ranks. With ``settings.lora`` the model is wrapped with LoRA adapters first
    (:func:`~asyncrl.tasks.trainer.lora.apply_lora`): the base is frozen and the optimizer
    holds the adapters alone. ``ValueError`` for a stage outside SUPPORTED_ZERO_STAGES, or
    LoRA with stage 3.
    """
    if settings.zero_stage not in SUPPORTED_ZERO_STAGES:
        raise ValueError(
            f"trainer.zero_stage: {settings.zero_stage} is not supported by this trainer; "
            f"use one of {list(SUPPORTED_ZERO_STAGES)}"
        )
    if settings.lora is not None and settings.zero_stage == 3:
        raise ValueError("trainer.lora: not supported with trainer.zero_stage 3; use 0-2")
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    init_distributed()
    torch.manual_seed(settings.seed)
    if settings.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
    model_dir = Path(model_dir)
    config = deepspeed_config(settings, torch_adam=on_cpu_accelerator())
    dtype = getattr(torch, settings.dtype)
    if settings.zero_stage == 3:
        model = build_partitioned_model(model_dir, config, dtype, settings.attn_implementation, dist.get_rank())
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=settings.attn_implementation)
    if settings.activation_checkpointing:
        enable_activation_checkpointing(model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab_size = full_shape(model.get_input_embeddings().weight)[0]
    if settings.lora is not None:
        from asyncrl.tasks.trainer.lora import apply_lora

        model = apply_lora(
            model,
            settings.lora,
            base_model_reference=settings.base_model_reference,
            initial_adapter=settings.initial_adapter,
        )
    opt = settings.optimizer
    scheduled = opt.warmup_steps > 0 or (opt.decay != "constant" and settings.total_updates is not None)
    scheduler = _lr_scheduler(opt, settings.total_updates) if scheduled else None
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=config,
        lr_scheduler=scheduler,
    )
    skip_single_rank_allreduce(engine)
    return TrainEngine(
        ds=engine,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        model_dir=model_dir,
        logit_chunk_tokens=settings.logit_chunk_tokens,
        lora=settings.lora,
    )


def skip_single_rank_allreduce(engine: DeepSpeedEngine) -> None:
    """Turn off the gradient all-reduce of a one-rank engine without ZeRO: DeepSpeed would
    still copy every gradient into flat buckets (of up to 5e8 elements), "reduce" them over
    one rank (x 1 / world size = x 1) and copy them back, a transient second copy of all
    gradients for no change in any value. Stages 1-3 reduce through their own optimizer."""
    if engine.world_size == 1 and engine.zero_optimization_stage() == 0:
        engine.enable_backward_allreduce = False


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Have ``model`` (an HF causal LM) recompute each decoder layer in backward: autograd
    then keeps a layer's input, not its attention and MLP intermediates, so activation
    memory per token falls from ~L x (one layer's intermediates) to ~L x hidden + one
    layer's intermediates, for one more decoder forward per backward. Non-reentrant
    checkpointing, so gradients equal the plain ones; the chunked head
    (:class:`~asyncrl.tasks.trainer.chunked_head.ChunkedHeadLogprobs`) runs after it. It acts
    in training mode only (the no-grad log-prob passes are unchanged)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


def save_hf_weights(engine: TrainEngine, out_dir: Path, extra_files: dict[str, str] | None = None) -> Path:
    """Write the current policy as a weight version: an HF model directory (safetensors,
    config, tokenizer), or for a LoRA engine (``engine.lora``) the adapter alone, a PEFT
    adapter directory (:func:`~asyncrl.tasks.trainer.lora.save_adapter`).

    Collective: every rank calls it; rank 0 writes, the others only take part in the
    gathers of ZeRO stage 3 (stages 0-2 keep full parameters in every rank's module: they
    return at once). Under stage 3 the weights are gathered one parameter at a time into
    one ``model.safetensors`` (:func:`~asyncrl.tasks.trainer.zero3.write_gathered_safetensors`),
    with the names, shapes and dtypes ``save_pretrained`` writes at stages 0-2 (tied
    copies dropped alike). Tokenizer files are copied unchanged from ``engine.model_dir``
    (see TOKENIZER_FILES; saved through transformers only if the directory has none).
    ``extra_files`` maps file names to text written alongside (e.g. lineage JSON).
    Loadable by ``AutoModelForCausalLM.from_pretrained`` and by vLLM (an adapter: by
    ``peft.PeftModel.from_pretrained`` and vLLM's LoRA loader).
    """
    if engine.lora is not None:
        from asyncrl.tasks.trainer.lora import save_adapter

        return save_adapter(engine.module, engine.model_dir, engine.rank, Path(out_dir), extra_files)
    out_dir = Path(out_dir)
    writer = engine.rank == 0
    partitioned = engine.parameters_partitioned
    if not writer and not partitioned:
        return out_dir
    if writer:
        out_dir.mkdir(parents=True, exist_ok=True)
        if partitioned:  # an empty state dict: config.json and generation_config.json only
            engine.module.save_pretrained(out_dir, state_dict={})
        else:  # full parameters in the module; save_pretrained drops tied copies
            engine.module.save_pretrained(out_dir, safe_serialization=True)
    if partitioned:
        write_gathered_safetensors(engine.module, out_dir / WEIGHTS_FILE if writer else None)
    if writer:
        write_side_files(engine, out_dir, extra_files or {})
    return out_dir


def write_side_files(engine: TrainEngine, out_dir: Path, extra_files: dict[str, str]) -> None:
    """The tokenizer files (copied from ``engine.model_dir``) and ``extra_files`` into ``out_dir``."""
    import shutil

    copied = [name for name in TOKENIZER_FILES if (engine.model_dir / name).is_file()]
    for name in copied:
        shutil.copyfile(engine.model_dir / name, out_dir / name)
    if not copied:
        engine.tokenizer.save_pretrained(out_dir)
    for name, text in extra_files.items():
        (out_dir / name).write_text(text)
