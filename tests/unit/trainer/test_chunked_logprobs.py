"""Log-probs with the logits computed a chunk of positions at a time equal the whole-logits
ones (values and gradients, float64), and no tensor of the chunked path, forward or backward,
holds more than a chunk's logits."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from asyncrl.tasks.model.tiny import TinyModelSpec, tiny_qwen2_config
from asyncrl.tasks.trainer.batch import TokenSequence, build_micro_batches
from asyncrl.tasks.trainer.chunked_head import chunkable_head, chunked_token_logprobs, head_returns_logprobs
from asyncrl.tasks.trainer.logprobs import micro_batch_logprobs

VOCAB, HIDDEN, ROWS = 97, 16, 50


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    weight = torch.randn(VOCAB, HIDDEN, dtype=torch.float64, requires_grad=True)
    hidden = torch.randn(ROWS, HIDDEN, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, VOCAB, (ROWS,))
    return weight, hidden, targets


def _whole(weight: torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(hidden @ weight.t(), dim=-1).gather(1, targets[:, None])[:, 0]


@pytest.mark.parametrize("chunk", [1, 7, 16, ROWS, ROWS + 13])
def test_chunked_values_and_gradients_equal_the_whole_logits_ones_in_float64(chunk: int) -> None:
    weight, hidden, targets = _inputs()
    upstream = torch.randn(ROWS, dtype=torch.float64)

    chunked = chunked_token_logprobs(hidden, weight, targets, chunk)
    (chunked * upstream).sum().backward()
    grads_chunked = hidden.grad.clone(), weight.grad.clone()
    hidden.grad, weight.grad = None, None

    whole = _whole(weight, hidden, targets)
    (whole * upstream).sum().backward()

    assert chunked.dtype == torch.float64 and chunked.shape == (ROWS,)
    assert float((chunked - whole).detach().abs().max()) < 1e-6
    assert float((grads_chunked[0] - hidden.grad).abs().max()) < 1e-6
    assert float((grads_chunked[1] - weight.grad).abs().max()) < 1e-6


def test_gradcheck_of_the_chunked_head() -> None:
    torch.manual_seed(2)
    weight = torch.randn(11, 5, dtype=torch.float64, requires_grad=True)
    hidden = torch.randn(9, 5, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (9,))
    assert torch.autograd.gradcheck(lambda h, w: chunked_token_logprobs(h, w, targets, 4), (hidden, weight))


class LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an operator returns."""

    def __init__(self) -> None:
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.most = max(self.most, tensor.numel())
        return out


def test_no_tensor_forward_or_backward_holds_more_than_a_chunk_of_logits() -> None:
    weight, hidden, targets = _inputs(1)
    with LargestTensor() as seen:
        chunked_token_logprobs(hidden, weight, targets, 16).sum().backward()
    # One chunk's logits (16 x V), or the weight's gradient (V x H), whichever is larger;
    # the whole logits would be ROWS x V.
    assert seen.most == max(16 * VOCAB, VOCAB * HIDDEN) < ROWS * VOCAB


def test_a_chunk_size_below_one_is_refused() -> None:
    weight, hidden, targets = _inputs()
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1, got 0"):
        chunked_token_logprobs(hidden, weight, targets, 0)


def test_the_head_returns_logprobs_inside_the_block_only() -> None:
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False, dtype=torch.float64)
    hidden = torch.randn(2, 3, HIDDEN, dtype=torch.float64)
    targets = torch.randint(0, VOCAB, (6,))
    with head_returns_logprobs(head, targets, 4):
        inside = head(hidden)
    assert inside.shape == (2, 3)
    expected = _whole(head.weight, hidden.reshape(-1, HIDDEN), targets).reshape(2, 3)
    assert float((inside - expected).abs().max()) < 1e-9
    assert head(hidden).shape == (2, 3, VOCAB)  # the logits again after the block


def test_only_a_plain_models_bias_free_linear_head_is_chunked() -> None:
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM(tiny_qwen2_config(TinyModelSpec(num_layers=1)))
    assert chunkable_head(model) is model.lm_head
    model.config.model_type = "gemma2"  # logits soft-capped after the head: not W h alone
    assert chunkable_head(model) is None
    model.config.model_type = "qwen2"
    model.lm_head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    assert chunkable_head(model) is None


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
