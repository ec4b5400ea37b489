"""The journal object: what is written is read back exactly; a malformed one is refused, named."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.storage.fs import open_root
from asyncrl.storage.journal import JOURNAL_PATH, JournaledSample, read_journal, write_journal


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


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"format": 99, "samples": []}', "format 99"),
        ('{"format": 1, "samples": [{"group": "g1"}]}', "malformed entry"),
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
