"""One decoupled-PPO training step over B prompt groups (AReaL, arXiv 2505.24298).

Phases: (1) group advantages from the rewards (:func:`group_advantages`), over the whole group
before any stale sample is dropped; (2) staleness per sample in training steps,
s = max(0, U_trainer - min_t U(v_t)) over its model tokens
(:func:`~asyncrl.tasks.trainer.staleness.sample_staleness`), samples with s > max_staleness
dropped; (3) log pi_prox with the step-start parameters, and the mismatch figures
(:func:`~asyncrl.tasks.trainer.step_figures.step_mismatch`), from the update's own forward pass
when :func:`reuses_update_forward` holds; (4) per mini-batch, micro-batches normalised by its
trained-token count N, one optimizer update. Gradient flows only through log pi_theta;
environment tokens are context, never trained. With W ranks each trains a token-balanced share,
N summed and the loss times W: the one-rank update. See ``docs/internals/trainer.md``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from asyncrl.storage.schema import Sample
from asyncrl.tasks.algo.advantages import group_advantages, scale_negative_advantages
from asyncrl.tasks.trainer.batch import Layout, MicroBatch, TokenSequence, build_micro_batches, filler_micro_batch
from asyncrl.tasks.trainer.data_parallel import all_reduce_floats, balanced_partition
from asyncrl.tasks.trainer.engine import TrainEngine
from asyncrl.tasks.trainer.logprobs import filler_passes, lockstep_passes, micro_batch_logprobs, sequence_logprobs
from asyncrl.tasks.algo.corrections import sequence_index
from asyncrl.tasks.algo.loss import decoupled_ppo_loss, reference_kl_loss
from asyncrl.tasks.algo.packing import get_packer
from asyncrl.tasks.trainer.reference import ReferencePolicy, reference_logprobs
from asyncrl.tasks.trainer.rl_settings import RLSettings
from asyncrl.tasks.trainer.staleness import UpdateCount, labels_as_updates, sample_staleness, update_lag
from asyncrl.tasks.trainer.step_data import PreparedStep, TrainItem
from asyncrl.tasks.trainer.step_figures import RLStepResult, UpdateStats, all_reduce_step_figures, step_mismatch

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def prepare_step(
    groups: Sequence[Sequence[Sample]],
    settings: RLSettings,
    trainer_updates: int,
    updates_of: UpdateCount = labels_as_updates,
) -> PreparedStep:
    """Advantages per group, staleness per sample
    (:func:`~asyncrl.tasks.trainer.staleness.sample_staleness` with the trainer's step count
    ``trainer_updates``), and the kept samples (phases 1 and 2).

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
        group_adv = group_advantages(group_rewards, settings.advantage)  # (1, n)
        group_adv = scale_negative_advantages(group_adv, settings.negative_advantage_scale)[0].tolist()
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
    full sequence lengths. Data parallel: each rank passes the items it trains (its
    shares) and gets the one-rank values. At ZeRO stages 0-2 (full parameters on every
    rank) this needs no communication; under ZeRO 3, whose forward passes are collectives,
    every rank calls it and one with fewer micro-batches runs filler passes
    (:func:`~asyncrl.tasks.trainer.logprobs.lockstep_passes`)."""
    sequences = [items[i].sequence for i in indices]
    groups = get_packer(settings.packer)([len(s) for s in sequences], settings.micro_batch_tokens) if sequences else []
    passes = lockstep_passes(engine.ds, len(groups))
    if not passes:
        return {}
    engine.module.eval()
    values = sequence_logprobs(engine.ds, sequences, groups, engine.logit_chunk_tokens) if sequences else []
    filler_passes(engine.ds, items[0].sequence, passes - len(groups), engine.logit_chunk_tokens)
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
    reference: dict[int, torch.Tensor] | None = None,
) -> None:
    """One optimizer update over ``batches``, this rank's micro-batches of one mini-batch of
    ``items`` (collective: every rank calls it for the same mini-batch).

    ``proximal``: log pi_prox of each item's trained tokens (decoupled objective). Or,
    when the caller established :func:`reuses_update_forward`, ``proximal`` is None and
    ``proximal_from_forward`` an empty dict: each micro-batch's log pi_prox is then
    stop_gradient(log pi_theta) of its own forward pass, and the per-item values are
    recorded into that dict (for the step's mismatch figures). ``reference``: log pi_ref of
    each item's trained tokens when ``settings.kl_coef`` > 0; the KL penalty
    (:func:`~asyncrl.tasks.algo.loss.reference_kl_loss`, same N) is then added to each
    micro-batch's loss.

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
            logp_theta = micro_batch_logprobs(engine.ds, batch, engine.logit_chunk_tokens)  # (R*S,)
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
            figures = loss_stats.as_floats()
            if reference is not None:
                logp_ref = batch.expand([reference[i] for i in batch.sample_ids]).to(device)
                kl_loss, ref_kl = reference_kl_loss(
                    logp_theta, logp_ref, batch.loss_mask.to(device), kl_coef=settings.kl_coef, token_normaliser=normaliser
                )
                loss = loss + kl_loss
                figures["ref_kl"] = float(ref_kl)
            stats.add_micro(float(loss.item()), figures)
        else:
            # This rank has fewer micro-batches than another: a zero-weighted forward over two
            # tokens keeps the gradient reductions of backward (ZeRO 2) in lockstep.
            filler = filler_micro_batch(items[0].sequence)
            loss = micro_batch_logprobs(engine.ds, filler, engine.logit_chunk_tokens).sum() * 0.0
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
    reference: ReferencePolicy | None = None,
) -> RLStepResult:
    """Train on ``groups`` (one step: proximal recompute, then one update per mini-batch);
    ``trainer_updates`` and ``updates_of`` measure staleness (:func:`~asyncrl.tasks.trainer.staleness.sample_staleness`).
    With ``settings.kl_coef`` > 0, ``reference`` gives log pi_ref of the trained tokens
    (one pass, counted in the proximal time) for the KL penalty.

    Collective with several ranks: every rank passes the same ``groups`` and trains its
    share of each mini-batch (:func:`rank_shares`); the result describes the whole step
    on every rank (:func:`~asyncrl.tasks.trainer.step_figures.all_reduce_step_figures`)."""
    prepared = prepare_step(groups, settings, trainer_updates, updates_of)
    items = prepared.items
    rank, world = engine.rank, engine.world_size
    packer = get_packer(settings.packer)
    plan: list[list[int]] = []  # per mini-batch: the item indices this rank trains
    for group_range in split_groups(prepared.num_groups, settings.mini_batches):
        members = [i for i, item in enumerate(items) if item.group in group_range]
        if members:  # empty when every sample of these groups was dropped as stale
            plan.append(rank_shares(items, members, world)[rank])

    trained = [i for local in plan for i in local]  # the item indices this rank trains
    proximal = None
    from_forward: dict[int, torch.Tensor] | None = None
    proximal_time = 0.0
    if reuses_update_forward(engine.module, settings, len(plan)):
        from_forward = {}
    elif settings.objective == "decoupled":
        started = time.perf_counter()
        proximal = compute_proximal(engine, items, trained, settings)
        proximal_time = time.perf_counter() - started
    reference_values = None
    if settings.kl_coef > 0:
        if reference is None:
            raise ValueError("trainer.kl_coef > 0 needs the reference policy")
        started = time.perf_counter()
        reference_values = reference_logprobs(
            reference, engine, items, trained, settings.packer, settings.micro_batch_tokens
        )
        proximal_time += time.perf_counter() - started

    started = time.perf_counter()
    stats = UpdateStats()
    sequence_tokens = output_tokens = context_tokens = micro_count = 0
    for local in plan:
        sequences = [items[i].sequence for i in local]
        lengths = [len(s) for s in sequences]
        index_groups = packer(lengths, settings.micro_batch_tokens) if lengths else []
        # Micro-batch sample ids index into `items` (packer indices mapped through `local`).
        batches = [_reindex(batch, local) for batch in build_micro_batches(sequences, index_groups, layout)]
        ppo_update(
            engine, items, proximal, batches, settings, stats, proximal_from_forward=from_forward, reference=reference_values
        )
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


def _reindex(batch: MicroBatch, local: Sequence[int]) -> MicroBatch:
    """The same micro-batch with ``sample_ids`` mapped from local positions to item indices."""
    return replace(batch, sample_ids=tuple(local[j] for j in batch.sample_ids))
