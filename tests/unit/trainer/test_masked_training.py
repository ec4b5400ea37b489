"""Multi-turn (masked) samples in the trainer: environment tokens are context, never trained.

The real step code (``prepare_step``, ``compute_proximal``, ``ppo_update``, ``run_rl_step``)
runs on the tiny HF model behind :class:`RecordingDS`, a stand-in for the DeepSpeed engine
with a plain backward and no optimizer, so the loss, the gradient w.r.t. the logits and
every figure can be checked against float64 references computed by hand, without DeepSpeed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncrl.storage.fs import open_root
from asyncrl.storage.schema import Sample
from asyncrl.storage.shards import ShardReader, ShardWriter
from asyncrl.tasks.trainer.batch import MicroBatch, TokenSequence, build_micro_batches
from asyncrl.tasks.algo.corrections import sequence_index
from asyncrl.tasks.trainer.engine import TrainEngine
from asyncrl.tasks.trainer.feed import ShardFeed, StepInput, TrainerInputError, check_samples
from asyncrl.tasks.trainer.logprobs import micro_batch_logprobs
from asyncrl.tasks.trainer.loop import stale_tokens
from asyncrl.tasks.algo.loss import decoupled_ppo_loss
from asyncrl.tasks.trainer.step import compute_proximal, ppo_update, prepare_step, run_rl_step
from asyncrl.tasks.trainer.step_figures import UpdateStats
from asyncrl.tasks.trainer.step_data import TrainItem
from asyncrl.tasks.trainer.staleness import sample_staleness
from asyncrl.tasks.trainer.rl_settings import RLSettings

PROMPT = (40, 41, 42, 43, 44)
Turns = Sequence[tuple[int, int, int]]
"""Per model turn: (model tokens, environment tokens after it, weight version)."""
THREE_TURNS: Turns = ((4, 3, 1), (3, 2, 2), (2, 0, 2))


class RecordingDS:
    """What the step code calls on a DeepSpeed engine, over a plain HF model: forward (keeping
    the logits of every forward with autograd, and their gradient), backward, and an
    optimizer step that does nothing (parameters never change, so figures can be recomputed)."""

    def __init__(self, model: Any) -> None:
        self.module = model
        self.device = torch.device("cpu")
        self.global_rank = 0
        self.world_size = 1
        self.logits: list[torch.Tensor] = []

    def __call__(self, **inputs: Any) -> Any:
        output = self.module(**inputs)
        if output.logits.requires_grad:
            output.logits.retain_grad()
            self.logits.append(output.logits)
        return output

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        pass

    def get_global_grad_norm(self) -> None:
        return None


@pytest.fixture(scope="module")
def policy(tiny_model_dir: Path) -> Any:
    """This module's own copy of the tiny model (the step code switches it to train mode)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa", torch_dtype=torch.float32)


@pytest.fixture
def stand_in(policy: Any, tiny_model_dir: Path) -> TrainEngine:
    policy.zero_grad(set_to_none=True)
    ds: Any = RecordingDS(policy)
    return TrainEngine(ds=ds, tokenizer=None, vocab_size=policy.config.vocab_size, model_dir=tiny_model_dir)


def episode(group_id: str, reward: float, seed: int, turns: Turns = THREE_TURNS) -> Sample:
    """An agent episode: model turns with environment tokens between them, following the
    shard conventions (environment log-prob 0.0, version of the model token before)."""
    rng = random.Random(seed)
    output: list[int] = []
    mask: list[bool] = []
    versions: list[int] = []
    starts: list[int] = []
    for n_model, n_env, version in turns:
        starts.append(len(output))
        output += [rng.randrange(32, 300) for _ in range(n_model + n_env)]
        mask += [True] * n_model + [False] * n_env
        versions += [version] * (n_model + n_env)
    return Sample(
        prompt_id=f"p-{group_id}",
        group_id=group_id,
        prompt_token_ids=list(PROMPT),
        output_token_ids=output,
        behaviour_logprobs=[-rng.uniform(0.1, 3.0) if m else 0.0 for m in mask],
        token_versions=versions,
        reward=reward,
        finish_reason="stop",
        submit_time=0.0,
        finish_time=1.0,
        output_mask=mask,
        turn_starts=starts,
    )


def single_turn(group_id: str, reward: float, seed: int, length: int = 7, version: int = 2) -> Sample:
    rng = random.Random(seed)
    return Sample(
        prompt_id=f"p-{group_id}",
        group_id=group_id,
        prompt_token_ids=list(PROMPT),
        output_token_ids=[rng.randrange(32, 300) for _ in range(length)],
        behaviour_logprobs=[-rng.uniform(0.1, 3.0) for _ in range(length)],
        token_versions=[version] * length,
        reward=reward,
        finish_reason="stop",
        submit_time=0.0,
        finish_time=1.0,
    )


def model_mask(sample: Sample) -> torch.Tensor:
    """(L,) bool: True at the model tokens (all of them for a single-turn sample)."""
    mask = sample.output_mask if sample.output_mask is not None else [True] * len(sample.output_token_ids)
    return torch.tensor(list(mask), dtype=torch.bool)


def reference_logprobs(model: Any, sample: Sample) -> torch.Tensor:
    """(L,) float64: log pi(y_t | prompt, y_<t) of every output token, the sample alone in
    the model (no packing), log_softmax taken in float64."""
    tokens = torch.tensor([[*sample.prompt_token_ids, *sample.output_token_ids]])  # (1, P+L)
    with torch.no_grad():
        logits = model(input_ids=tokens, use_cache=False).logits[0].to(torch.float64)  # (P+L, V)
    n_prompt, n_output = len(sample.prompt_token_ids), len(sample.output_token_ids)
    logp = torch.log_softmax(logits[n_prompt - 1 : n_prompt - 1 + n_output], dim=-1)  # (L, V)
    return logp.gather(1, tokens[0, n_prompt:].unsqueeze(1)).squeeze(1)  # (L,)


def with_behaviour(sample: Sample, model_values: torch.Tensor) -> Sample:
    """The sample with these behaviour log-probs at its model tokens and 0.0 elsewhere."""
    values = iter(model_values.tolist())
    return replace(sample, behaviour_logprobs=[next(values) if m else 0.0 for m in model_mask(sample).tolist()])


def reference_loss(
    theta: Sequence[torch.Tensor],
    prox: Sequence[torch.Tensor],
    behav: Sequence[torch.Tensor],
    advantages: Sequence[float],
    settings: RLSettings,
) -> float:
    """The decoupled PPO loss in float64, over model tokens only (one tensor per sample):

        loss = -(1/N) sum_s sum_{t in s} m'_t rho'_t min(u_t A_s, clip(u_t, 1-eps, 1+eps) A_s)

    u_t = exp(theta_t - prox_t); w_t = exp(prox_t - behav_t); rho_t = w_t (token level) or
    exp(mean_{k in s} log w_k) (sequence_geo_mean); mask mode: m'_t = [rho_t <= cap],
    rho'_t = rho_t; N = number of model tokens."""
    total, count = 0.0, 0
    for th, px, bh, adv in zip(theta, prox, behav, advantages):
        th, px, bh = th.double(), px.double(), bh.double()
        u = torch.exp(th - px)
        log_w = px - bh
        if settings.behav_weight_level == "token":
            rho = torch.exp(log_w)
        elif settings.behav_weight_level == "sequence_geo_mean":
            rho = torch.exp(log_w.mean()).expand_as(log_w)
        else:
            raise AssertionError(settings.behav_weight_level)
        assert settings.behav_weight_cap is not None and settings.behav_cap_mode == "mask"
        keep = (rho <= settings.behav_weight_cap).double()
        surrogate = torch.minimum(u * adv, u.clamp(1 - settings.eps_clip, 1 + settings.eps_clip) * adv)
        total += float((keep * rho * surrogate).sum())
        count += int(th.numel())
    return -total / count


def env_target_positions(batch: MicroBatch, items: Sequence[TrainItem]) -> torch.Tensor:
    """(R*S,) bool: the positions whose target (next token) is an environment token."""
    rows, width = batch.input_ids.shape
    out = torch.zeros(rows * width, dtype=torch.bool)
    offset = 0
    for k, index in enumerate(batch.sample_ids):
        seq = items[index].sequence
        base = k * width if batch.attention_mask is not None else offset
        for t, trained in enumerate(seq.trained or [True] * len(seq.output_ids)):
            out[base + len(seq.prompt_ids) - 1 + t] = not trained
        offset += len(seq)
    return out


# --- micro-batches --------------------------------------------------------------------------


def test_loss_mask_holds_the_model_tokens_and_lengths_count_every_token() -> None:
    sample = episode("g0", 1.0, seed=0)
    trained = model_mask(sample)
    seq = TokenSequence(PROMPT, tuple(sample.output_token_ids), tuple(trained.tolist()))
    plain = TokenSequence((1, 2), (3, 4, 5))
    assert len(seq) == len(PROMPT) + 14 and seq.trained_count == 9
    model_tokens = [t for t, m in zip(sample.output_token_ids, trained.tolist()) if m]
    per_sample = {0: (model_tokens, torch.arange(9.0)), 1: ([3, 4, 5], torch.tensor([7.0, 8.0, 9.0]))}
    packed = build_micro_batches([seq, plain], [[0, 1]], "packed")
    for batch in packed + build_micro_batches([seq, plain], [[1, 0]], "padded"):
        order = batch.sample_ids
        assert batch.targets[batch.loss_mask].tolist() == [t for i in order for t in per_sample[i][0]]
        assert batch.output_lengths == tuple(len(per_sample[i][0]) for i in order) and batch.output_tokens == 12
        assert batch.real_tokens == len(seq) + len(plain)  # packing counts every token
        values = [per_sample[i][1] for i in order]
        assert [v.tolist() for v in batch.split(batch.expand(values))] == [v.tolist() for v in values]
    with pytest.raises(ValueError, match="trained marks 2 tokens, the output has 3"):
        TokenSequence((1,), (2, 3, 4), (True, False))


# --- the loss and its gradient --------------------------------------------------------------


@pytest.mark.parametrize(("level", "layout"), [("token", "packed"), ("sequence_geo_mean", "padded")])
def test_masked_loss_equals_the_float64_reference_and_env_logits_get_no_gradient(
    stand_in: TrainEngine, policy: Any, level: str, layout: str
) -> None:
    samples = [
        episode("g0", 1.0, seed=1),
        episode("g0", 0.0, seed=2, turns=((2, 5, 1), (5, 1, 1))),
        episode("g0", 0.25, seed=3, turns=((6, 0, 2),)),  # one turn, no environment token
    ]
    theta = [reference_logprobs(policy, s)[model_mask(s)] for s in samples]
    rng = random.Random(0)
    # behaviour a little off the policy (some weights above the cap of 5), proximal a little
    # off theta (some ratios u outside the clip range)
    behav = [th - torch.tensor([rng.uniform(-1.0, 2.0) for _ in range(len(th))], dtype=torch.float64) for th in theta]
    prox64 = [th + torch.tensor([rng.uniform(-0.3, 0.3) for _ in range(len(th))], dtype=torch.float64) for th in theta]
    samples = [with_behaviour(s, b) for s, b in zip(samples, behav)]
    settings = RLSettings(micro_batch_tokens=64, behav_weight_level=level)  # type: ignore[arg-type]
    prepared = prepare_step([samples], settings, trainer_updates=2)
    items = prepared.items
    prox = {i: p.to(torch.float32) for i, p in enumerate(prox64)}
    sequences = [item.sequence for item in items]
    batches = build_micro_batches(sequences, [[0, 1], [2]], layout)  # type: ignore[arg-type]
    stats = UpdateStats()
    ppo_update(stand_in, items, prox, batches, settings, stats)

    behav_used = [item.logp_behav for item in items]
    expected = reference_loss(theta, list(prox.values()), behav_used, [item.advantage for item in items], settings)
    assert stats.loss == pytest.approx(expected, rel=2e-5, abs=1e-6)
    assert stats.tokens == sum(len(th) for th in theta) == 9 + 7 + 6

    logits = stand_in.ds.logits  # type: ignore[attr-defined]
    assert len(logits) == len(batches)
    for batch, batch_logits in zip(batches, logits):
        grad = batch_logits.grad.reshape(-1, batch_logits.shape[-1])  # (R*S, V)
        env = env_target_positions(batch, items)
        assert not bool((env & batch.loss_mask).any())
        assert torch.count_nonzero(grad[~batch.loss_mask]) == 0  # prompt, env and padding positions
        if batch.sample_ids == (0, 1):
            assert int(env.sum()) == 5 + 6  # the environment tokens of the first two samples
        assert float(grad[batch.loss_mask].abs().sum()) > 0


def test_single_turn_rows_train_exactly_as_before(stand_in: TrainEngine, policy: Any) -> None:
    """A row without a mask gives bit for bit the loss of the pre-mask code path, spelled out
    here (every output token is trained), and so does the same row with an all-True mask."""
    samples = [single_turn("g0", 1.0, 4), single_turn("g0", 0.0, 5, length=11), single_turn("g0", 0.5, 6)]
    settings = RLSettings(micro_batch_tokens=128)
    prepared = prepare_step([samples], settings, trainer_updates=2)
    items = prepared.items
    prox = {i: (reference_logprobs(policy, s) + 0.05 * (i + 1)).to(torch.float32) for i, s in enumerate(samples)}
    (batch,) = build_micro_batches([item.sequence for item in items], [[0, 1, 2]], "packed")
    stats = UpdateStats()
    ppo_update(stand_in, items, prox, [batch], settings, stats)

    lengths = [len(s.output_token_ids) for s in samples]
    old_mask = [len(PROMPT) - 1 <= j < len(PROMPT) + n - 1 for n in lengths for j in range(len(PROMPT) + n)]
    assert torch.equal(batch.loss_mask, torch.tensor(old_mask)) and batch.output_lengths == tuple(lengths)
    stand_in.module.train()
    logp_theta = micro_batch_logprobs(stand_in.ds, batch)
    behav = batch.expand([torch.tensor(list(s.behaviour_logprobs), dtype=torch.float32) for s in samples])
    adv = batch.expand([torch.full((n,), a) for n, a in zip(lengths, prepared.advantages)])
    old_loss, _ = decoupled_ppo_loss(
        logp_theta,
        batch.expand([prox[i] for i in range(3)]),
        behav,
        adv,
        batch.loss_mask,
        eps_clip=settings.eps_clip,
        eps_clip_high=settings.eps_clip_high,
        behav_weight_cap=settings.behav_weight_cap,
        behav_cap_mode=settings.behav_cap_mode,
        behav_weight_floor=settings.behav_weight_floor,
        behav_weight_level=settings.behav_weight_level,
        sequence_index=sequence_index(batch.loss_mask, lengths),
        decoupled=True,
        token_normaliser=float(sum(lengths)),
    )
    assert stats.loss == float(old_loss.item())

    all_true = [replace(s, output_mask=[True] * len(s.output_token_ids), turn_starts=[0]) for s in samples]
    again = UpdateStats()
    prepared_again = prepare_step([all_true], settings, trainer_updates=2)
    (batch_again,) = build_micro_batches([item.sequence for item in prepared_again.items], [[0, 1, 2]], "packed")
    ppo_update(stand_in, prepared_again.items, prox, [batch_again], settings, again)
    assert again.loss == stats.loss


# --- proximal log-probs, mismatch figures, token counts, staleness ---------------------------


def test_proximal_logprobs_are_the_model_tokens_with_env_tokens_as_context(stand_in: TrainEngine, policy: Any) -> None:
    samples = [episode("g0", 1.0, seed=7), episode("g0", 0.0, seed=8, turns=((3, 4, 1), (2, 2, 1), (1, 1, 2)))]
    settings = RLSettings(micro_batch_tokens=64)
    items = prepare_step([samples], settings, trainer_updates=2).items
    got = compute_proximal(stand_in, items, [0, 1], settings)
    for i, sample in enumerate(samples):
        expected = reference_logprobs(policy, sample)[model_mask(sample)]
        assert got[i].shape == (sample.model_token_count,)
        torch.testing.assert_close(got[i].double(), expected, atol=2e-5, rtol=0)
    # the environment tokens are attended to: without them the model tokens' log-probs change
    first = samples[0]
    model_only = replace(
        first,
        output_token_ids=first.model_values(first.output_token_ids),
        behaviour_logprobs=first.model_values(first.behaviour_logprobs),
        token_versions=first.model_values(first.token_versions),
        output_mask=None,
        turn_starts=None,
    )
    assert float((reference_logprobs(policy, model_only) - got[0].double()).abs().max()) > 1e-3


def _mismatch_reference(
    theta: Sequence[torch.Tensor], samples: Sequence[Sample], trainer_updates: int
) -> dict[str, float]:
    """The mismatch figures of the module :mod:`asyncrl.tasks.algo.mismatch` over model tokens
    only, in float64: d_t = log p_trainer - log p_behav; current tokens have lag 0."""
    behav = [torch.tensor(s.model_values(s.behaviour_logprobs), dtype=torch.float64) for s in samples]
    d = torch.cat([th - b for th, b in zip(theta, behav)])
    lag = torch.tensor([trainer_updates - v for s in samples for v in s.model_values(s.token_versions)])
    d0 = d[lag == 0]
    w = torch.exp(d)
    return {
        "mismatch/current_version_tokens": float(d0.numel()),
        "mismatch/abs_logp_diff_mean": float(d0.abs().mean()),
        "mismatch/abs_logp_diff_max": float(d0.abs().max()),
        "mismatch/k3_kl": float((torch.expm1(d0) - d0).mean()),
        "mismatch/ess": float(w.sum() ** 2 / (w.numel() * (w * w).sum())),
        "mismatch/behav_weight_max/staleness_1": float(w[lag == 1].max()),
    }


def test_step_figures_count_model_tokens_and_leave_env_tokens_out(stand_in: TrainEngine, policy: Any) -> None:
    groups = [
        [episode("g0", 1.0, seed=9), episode("g0", 0.0, seed=10, turns=((5, 2, 2), (2, 3, 2)))],
        [episode("g1", 0.0, seed=11, turns=((3, 1, 1), (4, 0, 2))), single_turn("g1", 1.0, seed=12)],
    ]
    samples = [s for g in groups for s in g]
    theta = [reference_logprobs(policy, s)[model_mask(s)] for s in samples]
    result = run_rl_step(stand_in, groups, RLSettings(micro_batch_tokens=128), trainer_updates=2)
    metrics = result.metrics()

    model_tokens = sum(s.model_token_count for s in samples)
    env_tokens = sum(len(s.output_token_ids) for s in samples) - model_tokens
    assert (metrics["output_tokens"], metrics["context_tokens"]) == (model_tokens, env_tokens) == (30, 11)
    assert metrics["sequence_tokens"] == sum(len(s.prompt_token_ids) + len(s.output_token_ids) for s in samples)
    assert result.update.tokens == model_tokens
    # staleness = trainer updates - min version over model tokens
    assert result.prepared.staleness == (1, 0, 1, 0)

    expected = _mismatch_reference(theta, samples, trainer_updates=2)
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    # counting environment tokens would have given more current-version tokens
    all_current = sum(v == 2 for s in samples for v in s.token_versions)
    assert metrics["mismatch/current_version_tokens"] < all_current

    # values at environment positions (0.0 by contract) cannot reach the figures: absurd ones change nothing
    def absurd(s: Sample) -> Sample:
        return replace(s, behaviour_logprobs=[v if m else -50.0 for v, m in zip(s.behaviour_logprobs, model_mask(s).tolist())])

    absurd_groups = [[absurd(s) for s in g] for g in groups]
    again = run_rl_step(stand_in, absurd_groups, RLSettings(micro_batch_tokens=128), trainer_updates=2).metrics()
    assert {k: v for k, v in again.items() if k.startswith("mismatch/")} == result.mismatch
    assert again["loss"] == metrics["loss"]


def test_staleness_and_dropped_tokens_use_model_tokens_only() -> None:
    """Environment tokens carry the version of the model token before them; even if a row
    broke that rule (rows are only validated in shards), they never set the staleness."""
    sample = episode("g0", 1.0, seed=13, turns=((3, 2, 4), (2, 1, 4)))
    off_contract = replace(sample, token_versions=[4 if m else 0 for m in model_mask(sample).tolist()])
    assert sample_staleness(off_contract, trainer_updates=5) == 1
    prepared = prepare_step([[off_contract, sample]], RLSettings(max_staleness=1), trainer_updates=5)
    assert prepared.staleness == (1, 1) and prepared.dropped_stale == 0
    assert all(item.token_lag == (1,) * 5 and item.logp_behav.shape == (5,) for item in prepared.items)

    step_input = StepInput(shards=("s",), groups=((off_contract, sample),))
    assert stale_tokens(step_input, max_staleness=0, trainer_updates=5, updates_of=lambda v: v) == 2 * 5


def test_the_feed_hands_out_masked_rows_and_checks_their_env_tokens_too(tmp_path: Path) -> None:
    root = open_root(str(tmp_path / "store"))
    group = [episode("g0", 1.0, seed=14), episode("g0", 0.0, seed=15)]
    ShardWriter(root, "masked-run").write_groups([group])
    taken = ShardFeed(ShardReader(root, "masked-run"), vocab_size=320, token_budget=64).take(1)
    assert taken is not None
    for read, written in zip(taken.groups[0], group):  # log-probs went through float32
        assert (read.output_mask, read.turn_starts) == (written.output_mask, written.turn_starts)
        assert read.output_token_ids == written.output_token_ids and read.model_token_count == 9
    # environment tokens are model input: they must be in the vocabulary and fit the budget
    env_at = model_mask(group[0]).tolist().index(False)
    bad = replace(group[0], output_token_ids=[5000 if t == env_at else v for t, v in enumerate(group[0].output_token_ids)])
    with pytest.raises(TrainerInputError, match="row 0 .*output_token_ids holds token id 5000"):
        check_samples("s", [[bad]], vocab_size=320, token_budget=64)
    with pytest.raises(TrainerInputError, match=f"prompt \\+ output is {len(PROMPT) + 14} tokens, over"):
        check_samples("s", [group], vocab_size=320, token_budget=len(PROMPT) + 13)
