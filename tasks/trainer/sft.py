"""Supervised fine-tuning (the pipeline's warm-start) on the RL trainer's engine.

Each example is the rendered prompt, the reference answer (a code row: its program, fenced
as the code reward extracts it) and EOS; the loss is cross-entropy on the answer tokens only:

    loss = -(1 / N) * sum_{answer tokens t} log pi_theta(x_t | x_<t)
    N = answer tokens in the batch

over token-budget micro-batches with one optimizer update per batch. With W data-parallel
ranks every rank draws the same batch, trains its token-balanced share
(:func:`~asyncrl.tasks.trainer.data_parallel.balanced_partition`), with N summed over ranks
and the loss multiplied by W (DeepSpeed averages gradients): the one-rank update.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncrl.tasks.data.records import CODE_TASK, PromptRecord
from asyncrl.tasks.data.prompting import PromptFormat, render_prompt
from asyncrl.tasks.data.synthetic import format_final_answer
from asyncrl.tasks.trainer.batch import MicroBatch, TokenSequence, build_micro_batches, filler_micro_batch
from asyncrl.tasks.trainer.data_parallel import all_reduce_floats, balanced_partition
from asyncrl.tasks.trainer.engine import TrainEngine
from asyncrl.tasks.trainer.logprobs import filler_passes, lockstep_passes, micro_batch_logprobs
from asyncrl.tasks.trainer.metrics import MetricsSink
from asyncrl.tasks.algo.packing import get_packer

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SFTSettings:
    steps: int
    batch_size: int
    """Examples per optimizer update."""
    micro_batch_tokens: int
    packer: str = "ffd"
    seed: int = 0


CODE_FENCE_LANGUAGE = "python"


def sft_target(record: PromptRecord, code_extract: str = "last_fence") -> str:
    """The answer text trained on.

    - a ``code`` row: its reference program (``solution``) in the form the code reward
      extracts with ``reward.code.extract`` = ``code_extract``: a ```python fenced block
      for ``last_fence`` / ``first_fence``, the bare program for ``whole``;
    - any other row: the reference solution ending in ``#### <answer>`` (the final-answer
      line is appended when the solution lacks it).
    """
    if record.task == CODE_TASK:
        if not record.solution or not record.solution.strip():
            raise ValueError(f"prompt {record.prompt_id}: a code row without a reference program (solution) cannot be trained on")
        program = record.solution.rstrip("\n")
        if code_extract == "whole":
            return program
        if code_extract in ("last_fence", "first_fence"):
            return f"```{CODE_FENCE_LANGUAGE}\n{program}\n```"
        raise ValueError(f"reward.code.extract: unknown mode {code_extract!r}; allowed: 'last_fence', 'first_fence', 'whole'")
    final = format_final_answer(record.answer)
    if not record.solution:
        return final
    if record.solution.rstrip().endswith(final):
        return record.solution
    return f"{record.solution}\n{final}"


def sft_sequences(
    records: Sequence[PromptRecord],
    tokenizer: Any,
    prompt_format: PromptFormat = "plain",
    code_extract: str = "last_fence",
) -> list[TokenSequence]:
    """Prompt tokens (rendered as rollout renders them) and answer tokens + EOS per record;
    ``code_extract`` (``reward.code.extract``) shapes code rows' targets (:func:`sft_target`).
    A record with a ``conversation`` (a multi-turn demonstration) becomes the tokens an
    episode would record (:func:`~asyncrl.tasks.agent.demonstration.demonstration_tokens`),
    trained on its assistant turns only: the loss of the module docstring then sums over
    those turns' tokens, and N counts them."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("SFT needs a tokenizer with an EOS token")
    sequences = []
    for record in records:
        if record.conversation is not None:
            from asyncrl.tasks.agent.demonstration import demonstration_tokens

            try:
                demo = demonstration_tokens(tokenizer, record.conversation["messages"], record.conversation["tools"])
            except ValueError as exc:
                raise ValueError(f"prompt {record.prompt_id}: its conversation cannot be trained on: {exc}") from None
            sequences.append(TokenSequence(tuple(demo.prompt_token_ids), tuple(demo.output_token_ids), tuple(demo.output_mask)))
            continue
        prompt = tokenizer(render_prompt(record.prompt, prompt_format, tokenizer), add_special_tokens=False)["input_ids"]
        answer = tokenizer(sft_target(record, code_extract), add_special_tokens=False)["input_ids"]
        sequences.append(TokenSequence(tuple(prompt), (*answer, eos)))
    return sequences


def _micro_batches(sequences: Sequence[TokenSequence], settings: SFTSettings) -> list[MicroBatch]:
    if not sequences:
        return []
    groups = get_packer(settings.packer)([len(s) for s in sequences], settings.micro_batch_tokens)
    return build_micro_batches(sequences, groups, "packed")


def _batch_loss(logp: torch.Tensor, mask: torch.Tensor, normaliser: float) -> torch.Tensor:
    import torch

    return -torch.where(mask, logp, torch.zeros_like(logp)).sum() / normaliser


def _rank_share(engine: TrainEngine, sequences: Sequence[TokenSequence]) -> list[TokenSequence]:
    """This rank's token-balanced share of ``sequences`` (all of them with one rank)."""
    shares = balanced_partition([len(s) for s in sequences], engine.world_size)
    return [sequences[i] for i in shares[engine.rank]]


def sft_loss(engine: TrainEngine, sequences: Sequence[TokenSequence], settings: SFTSettings) -> float:
    """The SFT loss of ``sequences`` (formula in the module docstring), without gradient
    (collective with several ranks: each computes its share, the parts are summed; under
    ZeRO 3 a rank with fewer micro-batches runs filler passes, as forward passes are
    collectives there)."""
    import torch

    batches = _micro_batches(_rank_share(engine, sequences), settings)
    (normaliser,) = all_reduce_floats([float(sum(b.output_tokens for b in batches))], "sum")
    passes = lockstep_passes(engine.ds, len(batches))
    engine.module.eval()
    total = 0.0
    with torch.no_grad():
        for batch in batches:
            logp = micro_batch_logprobs(engine.ds, batch, engine.logit_chunk_tokens)
            total += float(_batch_loss(logp, batch.loss_mask.to(logp.device), normaliser).item())
    if sequences:
        filler_passes(engine.ds, sequences[0], passes - len(batches), engine.logit_chunk_tokens)
    return all_reduce_floats([total], "sum")[0]


def sft_update(engine: TrainEngine, sequences: Sequence[TokenSequence], settings: SFTSettings) -> float:
    """One optimizer update on ``sequences``; returns the batch loss before the update.

    Collective with W ranks: rank r trains its share, normalised by the answer tokens N of
    the whole batch (summed over ranks), with backward on W * loss; ranks with fewer
    micro-batches run zero-weighted fillers so every rank runs as many backward passes."""
    local = _rank_share(engine, sequences)
    batches = _micro_batches(local, settings) if local else []
    (normaliser,) = all_reduce_floats([float(sum(b.output_tokens for b in batches))], "sum")
    (rounds,) = (int(r) for r in all_reduce_floats([float(len(batches))], "max"))
    world = engine.world_size
    engine.module.train()
    total = 0.0
    for k in range(rounds):
        if k < len(batches):
            logp = micro_batch_logprobs(engine.ds, batches[k], engine.logit_chunk_tokens)
            loss = _batch_loss(logp, batches[k].loss_mask.to(logp.device), normaliser)
            total += float(loss.item())
        else:
            loss = micro_batch_logprobs(engine.ds, filler_micro_batch(sequences[0]), engine.logit_chunk_tokens).sum() * 0.0
        engine.ds.backward(loss * world)
    engine.ds.step()
    return all_reduce_floats([total], "sum")[0]


def batch_indices(n: int, batch_size: int, seed: int) -> Iterator[list[int]]:
    """Endless batches of min(batch_size, n) example indices: each epoch visits all n
    examples once in an order shuffled with ``seed``; a batch may span two epochs."""
    rng = random.Random(seed)
    order: list[int] = []
    while True:
        batch: list[int] = []
        while len(batch) < min(batch_size, n):
            if not order:
                order = list(range(n))
                rng.shuffle(order)
            batch.append(order.pop())
        yield batch


def run_sft(
    engine: TrainEngine,
    sequences: Sequence[TokenSequence],
    settings: SFTSettings,
    metrics: MetricsSink | None = None,
) -> list[float]:
    """``settings.steps`` updates on batches drawn by reshuffling ``sequences`` each epoch;
    returns the loss of each step's batch."""
    if not sequences:
        raise ValueError("SFT needs at least one example")
    batches = batch_indices(len(sequences), settings.batch_size, settings.seed)
    losses = []
    for step in range(1, settings.steps + 1):
        batch = [sequences[i] for i in next(batches)]
        started = time.perf_counter()
        loss = sft_update(engine, batch, settings)
        elapsed = time.perf_counter() - started
        losses.append(loss)
        if metrics is not None:
            tokens = sum(len(s) for s in batch)
            metrics.log(
                step,
                {
                    "sft_loss": loss,
                    "sequence_tokens": float(tokens),
                    "output_tokens": float(sum(s.trained_count for s in batch)),
                    "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
                    "step_time_s": elapsed,
                    "learning_rate": engine.learning_rate(),
                },
            )
    return losses
