"""One decoupled-PPO training step over B prompt groups (AReaL, arXiv 2505.24298).

Phases: (1) group advantages from the rewards (:func:`group_advantages`), over the whole
group before any stale sample is dropped; (2) staleness per sample in training steps,
s = max(0, U_trainer - min_t U(v_t)) over its model tokens (:func:`sample_staleness`), samples
with s > max_staleness dropped; (3) log pi_prox with the step-start parameters, and the
mismatch figures (:func:`step_mismatch`), from the update's own forward pass when
:func:`reuses_update_forward` holds; (4) per mini-batch, micro-batches normalised by its
trained-token count N, one optimizer update. Gradient flows only through log pi_theta;
environment tokens are context, never trained. With W ranks each trains a token-balanced
share, N summed and the loss times W: the one-rank update. See ``docs/internals/trainer.md``.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from asyncrl.configs.trainer import TrainerConfig
from asyncrl.storage.schema import Sample
from asyncrl.tasks.algo.advantages import AdvantageMethod, group_advantages
from asyncrl.tasks.trainer.batch import Layout, MicroBatch, TokenSequence, build_micro_batches, filler_micro_batch
from asyncrl.tasks.trainer.data_parallel import all_gather_objects, all_reduce_floats, balanced_partition
from asyncrl.tasks.trainer.engine import TrainEngine
from asyncrl.tasks.trainer.logprobs import micro_batch_logprobs, sequence_logprobs
from asyncrl.tasks.algo.corrections import BehavCapMode, BehavWeightLevel, sequence_index
from asyncrl.tasks.algo.loss import decoupled_ppo_loss
from asyncrl.tasks.algo.mismatch import all_gather_mismatch, local_mismatch
from asyncrl.tasks.algo.packing import get_packer
from asyncrl.tasks.reward.pass_at_k import task_figures

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RLSettings:
    """The trainer-config fields one RL step uses."""

    objective: Literal["decoupled", "standard"] = "decoupled"
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    behav_weight_cap: float | None = 5.0
    behav_cap_mode: BehavCapMode = "mask"
    behav_weight_floor: float | None = None
    behav_weight_level: BehavWeightLevel = "token"
    advantage: AdvantageMethod = "grpo"
    mini_batches: int = 1
    micro_batch_tokens: int = 4096
    packer: str = "ffd"
    max_staleness: int | None = None
    """Drop samples with staleness above this; None keeps all."""
    pass_k: tuple[int, ...] = ()
    """k values of the per-task pass@k metrics (pass@1 is always reported)."""

    @staticmethod
    def from_config(trainer: TrainerConfig, max_staleness: int | None, pass_k: Sequence[int] = ()) -> RLSettings:
        return RLSettings(
            objective=trainer.objective,
            eps_clip=trainer.eps_clip,
            eps_clip_high=trainer.eps_clip_high,
            behav_weight_cap=trainer.behav_weight_cap,
            behav_cap_mode=trainer.behav_cap_mode,
            behav_weight_floor=trainer.behav_weight_floor,
            behav_weight_level=trainer.behav_weight_level,
            advantage=trainer.advantage,
            mini_batches=trainer.mini_batches,
            micro_batch_tokens=trainer.micro_batch_tokens,
            packer=trainer.packer,
            max_staleness=max_staleness,
            pass_k=tuple(pass_k),
        )


@dataclass(frozen=True)
class TrainItem:
    """One kept sample, ready to train on."""

    sequence: TokenSequence
    logp_behav: torch.Tensor  # (M,) float32, M = sequence.trained_count (model tokens only)
    advantage: float
    group: int
    """Index of its group in the step (mini-batches split by group)."""
    token_lag: tuple[int, ...] = ()
    """Per trained (model) token t, U_trainer - U(v_t): how many training steps the weights that
    sampled it lag the trainer's (0: the trainer's current weights; negative: a branch a
    rollback discarded); empty when unknown (then the mismatch figures skip the sample)."""


@dataclass(frozen=True)
class PreparedStep:
    """Kept samples with advantages, and what was measured and dropped."""

    items: tuple[TrainItem, ...]
    staleness: tuple[int, ...]
    """Per sample of the step (dropped ones included), in input order."""
    rewards: tuple[float, ...]
    advantages: tuple[float, ...]
    """Per sample of the step (dropped ones included)."""
    dropped_stale: int
    num_groups: int
    clamped: int = 0
    group_rewards: tuple[tuple[str, tuple[float, ...]], ...] = ()
    """(task, rewards of its samples) per group, dropped samples included: the per-task figures."""
    """Samples whose update lag was negative, counted as staleness 0 (see :func:`sample_staleness`)."""


@dataclass
class UpdateStats:
    """Token-weighted sums over the micro-batches of one or more updates (see :meth:`means`)."""

    loss: float = 0.0
    updates: int = 0
    tokens: int = 0
    active: int = 0
    clipped: float = 0.0
    behav_weight_sum: float = 0.0
    behav_weight_max: float = 0.0
    capped: float = 0.0
    kl_sum: float = 0.0
    grad_norms: list[float] = field(default_factory=list)
    fillers: int = 0
    """Zero-weighted micro-batches this rank ran to keep in step with a rank that had more."""

    def add_micro(self, loss: float, stats: dict[str, float]) -> None:
        n_tokens, n_active = int(stats["n_tokens"]), int(stats["n_active"])
        self.loss += loss
        self.tokens += n_tokens
        self.active += n_active
        self.clipped += stats["clip_fraction"] * n_active
        self.behav_weight_sum += stats["behav_weight_mean"] * n_tokens
        self.behav_weight_max = max(self.behav_weight_max, stats["behav_weight_max"])
        self.capped += stats["behav_capped_fraction"] * n_tokens
        self.kl_sum += stats["approx_kl"] * n_tokens

    def means(self) -> dict[str, float]:
        """loss = mean over updates of the mini-batch loss; clip fraction over contributing
        tokens, behaviour-weight stats and KL over loss tokens; grad_norm = the largest of
        the updates' global gradient norms (NaN where DeepSpeed reports none, e.g. ZeRO 0)."""
        tokens, active = max(self.tokens, 1), max(self.active, 1)
        norms = [n for n in self.grad_norms if n is not None and math.isfinite(n)]
        return {
            "loss": self.loss / max(self.updates, 1),
            "clip_fraction": self.clipped / active,
            "behav_weight_mean": self.behav_weight_sum / tokens,
            "behav_weight_max": self.behav_weight_max,
            "behav_capped_fraction": self.capped / tokens,
            "approx_kl": self.kl_sum / tokens,
            "grad_norm": max(norms) if norms else math.nan,  # NaN: DeepSpeed reported none
            "optimizer_updates": float(self.updates),
        }


@dataclass(frozen=True)
class RLStepResult:
    """What one step did, as plain numbers (see :meth:`metrics`)."""

    prepared: PreparedStep
    update: UpdateStats
    sequence_tokens: int
    """Every token of the trained sequences: prompt, model and environment tokens."""
    output_tokens: int
    """Trained output tokens: those the model sampled."""
    micro_batches: int
    packing_efficiency: float
    proximal_time_s: float
    """The separate proximal pass (0 when the step took log pi_prox from its update's
    forward pass: :func:`reuses_update_forward`)."""
    update_time_s: float
    rank_token_imbalance: float = 1.0
    """Largest rank's sequence tokens over the mean over ranks (1.0: perfectly even, or one rank)."""
    mismatch: dict[str, float] = field(default_factory=dict)
    """The step's ``mismatch/*`` metrics over all ranks (:func:`step_mismatch`; empty for the
    standard objective, which computes no proximal log-probs)."""
    context_tokens: int = 0
    """Output tokens inserted by an environment (multi-turn samples): attended to, not trained.
    sequence_tokens = prompt tokens + output_tokens + context_tokens."""

    def metrics(self, pass_k: Sequence[int] = ()) -> dict[str, float]:
        """Flat metrics of the step: loss, rewards, advantages, clipping, behaviour weights,
        staleness distribution (``staleness/count_<s>``), token counts (``sequence_tokens`` =
        prompt + ``output_tokens`` (trained) + ``context_tokens`` (environment output tokens,
        not trained)), throughput, packing efficiency,
        train/inference mismatch (``mismatch/*``, :mod:`~asyncrl.tasks.algo.mismatch`), and
        per task the mean reward, pass@1 and pass@k of the step's groups (:func:`task_figures`)."""
        prepared = self.prepared
        compute_time = self.proximal_time_s + self.update_time_s
        out = {
            **self.update.means(),
            **_describe("reward", prepared.rewards),
            **_describe("advantage", prepared.advantages),
            **_describe("staleness", [float(s) for s in prepared.staleness]),
            "dropped_stale": float(prepared.dropped_stale),
            "staleness_clamped": float(prepared.clamped),
            "groups": float(prepared.num_groups),
            "samples": float(len(prepared.staleness)),
            "trained_samples": float(len(prepared.items)),
            "sequence_tokens": float(self.sequence_tokens),
            "output_tokens": float(self.output_tokens),
            "context_tokens": float(self.context_tokens),
            "micro_batches": float(self.micro_batches),
            "filler_micro_batches": float(self.update.fillers),
            "packing_efficiency": self.packing_efficiency,
            "rank_token_imbalance": self.rank_token_imbalance,
            "proximal_time_s": self.proximal_time_s,
            "update_time_s": self.update_time_s,
            "tokens_per_s": self.sequence_tokens / compute_time if compute_time > 0 else 0.0,
            **task_figures(prepared.group_rewards, pass_k),
            **self.mismatch,
        }
        for staleness, count in sorted(Counter(prepared.staleness).items()):
            out[f"staleness/count_{staleness}"] = float(count)
        return out


def _describe(name: str, values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {f"{name}_mean": 0.0, f"{name}_std": 0.0, f"{name}_min": 0.0, f"{name}_max": 0.0}
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / len(values)
    return {f"{name}_mean": mean, f"{name}_std": math.sqrt(var), f"{name}_min": min(values), f"{name}_max": max(values)}


UpdateCount = Callable[[int], int]
"""Weight version label -> U(version), the training steps those weights received
(:class:`asyncrl.storage.weight_lineage.VersionUpdates` reads it from the lineage files)."""


def labels_as_updates(version: int) -> int:
    """U(v) = v: the update count of a run that never rolled back, whose version labels
    count its steps (what :func:`sample_staleness` assumes when given no lineage)."""
    return version


def update_lag(sample: Sample, trainer_updates: int, updates_of: UpdateCount = labels_as_updates) -> int:
    """U_trainer - min over the sample's model tokens t of U(v_t), unclamped (see
    :func:`sample_staleness`; environment tokens of a multi-turn sample are left out)."""
    return trainer_updates - min(updates_of(v) for v in set(sample.model_values(sample.token_versions)))


def sample_staleness(sample: Sample, trainer_updates: int, updates_of: UpdateCount = labels_as_updates) -> int:
    """Staleness of one sample in training steps::

        s = max(0, U_trainer - min_t U(v_t))

    - U_trainer = ``trainer_updates``: training steps the trainer's current weights have
      received, i.e. its step count before this update (after a restart: the checkpoint's
      step plus the steps done since). It is not the trainer's version label, which after
      a rollback is ahead of its updates by the steps the killed trainer published after
      the checkpoint.
    - U(v) = ``updates_of(v)``: training steps the weights of version v received, the
      ``step`` of v's lineage (:func:`asyncrl.storage.weight_lineage.lineage_updates`).
      A version published by a trainer killed after its last checkpoint keeps its step:
      its branch no longer exists, but its tokens were sampled by weights with that many
      updates and their behaviour log-probs are recorded, so they are valid behaviour data.
    - min over the model tokens t (the output tokens the model sampled; an environment
      token of a multi-turn sample was sampled by no weights): the token sampled by the
      weights with the fewest updates lags the most. Without a rollback U grows with the label, so this is the
      oldest token and s = trainer version - min(token_versions) as in AReaL; after a
      rollback a newer label can hold fewer updates (resumed from checkpoint step c, the
      trainer's first new version has c+1 updates, the killed trainer's last one k > c+1),
      so the label order no longer tells which token lags.

    Why the clamp: the difference is negative only when every token of the sample was
    sampled by weights with more updates than the trainer's, which happens only on a branch
    a rollback discarded (or with mislabelled data, which the run audit checks by label).
    Such a sample does not lag the trainer: max_staleness bounds how many updates behind
    the trainer's weights (pi_prox) the behaviour policy may be, and decoupled PPO corrects
    for whatever pi_prox / pi_behav these tokens have (capped or masked above
    ``behav_weight_cap``). So it counts as staleness 0, not as a negative value that would
    sit below every real lag in the staleness figures; :func:`prepare_step` counts such
    samples (metric ``staleness_clamped``) and logs them.
    """
    return max(0, update_lag(sample, trainer_updates, updates_of))


def prepare_step(
    groups: Sequence[Sequence[Sample]],
    settings: RLSettings,
    trainer_updates: int,
    updates_of: UpdateCount = labels_as_updates,
) -> PreparedStep:
    """Advantages per group, staleness per sample (:func:`sample_staleness` with the
    trainer's step count ``trainer_updates``), and the kept samples (phases 1 and 2).

    Each kept sample's per-token arrays hold its model tokens only (environment tokens of
    a multi-turn sample are marked untrained in its :class:`TokenSequence`):
    ``logp_behav`` = (log pi_behav(y_t) for model tokens t), ``token_lag`` =
    (U_trainer - U(v_t) for model tokens t)."""
    import torch

    items: list[TrainItem] = []
    staleness: list[int] = []
    rewards: list[float] = []
    advantages: list[float] = []
    dropped = clamped = 0
    updates_cache: dict[int, int] = {}
    for g, group in enumerate(groups):
        group_rewards = torch.tensor([[float(s.reward) for s in group]], dtype=torch.float64)  # (1, n)
        group_adv = group_advantages(group_rewards, settings.advantage)[0].tolist()  # (n,)
        for sample, advantage in zip(group, group_adv):
            lag = update_lag(sample, trainer_updates, updates_of)
            clamped += int(lag < 0)
            s = sample_staleness(sample, trainer_updates, updates_of)
            staleness.append(s)
            rewards.append(float(sample.reward))
            advantages.append(float(advantage))
            if settings.max_staleness is not None and s > settings.max_staleness:
                dropped += 1
                continue
            trained = None if sample.output_mask is None else tuple(bool(m) for m in sample.output_mask)
            items.append(
                TrainItem(
                    sequence=TokenSequence(tuple(sample.prompt_token_ids), tuple(sample.output_token_ids), trained),
                    logp_behav=torch.tensor(sample.model_values(sample.behaviour_logprobs), dtype=torch.float32),
                    advantage=float(advantage),
                    group=g,
                    token_lag=tuple(
                        trainer_updates - _cached_updates(updates_cache, updates_of, v)
                        for v in sample.model_values(sample.token_versions)
                    ),
                )
            )
    if dropped:
        logger.warning(
            "dropped %d of %d samples staler than max_staleness=%s (trainer at %d training steps); "
            "they are not trained",
            dropped,
            len(staleness),
            settings.max_staleness,
            trainer_updates,
        )
    if clamped:
        logger.info(
            "%d of %d samples hold tokens of weights with more updates than the trainer's %d "
            "(a branch discarded by a rollback): staleness counted as 0",
            clamped,
            len(staleness),
            trainer_updates,
        )
    return PreparedStep(
        items=tuple(items),
        staleness=tuple(staleness),
        rewards=tuple(rewards),
        advantages=tuple(advantages),
        dropped_stale=dropped,
        num_groups=len(groups),
        clamped=clamped,
        group_rewards=tuple((group[0].task, tuple(float(s.reward) for s in group)) for group in groups if group),
    )


def _cached_updates(cache: dict[int, int], updates_of: UpdateCount, version: int) -> int:
    if version not in cache:
        cache[version] = updates_of(version)
    return cache[version]


def split_groups(num_groups: int, parts: int) -> list[range]:
    """Contiguous group ranges of near-equal size (sizes differ by at most one), ``parts`` of them."""
    if parts < 1:
        raise ValueError(f"mini_batches must be >= 1, got {parts}")
    parts = min(parts, max(num_groups, 1))
    base, extra = divmod(num_groups, parts)
    ranges, start = [], 0
    for k in range(parts):
        size = base + (1 if k < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def rank_shares(items: Sequence[TrainItem], members: Sequence[int], world: int) -> list[list[int]]:
    """The item indices each of ``world`` ranks trains from one mini-batch ``members``
    (indices into ``items``): :func:`balanced_partition` of their sequence lengths
    (prompt + output tokens, what a forward and backward cost), mapped back to item
    indices. The same on every rank; share r is rank r's."""
    shares = balanced_partition([len(items[i].sequence) for i in members], world)
    return [[members[j] for j in share] for share in shares]


def compute_proximal(
    engine: TrainEngine, items: Sequence[TrainItem], indices: Sequence[int], settings: RLSettings
) -> dict[int, torch.Tensor]:
    """log pi_prox of every trained token of ``items[i] for i in indices`` (shape
    (trained_count,) each: environment tokens are context of the forward pass, not values)
    with the current parameters, without gradient; keyed by item index. The packer sees
    full sequence lengths. Data parallel: each rank passes the
    items it trains (its shares), as forward passes need no collective; every rank holds
    the full parameters (ZeRO stages 0-2), so each gets the one-rank values."""
    if not indices:
        return {}
    sequences = [items[i].sequence for i in indices]
    groups = get_packer(settings.packer)([len(s) for s in sequences], settings.micro_batch_tokens)
    engine.module.eval()
    values = sequence_logprobs(engine.ds, sequences, groups)
    return dict(zip(indices, values))


def reuses_update_forward(module: torch.nn.Module, settings: RLSettings, updates: int) -> bool:
    """Whether a step takes log pi_prox from its update's own forward pass: the decoupled
    objective, ``updates`` = 1 optimizer update in the step (one mini-batch with samples
    left) and a forward pass that computes in train mode what it computes in eval mode: no
    dropout module with p > 0 and no positive ``*dropout*``, ``*pdrop`` or ``*jitter*``
    value in the model config (transformers applies attention dropout and MoE router
    jitter from the config in train mode only).

    Then the update's forward runs on the step-start parameters, so its detached
    log-probs are log pi_prox, and the separate proximal pass (about a third of a step's
    compute) is skipped. With several updates every mini-batch after the first trains on
    moved parameters, so pi_prox needs its own pass."""
    from torch.nn.modules.dropout import _DropoutNd

    if settings.objective != "decoupled" or updates != 1:
        return False
    if any(isinstance(m, _DropoutNd) and m.p > 0 for m in module.modules()):
        return False
    config = getattr(module, "config", None)
    values = vars(config).items() if config is not None else ()
    return not any(
        ("dropout" in key or "jitter" in key or key.endswith("pdrop")) and isinstance(value, (int, float)) and value > 0
        for key, value in values
    )


def ppo_update(
    engine: TrainEngine,
    items: Sequence[TrainItem],
    proximal: dict[int, torch.Tensor] | None,
    batches: Sequence[MicroBatch],
    settings: RLSettings,
    stats: UpdateStats,
    *,
    proximal_from_forward: dict[int, torch.Tensor] | None = None,
) -> None:
    """One optimizer update over ``batches``, this rank's micro-batches of one mini-batch of
    ``items`` (collective: every rank calls it for the same mini-batch).

    ``proximal``: log pi_prox of each item's trained tokens (decoupled objective). Or,
    when the caller established :func:`reuses_update_forward`, ``proximal`` is None and
    ``proximal_from_forward`` an empty dict: each micro-batch's log pi_prox is then
    stop_gradient(log pi_theta) of its own forward pass, and the per-item values are
    recorded into that dict (for the step's mismatch figures).

    Each micro-batch's loss is normalised by the trained-token count of the whole
    mini-batch, N = sum over ranks r of the trained tokens of rank r's micro-batches
    (environment tokens of multi-turn samples excluded), and multiplied by the world size
    W before backward:

        backward(W * loss_b),   loss_b = -sum_{t in b} (per-token objective) / N

    DeepSpeed averages gradients over ranks (divides their sum by W), so the update
    follows the gradient of -sum_{all t of the mini-batch} (per-token objective) / N,
    the one-rank loss. Every rank runs R = max over ranks of its micro-batch count
    backward passes; a rank with fewer runs zero-weighted filler passes (counted in
    ``stats.fillers``). Nothing happens on any rank when N = 0.
    """
    import torch

    decoupled = settings.objective == "decoupled"
    if decoupled and proximal is None and proximal_from_forward is None:
        raise ValueError("the decoupled objective needs proximal log-probs")
    local_tokens = sum(batch.output_tokens for batch in batches)
    (normaliser,) = all_reduce_floats([float(local_tokens)], "sum")
    (rounds,) = (int(r) for r in all_reduce_floats([float(len(batches))], "max"))
    if normaliser == 0:
        return
    world = engine.world_size
    engine.module.train()
    for k in range(rounds):
        if k < len(batches):
            batch = batches[k]
            logp_theta = micro_batch_logprobs(engine.ds, batch)  # (R*S,)
            chosen = [items[i] for i in batch.sample_ids]
            device = logp_theta.device
            behav = batch.expand([item.logp_behav for item in chosen]).to(device)
            adv = batch.expand([torch.full((item.sequence.trained_count,), item.advantage) for item in chosen])
            prox = None
            if decoupled and proximal is not None:
                prox = batch.expand([proximal[i] for i in batch.sample_ids]).to(device)
            elif decoupled and proximal_from_forward is not None:
                mask = batch.loss_mask.to(device)
                prox = torch.where(mask, logp_theta.detach(), torch.zeros_like(logp_theta))
                proximal_from_forward.update(zip(batch.sample_ids, batch.split(prox.cpu())))
            loss, loss_stats = decoupled_ppo_loss(
                logp_theta,
                prox,
                behav,
                adv.to(device),
                batch.loss_mask.to(device),
                eps_clip=settings.eps_clip,
                eps_clip_high=settings.eps_clip_high,
                behav_weight_cap=settings.behav_weight_cap,
                behav_cap_mode=settings.behav_cap_mode,
                behav_weight_floor=settings.behav_weight_floor,
                behav_weight_level=settings.behav_weight_level,
                sequence_index=sequence_index(batch.loss_mask, batch.output_lengths).to(device),
                decoupled=decoupled,
                token_normaliser=normaliser,
            )
            stats.add_micro(float(loss.item()), loss_stats.as_floats())
        else:
            # This rank has fewer micro-batches than another: a zero-weighted forward over two
            # tokens keeps the gradient reductions of backward (ZeRO 2) in lockstep.
            loss = micro_batch_logprobs(engine.ds, filler_micro_batch(items[0].sequence)).sum() * 0.0
            stats.fillers += 1
        # Gradient of sum_r world * loss_r, averaged over the W ranks by DeepSpeed: the
        # gradient of the whole mini-batch's loss.
        engine.ds.backward(loss * world)
    engine.ds.step()
    stats.updates += 1
    norm = engine.ds.get_global_grad_norm()
    if norm is not None:
        stats.grad_norms.append(float(norm))


def run_rl_step(
    engine: TrainEngine,
    groups: Sequence[Sequence[Sample]],
    settings: RLSettings,
    trainer_updates: int,
    layout: Layout = "packed",
    *,
    updates_of: UpdateCount = labels_as_updates,
) -> RLStepResult:
    """Train on ``groups`` (one step: proximal recompute, then one update per mini-batch);
    ``trainer_updates`` and ``updates_of`` measure staleness (:func:`sample_staleness`).

    Collective with several ranks: every rank passes the same ``groups`` and trains its
    share of each mini-batch (:func:`rank_shares`); the result describes the whole step
    on every rank (:func:`all_reduce_step_figures`)."""
    prepared = prepare_step(groups, settings, trainer_updates, updates_of)
    items = prepared.items
    rank, world = engine.rank, engine.world_size
    packer = get_packer(settings.packer)
    plan: list[list[int]] = []  # per mini-batch: the item indices this rank trains
    for group_range in split_groups(prepared.num_groups, settings.mini_batches):
        members = [i for i, item in enumerate(items) if item.group in group_range]
        if members:  # empty when every sample of these groups was dropped as stale
            plan.append(rank_shares(items, members, world)[rank])

    proximal = None
    from_forward: dict[int, torch.Tensor] | None = None
    proximal_time = 0.0
    if reuses_update_forward(engine.module, settings, len(plan)):
        from_forward = {}
    elif settings.objective == "decoupled":
        started = time.perf_counter()
        proximal = compute_proximal(engine, items, [i for local in plan for i in local], settings)
        proximal_time = time.perf_counter() - started

    started = time.perf_counter()
    stats = UpdateStats()
    sequence_tokens = output_tokens = context_tokens = micro_count = 0
    for local in plan:
        sequences = [items[i].sequence for i in local]
        lengths = [len(s) for s in sequences]
        index_groups = packer(lengths, settings.micro_batch_tokens) if lengths else []
        # Micro-batch sample ids index into `items` (packer indices mapped through `local`).
        batches = [_reindex(batch, local) for batch in build_micro_batches(sequences, index_groups, layout)]
        ppo_update(engine, items, proximal, batches, settings, stats, proximal_from_forward=from_forward)
        sequence_tokens += sum(lengths)
        output_tokens += sum(s.trained_count for s in sequences)
        context_tokens += sum(len(s.output_ids) - s.trained_count for s in sequences)
        micro_count += len(batches)
    update_time = time.perf_counter() - started
    prox_values = from_forward if from_forward is not None else proximal
    mismatch = step_mismatch(items, prox_values) if prox_values is not None else {}
    local = RLStepResult(
        prepared=prepared,
        update=stats,
        sequence_tokens=sequence_tokens,
        output_tokens=output_tokens,
        micro_batches=micro_count,
        packing_efficiency=1.0,  # set from the reduced token counts
        proximal_time_s=proximal_time,
        update_time_s=update_time,
        mismatch=mismatch,
        context_tokens=context_tokens,
    )
    return all_reduce_step_figures(local, settings.micro_batch_tokens)


def step_mismatch(items: Sequence[TrainItem], proximal: dict[int, torch.Tensor]) -> dict[str, float]:
    """The step's ``mismatch/*`` metrics (:mod:`~asyncrl.tasks.algo.mismatch`) from the
    proximal log-probs of this rank's items (keys of ``proximal``; log p_trainer) and their
    behaviour log-probs and token lags (collective: every rank calls it once per step; the
    figures are those of all ranks' tokens). All three are over trained (model) tokens only,
    so environment tokens of multi-turn samples never enter the figures. Items with unknown
    token lags are left out."""
    known = [i for i in sorted(proximal) if len(items[i].token_lag) == len(items[i].logp_behav)]
    local = local_mismatch(
        [proximal[i] for i in known], [items[i].logp_behav for i in known], [items[i].token_lag for i in known]
    )
    return all_gather_mismatch(local, all_gather_objects)


def all_reduce_step_figures(local: RLStepResult, token_budget: int) -> RLStepResult:
    """The step's figures over all ranks, from each rank's own (collective; with one
    rank the same figures).

    - summed over ranks: the loss sums (each rank's part of the mini-batch loss, so the
      sum is the mini-batch loss), token counts, clipped / capped / KL / behaviour-weight
      sums, sequence, output and context tokens, micro-batches and fillers;
    - max over ranks: ``behav_weight_max``, and the proximal and update times (the step
      waits for the slowest rank, so tokens/s = all ranks' tokens / the slowest time);
    - the same on every rank already: ``updates`` and the global gradient norms.

    packing efficiency = sum_r real tokens_r / (token_budget * sum_r micro-batches_r)
    (:func:`~asyncrl.tasks.algo.packing.packing_efficiency` over every rank's
    micro-batches; 1.0 without micro-batches); rank token imbalance = max_r T_r / mean_r T_r
    with T_r rank r's sequence tokens (1.0 when no rank has any).
    """
    stats = local.update
    sums = all_reduce_floats(
        [stats.loss, stats.tokens, stats.active, stats.clipped, stats.behav_weight_sum, stats.capped, stats.kl_sum,
         stats.fillers, local.sequence_tokens, local.output_tokens, local.micro_batches, 1.0,
         local.context_tokens],
        "sum",
    )  # fmt: skip
    maxes = all_reduce_floats(
        [stats.behav_weight_max, local.proximal_time_s, local.update_time_s, local.sequence_tokens], "max"
    )
    loss, tokens, active, clipped, weight_sum, capped, kl_sum, fillers, seq_tokens, out_tokens, micro, ranks, ctx = sums
    weight_max, proximal_time, update_time, rank_tokens_max = maxes
    update = replace(
        stats,
        loss=loss,
        tokens=int(tokens),
        active=int(active),
        clipped=clipped,
        behav_weight_sum=weight_sum,
        behav_weight_max=weight_max,
        capped=capped,
        kl_sum=kl_sum,
        grad_norms=list(stats.grad_norms),
        fillers=int(fillers),
    )
    return replace(
        local,
        update=update,
        sequence_tokens=int(seq_tokens),
        output_tokens=int(out_tokens),
        context_tokens=int(ctx),
        micro_batches=int(micro),
        packing_efficiency=seq_tokens / (token_budget * micro) if micro else 1.0,
        proximal_time_s=proximal_time,
        update_time_s=update_time,
        rank_token_imbalance=rank_tokens_max * ranks / seq_tokens if seq_tokens else 1.0,
    )


def _reindex(batch: MicroBatch, local: Sequence[int]) -> MicroBatch:
    """The same micro-batch with ``sample_ids`` mapped from local positions to item indices."""
    return replace(batch, sample_ids=tuple(local[j] for j in batch.sample_ids))
