"""Log-probs with the logits computed a chunk of positions at a time equal the whole-logits
ones (values and gradients, float64), and no call of the head ever sees more than a chunk."""

from __future__ import annotations

import pytest
import torch

from asyncrl.tasks.model.tiny import TinyModelSpec, tiny_qwen2_config
from asyncrl.tasks.trainer.batch import TokenSequence, build_micro_batches
from asyncrl.tasks.trainer.logprobs import chunked_token_logprobs, micro_batch_logprobs

VOCAB, HIDDEN, ROWS = 97, 16, 50


class RecordingHead(torch.nn.Module):
    """A linear head that records how many rows each call was given."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(HIDDEN, VOCAB, bias=False, dtype=torch.float64)
        self.rows_seen: list[int] = []

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        self.rows_seen.append(rows.shape[0])
        return self.linear(rows)


def _inputs(seed: int = 0) -> tuple[RecordingHead, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    head = RecordingHead()
    hidden = torch.randn(ROWS, HIDDEN, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, VOCAB, (ROWS,))
    return head, hidden, targets


def _whole(head: RecordingHead, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(head.linear(hidden), dim=-1).gather(1, targets[:, None])[:, 0]


@pytest.mark.parametrize("chunk", [1, 7, 16, ROWS, ROWS + 13])
def test_chunked_values_and_gradients_equal_the_whole_logits_ones_in_float64(chunk: int) -> None:
    head, hidden, targets = _inputs()
    weights = torch.randn(ROWS, dtype=torch.float64)

    chunked = chunked_token_logprobs(hidden, head, targets, chunk)
    (chunked * weights).sum().backward()
    grads_chunked = hidden.grad.clone(), head.linear.weight.grad.clone()
    hidden.grad, head.linear.weight.grad = None, None

    whole = _whole(head, hidden, targets)
    (whole * weights).sum().backward()

    assert chunked.dtype == torch.float64 and chunked.shape == (ROWS,)
    assert float((chunked - whole).abs().max()) < 1e-6
    assert float((grads_chunked[0] - hidden.grad).abs().max()) < 1e-6
    assert float((grads_chunked[1] - head.linear.weight.grad).abs().max()) < 1e-6


def test_no_call_of_the_head_sees_more_than_a_chunk_forward_or_backward() -> None:
    head, hidden, targets = _inputs(1)
    chunked_token_logprobs(hidden, head, targets, 16).sum().backward()
    # 4 chunks (16, 16, 16, 2) in forward, each recomputed once in backward.
    assert sorted(head.rows_seen) == sorted([16, 16, 16, 2] * 2)

    head.rows_seen.clear()
    with torch.no_grad():
        chunked_token_logprobs(hidden, head, targets, 16)
    assert head.rows_seen == [16, 16, 16, 2]  # no grad: no recompute


def test_a_chunk_size_below_one_is_refused() -> None:
    head, hidden, targets = _inputs()
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1, got 0"):
        chunked_token_logprobs(hidden, head, targets, 0)


def test_a_qwen2_micro_batch_gives_the_same_logprobs_and_gradients_chunked_or_whole() -> None:
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    spec = TinyModelSpec(num_layers=2)
    model = Qwen2ForCausalLM(tiny_qwen2_config(spec)).to(torch.float64)
    sequences = [
        TokenSequence([5, 6, 7], [8, 9, 10, 11]),
        TokenSequence([12, 13], [14, 15, 16]),
        TokenSequence([17], [18, 19]),
    ]
    (batch,) = build_micro_batches(sequences, [[0, 1, 2]], "packed")

    def run(chunk: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        model.zero_grad()
        logp = micro_batch_logprobs(model, batch, chunk)
        (logp * batch.loss_mask).sum().backward()
        return logp.detach(), model.lm_head.weight.grad.clone()

    whole, whole_grad = run(None)
    for chunk in (1, 5, 64):
        chunked, chunked_grad = run(chunk)
        assert chunked.dtype == torch.float64
        assert float((chunked - whole).abs().max()) < 1e-6, chunk
        assert float((chunked_grad - whole_grad).abs().max()) < 1e-6, chunk
