"""A folder ``data.train_path``: its data files listed in a stable order with their digests,
the run's choice written once in the run root and kept on a restart, and the prompts read
from exactly the chosen files. Every refusal names ``data.train_path``."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl.configs.data import DATA_FILE_SUFFIXES, DataConfig, is_data_folder
from asyncrl.storage import paths
from asyncrl.storage.fs import RunRoot, open_root
from asyncrl.storage.train_manifest import TrainFile, read_train_manifest
from asyncrl.tasks.data.loader import JSONL_SUFFIXES, PARQUET_SUFFIXES
from asyncrl.tasks.data.records import DatasetError
from asyncrl.tasks.data.mixture import MIXTURE_SUFFIXES
from asyncrl.tasks.data.train_files import choose_train_files, list_train_files, load_train_prompts, train_files


def write_jsonl(path: Path, count: int, start: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"question": f"{i}+1=?", "answer": f"#### {i + 1}"} for i in range(start, start + count)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    data = tmp_path / "prompts"
    write_jsonl(data / "2026-12-02.jsonl", 2)
    write_jsonl(data / "2026-12-01.jsonl", 3, start=10)
    (data / "batch").mkdir()
    pq.write_table(pa.table({"prompt": ["1+1="], "answer": ["2"]}), data / "batch" / "part-0.parquet")
    (data / "_SUCCESS").write_text("")
    (data / ".hidden.jsonl").write_text("not data")
    write_jsonl(data / "_temporary" / "part-9.jsonl", 1)
    return data


@pytest.fixture
def root(tmp_path: Path) -> RunRoot:
    return open_root(str(tmp_path / "store"))


def test_the_path_decides_folder_or_file_and_the_loader_reads_every_file_suffix() -> None:
    assert set(DATA_FILE_SUFFIXES) == {*PARQUET_SUFFIXES, *JSONL_SUFFIXES, *MIXTURE_SUFFIXES}
    assert not is_data_folder("data/train.parquet") and not is_data_folder("s3://b/p/train.JSONL")
    assert not is_data_folder("mix.yaml")
    assert is_data_folder("data/prompts") and is_data_folder("s3://bucket/prompts/") and is_data_folder("data/x.jsonl/")
    assert is_data_folder("data/notes.csv")  # then refused by the listing as a file of another format


def test_a_folder_lists_its_data_files_recursively_sorted_by_path_skipping_dot_and_underscore_names(folder: Path) -> None:
    listed = list_train_files(f"{folder}/")
    expected = [folder / "2026-12-01.jsonl", folder / "2026-12-02.jsonl", folder / "batch" / "part-0.parquet"]
    assert listed == [TrainFile(str(path), digest(path)) for path in expected]
    assert list_train_files(str(folder)) == listed == list_train_files(f"file://{folder}")


def test_a_single_file_is_listed_by_the_path_as_given(folder: Path) -> None:
    path = str(folder / "2026-12-01.jsonl")
    assert list_train_files(path) == [TrainFile(path, digest(Path(path)))]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d.mkdir(), "holds no data files"),
        (lambda d: None, r"is not there \(no such folder or prefix\)"),
        (lambda d: (d.mkdir(), (d / "a.jsonl").write_text("{}\n"), (d / "notes.csv").write_text("x")),
         "holds files of a format the loader cannot read: notes.csv"),
        (lambda d: (d.mkdir(), (d / "mix.yaml").write_text("sources: []")), "holds files of a format the loader cannot read: mix.yaml"),
    ],
)  # fmt: skip
def test_an_unusable_folder_is_refused_naming_the_field(tmp_path: Path, make: object, message: str) -> None:
    data = tmp_path / "prompts"
    make(data)  # type: ignore[operator]
    with pytest.raises(DatasetError, match=rf"^data\.train_path: {data}/? {message}"):
        list_train_files(str(data))


def test_a_folder_path_naming_a_file_of_another_format_is_refused_naming_the_field(tmp_path: Path) -> None:
    (tmp_path / "prompts.csv").write_text("q,a\n")
    with pytest.raises(DatasetError, match=r"^data\.train_path: .*prompts\.csv is a file of an unsupported format"):
        list_train_files(str(tmp_path / "prompts.csv"))


def test_the_choice_is_written_once_and_a_restart_keeps_it(folder: Path, root: RunRoot) -> None:
    data = DataConfig(train_path=str(folder))
    first_file = TrainFile(str(folder / "2026-12-01.jsonl"), digest(folder / "2026-12-01.jsonl"))
    first = choose_train_files(data, 0, root, earlier=lambda: {first_file})
    assert not first.reused and first.skipped is None and first.selection is not None
    assert first_file not in first.selection.files and len(first.selection.files) == 2
    manifest = read_train_manifest(root)
    assert manifest is not None and manifest.selection == first.selection
    assert json.loads((Path(root.path) / paths.TRAIN_FILES).read_text())["listed"] == 3

    write_jsonl(folder / "2026-12-03.jsonl", 1, start=50)  # arrives after the run chose

    def must_not_ask() -> set[TrainFile]:
        raise AssertionError("a restarted run does not choose again")

    again = choose_train_files(data, 0, root, earlier=must_not_ask)
    assert again.reused and again.selection == first.selection
    assert train_files(data, root) == first.selection.files


def test_the_prompts_come_from_exactly_the_chosen_files_with_ids_distinct_across_files(folder: Path, root: RunRoot) -> None:
    data = DataConfig(train_path=str(folder))
    choose_train_files(data, 0, root, earlier=frozenset)
    write_jsonl(folder / "2026-12-03.jsonl", 4, start=50)  # not chosen: not read
    records = load_train_prompts(data, root)
    assert [r.prompt for r in records][:3] == [f"{i}+1=?" for i in (10, 11, 12)]
    assert len(records) == 3 + 2 + 1
    assert len({r.prompt_id for r in records}) == len(records)
    assert records[0].prompt_id.startswith(digest(folder / "2026-12-01.jsonl")[:8] + ":")


def test_a_chosen_file_changed_or_gone_since_is_refused_naming_the_field(folder: Path, root: RunRoot) -> None:
    data = DataConfig(train_path=str(folder))
    choose_train_files(data, 0, root, earlier=frozenset)
    write_jsonl(folder / "2026-12-02.jsonl", 5, start=90)
    with pytest.raises(DatasetError, match=r"^data\.train_path: .*2026-12-02\.jsonl changed since this run chose it"):
        load_train_prompts(data, root)
    (folder / "2026-12-02.jsonl").unlink()
    with pytest.raises(DatasetError, match=r"^data\.train_path: .*2026-12-02\.jsonl: chosen for this run, now gone"):
        load_train_prompts(data, root)


def test_a_malformed_chosen_file_is_refused_naming_the_field_and_the_row(folder: Path, root: RunRoot) -> None:
    (folder / "2026-12-04.jsonl").write_text('{"question": "q"}\n')
    data = DataConfig(train_path=str(folder))
    choose_train_files(data, 0, root, earlier=frozenset)
    with pytest.raises(DatasetError, match=r"^data\.train_path: .*2026-12-04\.jsonl, line 1"):
        load_train_prompts(data, root)


def test_a_folder_without_a_choice_is_refused_naming_the_field(folder: Path, root: RunRoot) -> None:
    with pytest.raises(DatasetError, match=r"^data\.train_path: .* is a folder, and .*data/train-files\.json"):
        load_train_prompts(DataConfig(train_path=str(folder)), root)


def test_a_run_root_that_chose_from_another_folder_is_refused(folder: Path, root: RunRoot, tmp_path: Path) -> None:
    choose_train_files(DataConfig(train_path=str(folder)), 0, root, earlier=frozenset)
    other = tmp_path / "other"
    write_jsonl(other / "a.jsonl", 1)
    with pytest.raises(DatasetError, match=r"^data\.train_path: .*holds the files chosen from"):
        choose_train_files(DataConfig(train_path=str(other)), 0, root, earlier=frozenset)


def test_require_new_files_with_nothing_new_skips_and_records_nothing(folder: Path, root: RunRoot) -> None:
    data = DataConfig(train_path=str(folder), require_new_files=True)
    everything = set(list_train_files(str(folder)))
    choice = choose_train_files(data, 0, root, earlier=lambda: everything, earlier_runs="last night's run")
    assert choice.skipped is not None and read_train_manifest(root) is None
    assert choice.skipped.startswith(f"data.require_new_files: nothing new at {folder}: each of its 3 data file(s)")
    assert "last night's run" in choice.skipped
    one_new = everything - {next(iter(everything))}
    assert choose_train_files(data, 0, root, earlier=lambda: one_new).skipped is None


def test_a_single_file_is_read_as_before_and_new_only_when_its_bytes_are(tmp_path: Path, root: RunRoot) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", 2)
    plain = DataConfig(train_path=str(path))
    assert choose_train_files(plain, 0, root, earlier=lambda: pytest.fail("not asked")).selection is None
    assert train_files(plain, root) is None and len(load_train_prompts(plain, root)) == 2
    assert read_train_manifest(root) is None
    required = DataConfig(train_path=str(path), require_new_files=True)
    seen = {TrainFile(str(path), digest(path))}
    assert choose_train_files(required, 0, root, earlier=lambda: seen).skipped is not None
    write_jsonl(path, 3)  # rewritten: new
    assert choose_train_files(required, 0, root, earlier=lambda: seen).skipped is None
    assert read_train_manifest(root) is None
