"""DeepSpeed's JIT ops are built before a trainer starts (``make setup``, the benchmarks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.tasks.trainer.jit_ops import JitOpsBuildError, ensure_jit_ops_built
from asyncrl.tasks.trainer.process import torch_extensions_dir, with_torch_extensions_dir


def test_ops_build_where_the_trainer_looks_for_them() -> None:
    assert with_torch_extensions_dir({})["TORCH_EXTENSIONS_DIR"] == str(torch_extensions_dir())
    assert with_torch_extensions_dir({"TORCH_EXTENSIONS_DIR": "/elsewhere"})["TORCH_EXTENSIONS_DIR"] == "/elsewhere"


def test_the_cpu_collective_op_is_built_and_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    # In the environment's own directory (make setup built it there; built now otherwise)
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    line = ensure_jit_ops_built()
    assert line.startswith("DeepSpeed ops ready in") and "deepspeed_shm_comm" in line, line
    assert list(torch_extensions_dir().glob("**/deepspeed_shm_comm*.so"))


def test_a_failed_build_says_so_with_its_output(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    not_a_dir = tmp_path / "extensions"
    not_a_dir.write_text("a file where the build directory should be")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(not_a_dir))
    with pytest.raises(JitOpsBuildError, match=r"(?s)building DeepSpeed's ops failed \(exit 1\):.*extensions"):
        ensure_jit_ops_built()
