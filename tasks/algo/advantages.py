"""Group-relative advantages for rule-based, final-answer rewards (discount 1)."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Literal, get_args

import torch

AdvantageMethod = Literal["grpo", "drgrpo", "rloo"]
ADVANTAGE_METHODS: tuple[str, ...] = get_args(AdvantageMethod)


def group_advantages(rewards: torch.Tensor, method: AdvantageMethod, eps: float = 1e-6) -> torch.Tensor:
    """Per-sample advantages from rewards of shape (G, n): G prompt groups, n samples each.

    With mean_g and std_g the mean and population standard deviation (ddof=0)
    of group g's rewards:

    - "grpo":   A_gi = (r_gi - mean_g) / (std_g + eps)
    - "drgrpo": A_gi = r_gi - mean_g                       (Dr.GRPO: no std division)
    - "rloo":   A_gi = r_gi - mean_{j != i} r_gj = n / (n - 1) * (r_gi - mean_g),  n >= 2

    A group whose rewards are all equal gets exactly 0 (never NaN, for any eps >= 0);
    so does a GRPO group whose std_g + eps is 0 in floating point.
    Returns a tensor of shape (G, n) in the rewards' dtype.
    """
    if method not in ADVANTAGE_METHODS:
        raise ValueError(f"advantage method must be one of {list(ADVANTAGE_METHODS)}, got {method!r}")
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if rewards.dim() != 2:
        raise ValueError(f"rewards must have shape (G, n) (groups, samples per group), got {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        raise ValueError(f"rewards must be a floating-point tensor, got dtype {rewards.dtype}")
    n_groups, n = rewards.shape
    if method == "rloo" and n < 2:
        raise ValueError(f"rloo needs n >= 2 samples per group (leave-one-out mean), got n={n}")
    finite = torch.isfinite(rewards)
    if not bool(finite.all()):
        group, sample = (int(i) for i in torch.nonzero(~finite)[0])
        raise ValueError(f"rewards[{group}, {sample}] is not finite: {float(rewards[group, sample])}")
    if n_groups == 0 or n == 0:
        return torch.zeros_like(rewards)

    # Exact check: r - mean need not round to 0 for equal r (e.g. three 0.1s).
    constant = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)  # (G, 1)
    centred = torch.where(constant, 0.0, rewards - rewards.mean(dim=1, keepdim=True))  # (G, n)
    if method == "drgrpo":
        return centred
    if method == "rloo":
        return centred * (n / (n - 1))
    std = centred.pow(2).mean(dim=1, keepdim=True).sqrt()  # (G, 1), ddof=0
    # std can underflow to 0 for non-equal rewards a few ulps apart; with eps = 0 give 0, not inf.
    degenerate = constant | (std + eps == 0)
    return torch.where(degenerate, 0.0, centred / torch.where(degenerate, 1.0, std + eps))


def scale_negative_advantages(advantages: torch.Tensor, scale: float) -> torch.Tensor:
    """Advantages with the negative ones multiplied by ``scale`` in [0, 1]:

        A'_i = A_i          if A_i >= 0
        A'_i = scale * A_i  if A_i < 0

    scale 1 leaves them unchanged; scale 0 trains on the group's better-than-mean samples
    only (online rejection-sampling fine-tuning). A long failed answer whose steps are mostly
    right is pushed down on every token at scale 1; a small scale keeps what it got right.
    """
    if not 0.0 <= scale <= 1.0:
        raise ValueError(f"negative advantage scale must be in [0, 1], got {scale}")
    return torch.where(advantages < 0, advantages * scale, advantages)


def token_advantages(
    seq_advantages: torch.Tensor,
    output_lengths: Sequence[int],
    *,
    prompt_lengths: Sequence[int] | None = None,
) -> torch.Tensor:
    """Broadcast each sample's advantage to its output tokens, packed into one 1-D tensor.

    With discount 1 and the reward on the final answer only, every output token
    of sample k has advantage A_t = A_k.  Without ``prompt_lengths`` the result
    is [A_0] * L_0 + [A_1] * L_1 + ... of length sum(L_k), L_k = output_lengths[k].
    With ``prompt_lengths`` P_k each sample is laid out as P_k zeros followed by
    L_k copies of A_k (the packed prompt + output layout), length sum(P_k + L_k).
    """
    if seq_advantages.dim() != 1:
        raise ValueError(f"seq_advantages must be 1-D (one value per sample), got shape {tuple(seq_advantages.shape)}")
    out_lens = _lengths("output_lengths", output_lengths, seq_advantages.shape[0])
    device = seq_advantages.device
    per_output = torch.repeat_interleave(seq_advantages, torch.tensor(out_lens, dtype=torch.long, device=device))
    if prompt_lengths is None:
        return per_output
    p_lens = _lengths("prompt_lengths", prompt_lengths, seq_advantages.shape[0])
    # Interleave zeros for prompt tokens: sample k occupies [P_k zeros, L_k values].
    lens = torch.tensor(
        [x for pair in zip(p_lens, out_lens, strict=True) for x in pair], dtype=torch.long, device=device
    )
    values = torch.stack([torch.zeros_like(seq_advantages), seq_advantages], dim=1).reshape(-1)  # (2N,)
    return torch.repeat_interleave(values, lens)


def _lengths(name: str, lengths: Sequence[int], expected: int) -> list[int]:
    values: list[int] = []
    for index, raw in enumerate(lengths):
        try:
            value = operator.index(raw)
        except TypeError:
            raise TypeError(f"{name}[{index}] must be an integer, got {raw!r}") from None
        if value < 0:
            raise ValueError(f"{name}[{index}] must be >= 0, got {value}")
        values.append(value)
    if len(values) != expected:
        raise ValueError(f"{name} has {len(values)} entries but seq_advantages has {expected}")
    return values
