"""Per-task figures of scored samples: mean reward, pass@1 and unbiased pass@k.

A sample is correct when its reward is at least :data:`CORRECT_REWARD`. For a prompt with n
samples of which c are correct (Chen et al., 2021)::

    pass@k = 1 - C(n - c, k) / C(n, k)        (1 when n - c < k; defined for k <= n)

A task's figure is the mean over its prompts (pass@k over those with n >= k); pass@1 is
c / n. Metric names: ``reward_mean/<task>``, ``pass_at_1/<task>``, ``pass_at_<k>/<task>``,
``prompts/<task>`` (MLflow allows no ``@``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from math import comb

CORRECT_REWARD = 1.0


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt from ``n`` samples, ``c`` of them correct (module docstring)."""
    if not 0 <= c <= n:
        raise ValueError(f"pass@k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k: need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def task_figures(groups: Iterable[tuple[str, Sequence[float]]], ks: Sequence[int] = ()) -> dict[str, float]:
    """``reward_mean/<task>`` (over samples), ``pass_at_1/<task>`` and ``pass_at_<k>/<task>``
    for each k of ``ks`` (over the task's prompts with at least k samples; absent if none),
    and ``prompts/<task>``, from (task, rewards of one prompt's samples) pairs."""
    by_task: dict[str, list[Sequence[float]]] = {}
    for task, rewards in groups:
        if rewards:
            by_task.setdefault(task, []).append(rewards)
    figures: dict[str, float] = {}
    for task, prompts in sorted(by_task.items()):
        samples = [reward for rewards in prompts for reward in rewards]
        figures[f"reward_mean/{task}"] = sum(samples) / len(samples)
        figures[f"prompts/{task}"] = float(len(prompts))
        for k in sorted({1, *ks}):
            values = [
                pass_at_k(len(rewards), sum(r >= CORRECT_REWARD for r in rewards), k)
                for rewards in prompts
                if len(rewards) >= k
            ]
            if values:
                figures[f"pass_at_{k}/{task}"] = sum(values) / len(values)
    return figures
