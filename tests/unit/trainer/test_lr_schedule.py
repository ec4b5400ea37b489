"""The learning-rate schedule: linear warm-up, then constant or cosine decay."""

from __future__ import annotations

import math

import pytest

from asyncrl.configs.trainer import OptimizerConfig
from asyncrl.tasks.trainer.engine import lr_factor


def test_warmup_then_constant() -> None:
    opt = OptimizerConfig(lr=1e-3, warmup_steps=4)
    assert [lr_factor(u, opt, 100) for u in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_decays_from_one_to_the_floor_by_the_last_update() -> None:
    opt = OptimizerConfig(lr=1e-3, warmup_steps=2, decay="cosine", min_lr_ratio=0.1)
    total = 12
    factors = [lr_factor(u, opt, total) for u in range(total)]
    assert factors[:2] == [0.5, 1.0]
    assert factors[2] == 1.0 and factors[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(factors[2:], factors[3:]))  # strictly decreasing after warm-up
    middle = 2 + (total - 2 - 1) / 2  # half-way through the decay: (1 + m) / 2
    assert lr_factor(math.floor(middle), opt, total) > 0.55 > lr_factor(math.ceil(middle), opt, total)
    assert lr_factor(50, opt, total) == pytest.approx(0.1)  # past the end: stays at the floor


def test_cosine_without_a_known_length_stays_constant() -> None:
    opt = OptimizerConfig(lr=1e-3, decay="cosine")
    assert lr_factor(0, opt, None) == lr_factor(1000, opt, None) == 1.0
