"""The journal object: what is written is read back exactly; a malformed one is refused, named."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.storage.fs import open_root
from asyncrl.storage.journal import (
    JOURNAL_PATH,
    JournaledSample,
    JournaledTurn,
    read_journal,
    read_journal_contents,
    write_journal,
)


def sample(group: str, index: int, tokens: int, finish: str | None = None) -> JournaledSample:
    return JournaledSample(
        group=group, index=index, prompt_token_ids=(5, 6, 7), max_new_tokens=8, token_ids=tuple(range(tokens)),
        logprobs=tuple(-0.1 * (i + 1) / 3 for i in range(tokens)), versions=(3,) * tokens, finish_reason=finish,
        submitted_at=12.5,
    )  # fmt: skip


def test_written_samples_read_back_exactly_by_group_in_index_order(tmp_path: Path) -> None:
    root = open_root(str(tmp_path))
    assert read_journal(root) == {}
    written = [sample("g00000002", 1, 4), sample("g00000001", 0, 8, "length"), sample("g00000002", 0, 2, "stop")]
    size = write_journal(root, written)
    assert size == (tmp_path / JOURNAL_PATH).stat().st_size
    read = read_journal(root)
    assert read == {"g00000001": [written[1]], "g00000002": [written[2], written[0]]}
    assert read["g00000002"][1].logprobs == written[0].logprobs  # floats survive exactly
    write_journal(root, [])  # replaced whole
    assert read_journal(root) == {}


def turn(group: str, episode: str, index: int, tokens: int) -> JournaledTurn:
    return JournaledTurn(
        group=group, episode=episode, turn=index, context_token_ids=(5, 6, 7, index), max_new_tokens=8,
        token_ids=tuple(range(tokens)), logprobs=tuple(-0.3 * (i + 1) / 7 for i in range(tokens)),
        versions=(2 + index,) * tokens, finish_reason="stop",
    )  # fmt: skip


def test_episode_turns_read_back_exactly_beside_the_samples_by_group_in_turn_order(tmp_path: Path) -> None:
    root = open_root(str(tmp_path))
    samples = [sample("g00000001", 0, 3)]
    turns = [turn("g00000004", "r.g00000004.1", 1, 2), turn("g00000004", "r.g00000004.1", 0, 5),
             turn("g00000004", "r.g00000004.0", 0, 1), turn("g00000005", "r.g00000005.0", 0, 4)]  # fmt: skip
    write_journal(root, samples, turns)
    contents = read_journal_contents(root)
    assert contents.samples == read_journal(root) == {"g00000001": samples}
    assert contents.turns == {"g00000004": [turns[2], turns[1], turns[0]], "g00000005": [turns[3]]}
    write_journal(root, samples)  # a journal without turns (and one written before turns existed)
    assert read_journal_contents(root).turns == {}


def test_a_turn_with_unequal_arrays_or_an_open_finish_is_refused() -> None:
    with pytest.raises(ValueError, match="2 tokens but 1 log-probs"):
        JournaledTurn("g1", "r.g1.0", 0, (1,), 4, (1, 2), (-0.5,), (0, 0), "stop")
    with pytest.raises(ValueError, match="finish_reason None"):
        JournaledTurn("g1", "r.g1.0", 0, (1,), 4, (1,), (-0.5,), (0,), None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"format": 99, "samples": []}', "format 99"),
        ('{"format": 1, "samples": [{"group": "g1"}]}', "malformed entry"),
        ('{"format": 1, "samples": [], "turns": [{"group": "g1", "turn": 0}]}', "malformed entry"),
        ('[1, 2]', "not a JSON object"),
    ],
)
def test_a_malformed_journal_is_refused_naming_it(tmp_path: Path, content: str, message: str) -> None:
    root = open_root(str(tmp_path))
    (tmp_path / "scheduler").mkdir()
    (tmp_path / JOURNAL_PATH).write_text(content)
    with pytest.raises(ValueError, match=message) as error:
        read_journal(root)
    assert "journal.json" in str(error.value)


def test_a_sample_with_uneven_arrays_or_over_its_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="3 tokens but 2 log-probs"):
        JournaledSample("g1", 0, (1,), 8, (1, 2, 3), (-0.1, -0.2), (0, 0, 0))
    with pytest.raises(ValueError, match="over max_new_tokens 2"):
        JournaledSample("g1", 0, (1,), 2, (1, 2, 3), (-0.1,) * 3, (0,) * 3)
    with pytest.raises(ValueError, match="finish_reason 'abort'"):
        JournaledSample("g1", 0, (1,), 8, (1,), (-0.1,), (0,), finish_reason="abort")
