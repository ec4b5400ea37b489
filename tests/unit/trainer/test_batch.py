"""Micro-batch layouts and per-token log-probs, on the tiny Qwen2 in plain transformers (no DeepSpeed)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from asyncrl.tasks.trainer.batch import TokenSequence, build_micro_batches, pack_sequences, pad_sequences
from asyncrl.bench.trainer import long_tailed_lengths
from asyncrl.tasks.trainer.feed import TrainerInputError, check_samples
from asyncrl.tasks.trainer.logprobs import micro_batch_logprobs, sequence_logprobs
from asyncrl.tasks.algo.packing import fixed_count_micro_batches, pack_micro_batches, packing_efficiency


def _sequences(n: int, seed: int) -> list[TokenSequence]:
    rng = random.Random(seed)
    return [
        TokenSequence(
            tuple(rng.randrange(256) for _ in range(rng.randint(1, 9))),
            tuple(rng.randrange(256) for _ in range(rng.randint(1, 15))),
        )
        for _ in range(n)
    ]


def _alone(model: Any, seq: TokenSequence) -> torch.Tensor:
    """Output-token log-probs of one sequence in its own forward pass, computed directly."""
    tokens = torch.tensor([[*seq.prompt_ids, *seq.output_ids]])
    with torch.no_grad():
        logits = model(input_ids=tokens).logits[0]  # (S, V)
    logp = torch.log_softmax(logits.float(), dim=-1)
    n_prompt = len(seq.prompt_ids)
    positions = torch.arange(n_prompt - 1, tokens.shape[1] - 1)
    return logp[positions, tokens[0, positions + 1]]


def test_packed_sequences_do_not_attend_to_each_other(hf_model: Any) -> None:
    seqs = _sequences(5, seed=1)
    expected = [_alone(hf_model, s) for s in seqs]
    batch = pack_sequences(seqs, [3, 0, 4, 1, 2])
    assert batch.input_ids.shape == (1, sum(len(s) for s in seqs))
    assert batch.real_tokens == batch.slots  # no padding
    with torch.no_grad():
        got = batch.split(micro_batch_logprobs(hf_model, batch))
    for index, values in zip(batch.sample_ids, got):
        torch.testing.assert_close(values, expected[index], atol=2e-5, rtol=0)


def test_padded_layout_gives_the_same_logprobs(hf_model: Any) -> None:
    seqs = _sequences(4, seed=2)
    batch = pad_sequences(seqs, [0, 1, 2, 3])
    longest = max(len(s) for s in seqs)
    assert batch.input_ids.shape == (4, longest)
    assert batch.slots == 4 * longest > batch.real_tokens
    with torch.no_grad():
        got = batch.split(micro_batch_logprobs(hf_model, batch))
    for seq, values in zip(seqs, got):
        torch.testing.assert_close(values, _alone(hf_model, seq), atol=2e-5, rtol=0)


def test_loss_mask_selects_exactly_the_output_tokens() -> None:
    seqs = _sequences(6, seed=3)
    for batch in build_micro_batches(seqs, [[0, 1, 2], [3, 4, 5]], "packed") + build_micro_batches(
        seqs, [[0, 1, 2], [3, 4, 5]], "padded"
    ):
        outputs = [tok for i in batch.sample_ids for tok in seqs[i].output_ids]
        assert batch.targets[batch.loss_mask].tolist() == outputs
        values = [torch.arange(len(seqs[i].output_ids), dtype=torch.float32) + 100 * i for i in batch.sample_ids]
        expanded = batch.expand(values)
        assert torch.equal(expanded[~batch.loss_mask], torch.zeros(int((~batch.loss_mask).sum())))
        for original, back in zip(values, batch.split(expanded)):
            assert torch.equal(original, back)


def test_sequence_logprobs_restores_input_order(hf_model: Any) -> None:
    seqs = _sequences(7, seed=4)
    groups = pack_micro_batches([len(s) for s in seqs], 40)
    got = sequence_logprobs(hf_model, seqs, groups)
    for seq, values in zip(seqs, got):
        torch.testing.assert_close(values, _alone(hf_model, seq), atol=2e-5, rtol=0)


def test_layout_errors_name_the_problem() -> None:
    seqs = [TokenSequence((1, 2), ()), TokenSequence((1,), (2,))]
    with pytest.raises(ValueError, match="sequence 0: needs >= 1 prompt and >= 1 output token"):
        pack_sequences(seqs, [0])
    with pytest.raises(ValueError, match="outside 0..1"):
        pack_sequences(seqs, [5])
    with pytest.raises(ValueError, match="layout must be one of"):
        build_micro_batches(seqs, [[1]], "ragged")  # type: ignore[arg-type]


def test_vocabulary_and_budget_checks_name_shard_row_field_value(trajectories: Any) -> None:
    group = trajectories.group("g0", [1.0, 0.0])
    check_samples("trajectories/s.arrow", [group], vocab_size=320, token_budget=256)
    bad = trajectories.group("g1", [1.0, 0.0])
    bad[1] = type(bad[1])(**{**vars(bad[1]), "output_token_ids": [5, 320, 7][: len(bad[1].output_token_ids)]})
    with pytest.raises(TrainerInputError, match=r"trajectories/s.arrow: row 3 \(group_id 'g1'\): output_token_ids holds token id 320"):
        check_samples("trajectories/s.arrow", [group, bad], vocab_size=320, token_budget=256)
    with pytest.raises(TrainerInputError, match=r"row 0 .* over trainer.micro_batch_tokens=8"):
        check_samples("trajectories/s.arrow", [group], vocab_size=320, token_budget=8)


def test_packing_efficiency_on_long_tailed_batch() -> None:
    lengths = long_tailed_lengths(256, min_len=32, max_len=1024, seed=0)
    assert max(lengths) >= 8 * sorted(lengths)[len(lengths) // 2]  # a long tail indeed
    budget = 2048
    packed = pack_micro_batches(lengths, budget)
    efficiency = packing_efficiency(lengths, packed, budget)
    fixed = packing_efficiency(lengths, fixed_count_micro_batches(lengths, 8), None)
    assert efficiency >= 0.95
    assert fixed < efficiency
