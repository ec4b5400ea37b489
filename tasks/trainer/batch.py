"""Micro-batch tensors from token sequences: packed (dynamic micro-batching) or padded.

A sequence is ``prompt + output`` tokens; its *trained* tokens are the output tokens the
model sampled (environment tokens marked by :attr:`TokenSequence.trained` stay in the input
as context). Position j of the flattened layout holds the logit that predicts token j + 1
of the same sequence, and ``loss_mask[j]`` is true exactly when that token is trained, so
the trained tokens of a micro-batch are ``targets[loss_mask]`` and per-token values are
placed with :meth:`MicroBatch.expand`. Packed layout: one row, no padding, ``position_ids``
restarting per sequence (a block-diagonal causal mask in transformers). Padded layout (the
fixed-count baseline): one right-padded row per sequence with a 2-D attention mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

Layout = Literal["packed", "padded"]
LAYOUTS: tuple[str, ...] = ("packed", "padded")


@dataclass(frozen=True)
class TokenSequence:
    """The tokens of one sample: the prompt, then the output (answer, or an agent episode)."""

    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    trained: Sequence[bool] | None = None
    """Per output token: True to train on it (the model sampled it), False for context only
    (an environment inserted it). None: every output token is trained."""

    def __post_init__(self) -> None:
        if self.trained is not None and len(self.trained) != len(self.output_ids):
            raise ValueError(f"trained marks {len(self.trained)} tokens, the output has {len(self.output_ids)}")

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def trained_count(self) -> int:
        """Output tokens trained on: sum_t trained[t], or all output tokens without a mask."""
        if self.trained is None:
            return len(self.output_ids)
        return sum(1 for m in self.trained if m)


@dataclass(frozen=True)
class MicroBatch:
    """Model inputs of R rows of S positions, and per-position training fields of size R*S.

    ``sample_ids`` are the caller's indices of the sequences, in layout order;
    ``output_lengths`` their trained-token counts (:attr:`TokenSequence.trained_count`), so
    ``values[loss_mask].split(output_lengths)`` gives back per-sample values.
    """

    input_ids: torch.Tensor  # (R, S) long
    position_ids: torch.Tensor  # (R, S) long
    attention_mask: torch.Tensor | None  # (R, S) long for the padded layout, None when packed
    targets: torch.Tensor  # (R*S,) long: the next token of the same sequence (0 where none)
    loss_mask: torch.Tensor  # (R*S,) bool
    sample_ids: tuple[int, ...]
    output_lengths: tuple[int, ...]
    real_tokens: int
    """Sequence tokens in the micro-batch (prompt + output, no padding)."""

    @property
    def slots(self) -> int:
        """Positions processed, padding included: R * S."""
        return int(self.input_ids.numel())

    @property
    def output_tokens(self) -> int:
        """Trained output tokens of the micro-batch (``loss_mask`` positions)."""
        return sum(self.output_lengths)

    def expand(self, values: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per-trained-token values of each sample (in ``sample_ids`` order) -> (R*S,) float32, 0 elsewhere."""
        import torch

        if len(values) != len(self.sample_ids):
            raise ValueError(f"expand: got values for {len(values)} samples, micro-batch holds {len(self.sample_ids)}")
        for k, (value, length) in enumerate(zip(values, self.output_lengths)):
            if tuple(value.shape) != (length,):
                raise ValueError(
                    f"expand: sample {self.sample_ids[k]} has {length} trained tokens, got values of shape {tuple(value.shape)}"
                )
        full = torch.zeros(self.slots, dtype=torch.float32)
        if values:
            full[self.loss_mask] = torch.cat([v.to(torch.float32) for v in values])
        return full

    def split(self, per_position: torch.Tensor) -> list[torch.Tensor]:
        """(R*S,) values -> per-sample tensors over their trained tokens (inverse of :meth:`expand`)."""
        return list(per_position[self.loss_mask].split(list(self.output_lengths)))

    def to(self, device: torch.device | str) -> MicroBatch:
        return MicroBatch(
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            attention_mask=None if self.attention_mask is None else self.attention_mask.to(device),
            targets=self.targets.to(device),
            loss_mask=self.loss_mask.to(device),
            sample_ids=self.sample_ids,
            output_lengths=self.output_lengths,
            real_tokens=self.real_tokens,
        )


def _check(sequences: Sequence[TokenSequence], order: Sequence[int]) -> list[TokenSequence]:
    if not order:
        raise ValueError("a micro-batch needs at least one sequence")
    chosen = []
    for index in order:
        if not 0 <= index < len(sequences):
            raise ValueError(f"sequence index {index} outside 0..{len(sequences) - 1}")
        seq = sequences[index]
        if not seq.prompt_ids or not seq.output_ids:
            raise ValueError(
                f"sequence {index}: needs >= 1 prompt and >= 1 output token, "
                f"got {len(seq.prompt_ids)} and {len(seq.output_ids)}"
            )
        chosen.append(seq)
    return chosen


def _sequence_fields(seq: TokenSequence) -> tuple[list[int], list[int], list[bool]]:
    """tokens, targets (next token, 0 at the end), mask (next token is a trained output token):

        mask[j] = P - 1 <= j < P + L - 1 and trained[j - P + 1]

    with P prompt and L output tokens (``trained`` all True when None)."""
    tokens = [*seq.prompt_ids, *seq.output_ids]
    n_prompt = len(seq.prompt_ids)
    targets = [*tokens[1:], 0]
    mask = [False] * len(tokens)
    trained = seq.trained if seq.trained is not None else [True] * len(seq.output_ids)
    mask[n_prompt - 1 : len(tokens) - 1] = [bool(m) for m in trained]
    return tokens, targets, mask


def pack_sequences(sequences: Sequence[TokenSequence], order: Sequence[int]) -> MicroBatch:
    """One packed row of ``sequences[i] for i in order`` (R = 1, S = sum of lengths)."""
    import torch

    chosen = _check(sequences, order)
    tokens: list[int] = []
    positions: list[int] = []
    targets: list[int] = []
    mask: list[bool] = []
    for seq in chosen:
        seq_tokens, seq_targets, seq_mask = _sequence_fields(seq)
        tokens += seq_tokens
        positions += range(len(seq_tokens))
        targets += seq_targets
        mask += seq_mask
    return MicroBatch(
        input_ids=torch.tensor([tokens], dtype=torch.long),  # (1, S)
        position_ids=torch.tensor([positions], dtype=torch.long),  # (1, S)
        attention_mask=None,
        targets=torch.tensor(targets, dtype=torch.long),
        loss_mask=torch.tensor(mask, dtype=torch.bool),
        sample_ids=tuple(order),
        output_lengths=tuple(seq.trained_count for seq in chosen),
        real_tokens=len(tokens),
    )


def pad_sequences(sequences: Sequence[TokenSequence], order: Sequence[int], pad_id: int = 0) -> MicroBatch:
    """One right-padded row per sequence (R = len(order), S = longest length)."""
    import torch

    chosen = _check(sequences, order)
    width = max(len(seq) for seq in chosen)
    rows = len(chosen)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)  # (R, S)
    attention = torch.zeros((rows, width), dtype=torch.long)  # (R, S)
    targets = torch.zeros((rows, width), dtype=torch.long)  # (R, S)
    mask = torch.zeros((rows, width), dtype=torch.bool)  # (R, S)
    for row, seq in enumerate(chosen):
        seq_tokens, seq_targets, seq_mask = _sequence_fields(seq)
        n = len(seq_tokens)
        input_ids[row, :n] = torch.tensor(seq_tokens)
        attention[row, :n] = 1
        targets[row, :n] = torch.tensor(seq_targets)
        mask[row, :n] = torch.tensor(seq_mask)
    positions = torch.arange(width, dtype=torch.long).expand(rows, width).contiguous()  # (R, S)
    return MicroBatch(
        input_ids=input_ids,
        position_ids=positions,
        attention_mask=attention,
        targets=targets.reshape(-1),  # (R*S,)
        loss_mask=mask.reshape(-1),  # (R*S,)
        sample_ids=tuple(order),
        output_lengths=tuple(seq.trained_count for seq in chosen),
        real_tokens=sum(len(seq) for seq in chosen),
    )


def build_micro_batches(
    sequences: Sequence[TokenSequence], groups: Sequence[Sequence[int]], layout: Layout = "packed"
) -> list[MicroBatch]:
    """One micro-batch per index group (e.g. from a packer), in the given layout."""
    if layout == "packed":
        return [pack_sequences(sequences, group) for group in groups]
    if layout == "padded":
        return [pad_sequences(sequences, group) for group in groups]
    raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")


def filler_micro_batch(sequence: TokenSequence) -> MicroBatch:
    """A packed micro-batch of two tokens (the first prompt and first output token of
    ``sequence``): the cheapest forward a data-parallel rank runs, with a zero-weighted
    loss, to match another rank's extra micro-batch."""
    return pack_sequences([TokenSequence(tuple(sequence.prompt_ids[:1]), tuple(sequence.output_ids[:1]))], [0])
