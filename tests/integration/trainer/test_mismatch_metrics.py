"""The train/inference mismatch figures (``mismatch/*``): float64 references by hand, the exact
merge over data-parallel ranks, and on the real engine a step whose behaviour log-probs come
from other weights than the version they claim (a broken weight sync), which the run's
canary flags, next to a correctly synced step, which it does not."""

from __future__ import annotations

import copy
import math
import random
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from asyncrl.tasks.launch.canary import MismatchCanary, mismatch_crossings
from asyncrl.configs.canary import MismatchCanaryConfig
from asyncrl.tasks.algo.mismatch import all_gather_mismatch, local_mismatch, quantile_tail_size, upper_quantile
from asyncrl.tasks.trainer.step import prepare_step, run_rl_step
from asyncrl.tasks.trainer.rl_settings import RLSettings

# Three samples: per token (log p_trainer, log p_behav, lag). Lag 0 = the trainer's weights;
# -1 = a branch discarded by a rollback (staleness 0 but not the current weights).
TOKENS = [
    [(-1.0, -1.1, 0), (-0.5, -0.5, 0), (-2.0, -1.0, 1)],
    [(-0.3, -1.2, 0)],
    [(-1.5, -1.4, 2), (-0.7, -0.9, 0), (-3.0, -2.0, -1), (-0.2, -0.25, 1)],
]


def _figures(
    tokens: list[list[tuple[float, float, int]]], gather: Callable[[Any], list[Any]] = lambda x: [x]
) -> dict[str, float]:
    trainer = [torch.tensor([t[0] for t in s], dtype=torch.float32) for s in tokens]
    behav = [torch.tensor([t[1] for t in s], dtype=torch.float32) for s in tokens]
    lags = [[t[2] for t in s] for s in tokens]
    return all_gather_mismatch(local_mismatch(trainer, behav, lags), gather)


def test_figures_match_the_float64_reference() -> None:
    flat = [t for s in TOKENS for t in s]
    # The inputs go through float32 tensors, as log-probs do in the trainer.
    f32 = [(float(np.float32(a)), float(np.float32(b)), lag) for a, b, lag in flat]
    current = [a - b for a, b, lag in f32 if lag == 0]
    ratios = [math.exp(d) for d in current]
    weights = [math.exp(a - b) for a, b, _ in f32]
    got = _figures(TOKENS)
    assert got["mismatch/current_version_tokens"] == 4
    assert got["mismatch/abs_logp_diff_mean"] == pytest.approx(sum(abs(d) for d in current) / 4, rel=1e-12)
    assert got["mismatch/abs_logp_diff_max"] == pytest.approx(max(abs(d) for d in current), rel=1e-12)
    assert got["mismatch/k3_kl"] == pytest.approx(sum((r - 1) - math.log(r) for r in ratios) / 4, rel=1e-12)
    assert got["mismatch/ratio_outside_frac"] == pytest.approx(1 / 4)  # exp(0.9) = 2.46 > 2
    ess = sum(weights) ** 2 / (len(weights) * sum(w * w for w in weights))
    assert got["mismatch/ess"] == pytest.approx(ess, rel=1e-12)
    by_staleness: dict[int, list[float]] = {}
    for (a, b, lag), w in zip(f32, weights):
        by_staleness.setdefault(max(0, lag), []).append(w)
    assert {k for k in got if "staleness_" in k} == {
        f"mismatch/behav_weight_{kind}/staleness_{s}" for kind in ("p99", "max") for s in (0, 1, 2)
    }
    for s, values in by_staleness.items():
        p99 = float(np.quantile(values, 0.99))
        assert got[f"mismatch/behav_weight_p99/staleness_{s}"] == pytest.approx(p99, rel=1e-12)
        assert got[f"mismatch/behav_weight_max/staleness_{s}"] == pytest.approx(max(values), rel=1e-12)


def test_no_current_version_tokens_leaves_the_current_figures_out() -> None:
    got = _figures([[(-1.0, -1.2, 1), (-0.4, -0.3, 3)]])
    assert got["mismatch/current_version_tokens"] == 0
    assert not {"mismatch/abs_logp_diff_mean", "mismatch/k3_kl", "mismatch/ratio_outside_frac"} & set(got)
    assert "mismatch/behav_weight_p99/staleness_3" in got
    assert _figures([]) == {"mismatch/current_version_tokens": 0.0}


@pytest.mark.parametrize("n", [1, 2, 3, 7, 100, 101, 257, 1000])
def test_upper_quantile_equals_numpy_on_the_tail_alone(n: int) -> None:
    values = np.random.default_rng(n).lognormal(size=n)
    k = quantile_tail_size(n)
    top = sorted(values.tolist(), reverse=True)[:k]
    assert upper_quantile(top, n) == pytest.approx(float(np.quantile(values, 0.99)), rel=1e-12)
    assert k <= math.ceil(0.01 * n) + 1
    with pytest.raises(ValueError, match="needs the"):
        upper_quantile(top[:-1], n)


class ThreadRanks:
    """``world`` ranks as threads: all_gather_objects through a barrier (the transport only;
    the figures' merge is the code under test)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.slots: list[Any] = [None] * world
        self.barrier = threading.Barrier(world)
        self.local = threading.local()

    def all_gather_objects(self, value: Any) -> list[Any]:
        self.slots[self.local.rank] = value
        self.barrier.wait()
        gathered = list(self.slots)
        self.barrier.wait()
        return gathered

    def run(self, work: Callable[[int], Any]) -> list[Any]:
        results: list[Any] = [None] * self.world

        def target(rank: int) -> None:
            self.local.rank = rank
            results[rank] = work(rank)

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        return results


def test_ranks_combine_to_the_one_rank_figures() -> None:
    """Split over 3 ranks, one holding every large weight (its top 1% is the whole tail), the
    figures equal those of one rank over all the tokens."""
    rng = random.Random(3)
    tokens = []
    for k in range(60):
        length = rng.randint(1, 30)
        big = k < 10  # samples 0..9 (rank 0's share) carry the large weights
        tokens.append([(-rng.uniform(0.1, 3), -rng.uniform(0.1, 3) - (rng.uniform(1, 3) if big else 0),
                        rng.choice([0, 0, 1, 2, -1])) for _ in range(length)])  # fmt: skip
    one = _figures(tokens)
    shares = [tokens[:10], tokens[10:45], tokens[45:]]
    ranks = ThreadRanks(3)
    combined = ranks.run(lambda r: _figures(shares[r], ranks.all_gather_objects))
    for figures in combined:
        assert figures.keys() == one.keys()
        for name, value in one.items():
            assert figures[name] == pytest.approx(value, rel=1e-12), name


def test_prepare_step_records_each_token_s_lag_in_updates(trajectories: Any) -> None:
    [group] = [trajectories.group("g", [1.0, 0.0], versions=[4, 6])]
    prepared = prepare_step([group], RLSettings(), trainer_updates=5, updates_of=lambda v: v - 1)
    assert [set(item.token_lag) for item in prepared.items] == [{2}, {0}]  # 5 - (4 - 1), 5 - (6 - 1)
    assert [len(item.token_lag) for item in prepared.items] == [len(s.output_token_ids) for s in group]


# --- the real engine: a broken weight sync trips the canary -----------------------------------


def _hf_logprobs(model: Any) -> Callable[[list[int], list[int]], list[float]]:
    """Behaviour log-probs as a rollout server holding ``model``'s weights would report them."""

    def compute(prompt: list[int], output: list[int]) -> list[float]:
        ids = torch.tensor([prompt + output])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float()  # (S, V)
        logp = torch.log_softmax(logits, dim=-1)
        positions = range(len(prompt) - 1, len(prompt) + len(output) - 1)
        return [float(logp[j, ids[0, j + 1]]) for j in positions]

    return compute


def _stale_model(hf_model: Any) -> Any:
    """Other weights than the trainer's: the model after a large perturbation, standing for a
    server that kept the weights of many updates ago (or loaded the wrong ones)."""
    other = copy.deepcopy(hf_model)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in other.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 2.0 * param.detach().std().clamp(min=0.02))
    return other


def test_a_broken_weight_sync_trips_the_canary_and_a_correct_one_does_not(
    engine: Any, trajectories: Any, hf_model: Any
) -> None:
    """Tokens labelled with the trainer's current version (staleness 0), their behaviour
    log-probs from (a) the same weights through another code path (HF forward, as a correctly
    synced server) and (b) other weights (a server that did not load the new version but
    reports it). The trainer's step computes the figures; the canary judges them."""
    trainer_updates = 3  # the trainer's weights: version 3 (labels count updates here)
    settings = RLSettings(micro_batch_tokens=512)
    synced = [trajectories.group(f"ok{k}", [1.0, 0.0, 1.0, 0.0], versions=trainer_updates,
                                 logprobs=_hf_logprobs(hf_model)) for k in range(2)]  # fmt: skip
    broken = [trajectories.group(f"bad{k}", [1.0, 0.0, 1.0, 0.0], versions=trainer_updates,
                                 logprobs=_hf_logprobs(_stale_model(hf_model))) for k in range(2)]  # fmt: skip

    good = run_rl_step(engine, synced, settings, trainer_updates).metrics()
    canary = MismatchCanary(MismatchCanaryConfig())  # the defaults
    assert good["mismatch/current_version_tokens"] >= 32
    assert good["mismatch/abs_logp_diff_mean"] < 1e-4  # float32, same weights: numerics only
    assert good["mismatch/ratio_outside_frac"] == 0.0
    assert mismatch_crossings(good, canary.config) == {}
    assert canary.observe(1, good) is None

    bad = run_rl_step(engine, broken, settings, trainer_updates).metrics()
    crossed = mismatch_crossings(bad, canary.config)
    assert crossed is not None and set(crossed) == set(canary.config.thresholds())  # every figure, clearly
    alarm = canary.observe(2, bad)
    assert alarm is not None and alarm.step == 2 and set(alarm.crossed) == set(crossed)
    assert canary.observe(3, bad) is None  # once per crossing, not every step
    assert canary.observe(4, good) is None and canary.observe(5, bad) is not None  # re-armed
