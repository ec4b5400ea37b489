"""The synthetic specs (configs) and the generators (tasks/data) agree on the names they share."""

from __future__ import annotations

import pytest

from asyncrl.configs.synthetic_specs import DEFAULT_OPERATIONS, STEP_NAMES, CodeSpec
from asyncrl.tasks.data.synthetic_code import STEPS


def test_every_step_name_has_an_implementation_and_no_more() -> None:
    assert set(STEP_NAMES) == set(STEPS)
    assert set(DEFAULT_OPERATIONS) <= set(STEPS)


def test_an_unknown_operation_is_refused_naming_it_and_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"CodeSpec.operations: .*sort.*unknown: juggle"):
        CodeSpec(operations=("sort", "juggle"))
