"""The reward request for one response to one prompt row: the row's task picks the reward.

- ``math``: the row's reference answer;
- ``code``: the row's unit tests (:class:`CodeTests`);
- any other task names a plug-in of ``reward.plugins``: the row's answer (possibly empty) is
  its reference and the row's own fields are its keyword arguments.

The scheduler (training) and evaluation both build their requests here, so a task scores the
same way in both.
"""

from __future__ import annotations

from asyncrl.tasks.data.records import CODE_TASK, MATH_TASK, PromptRecord
from asyncrl.tasks.reward.types import RewardRequest


def reward_request(record: PromptRecord, response: str) -> RewardRequest:
    """The request that scores ``response`` by ``record.task`` (module docstring)."""
    if record.task == MATH_TASK:
        return RewardRequest(kind="math", response=response, reference=record.answer)
    if record.task == CODE_TASK:
        if record.tests is None:
            raise ValueError(f"prompt {record.prompt_id}: a code row without tests")
        return RewardRequest(kind="code", response=response, reference=record.tests)
    return RewardRequest(
        kind="plugin", response=response, reference=record.answer, metadata=dict(record.fields), plugin=record.task
    )
