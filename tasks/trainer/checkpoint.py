"""Trainer checkpoints in the run root: DeepSpeed state of one step, published atomically.

``checkpoints/step-{step:08d}/`` holds the files DeepSpeed writes for one tag and, written
last with put-if-absent, a ``_COMPLETE`` manifest naming every file with its size and sha256
plus the trainer state (steps done, weight version); a load verifies both and names the file
that differs (manifests of format 1, without sha256, are checked by size). A checkpoint without its manifest is an
interrupted save and is ignored. Files go through the node's local ``work_dir``; with
several ranks each node's leader uploads its node's files and rank 0 writes the manifest.
The manifest records the data-parallel world size; a checkpoint loads at another one after
its ZeRO optimizer files are re-partitioned (:mod:`asyncrl.tasks.trainer.zero_reshard`, and
:mod:`asyncrl.tasks.trainer.zero3_reshard` for ZeRO stage 3). A LoRA engine's checkpoint
holds the trainable parameters only (the adapters, DeepSpeed's ``exclude_frozen_parameters``)
and its optimizer state: the frozen base is the one the engine was built on.
Multi-node details: ``docs/internals/trainer.md``.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.storage import fs, paths
from asyncrl.storage.fs import RunRoot
from asyncrl.storage.local_files import file_sha256
from asyncrl.tasks.trainer.data_parallel import all_gather_objects, barrier, is_node_leader, run_and_agree
from asyncrl.tasks.trainer.engine import TrainEngine
from asyncrl.tasks.trainer.zero3_reshard import reshard_zero3_checkpoint_dir
from asyncrl.tasks.trainer.zero_reshard import ReshardError, engine_partition_sizes, reshard_checkpoint_dir, zero_world_size

CHECKPOINT_COMPLETE = "_COMPLETE"
CHECKPOINT_FORMAT = 2
_CHECKPOINT_NAME = re.compile(r"^step-(\d{8,})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names it."""


@dataclass(frozen=True)
class CheckpointState:
    """The trainer state a checkpoint carries next to DeepSpeed's."""

    step: int
    """Training steps done (ledger entries 1..step are in these parameters)."""
    version: int
    """Weight version these parameters were published as."""


def _marker(step: int) -> str:
    return paths.join(paths.checkpoint_dir(step), CHECKPOINT_COMPLETE)


def _tag(step: int) -> str:
    return paths.checkpoint_dir(step).rsplit("/", 1)[-1]


def _parse_name(name: str) -> int | None:
    match = _CHECKPOINT_NAME.match(name)
    if match is None:
        return None
    step = int(match.group(1))
    return step if _tag(step) == name else None


def complete_checkpoints(root: RunRoot) -> list[int]:
    """Steps with a complete checkpoint, ascending."""
    steps = [_parse_name(name) for name in fs.list_dir(root, paths.CHECKPOINTS_DIR)]
    return sorted(s for s in steps if s is not None and fs.exists(root, _marker(s)))


def read_manifest(root: RunRoot, step: int) -> dict[str, Any]:
    """The ``_COMPLETE`` manifest of checkpoint ``step``; :class:`CheckpointError` if corrupt."""
    source = root.display(_marker(step))
    raw = fs.read_bytes(root, _marker(step))
    try:
        manifest = json.loads(raw)
        files = manifest["files"]
        state = CheckpointState(step=int(manifest["step"]), version=int(manifest["version"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{source}: corrupt checkpoint manifest ({exc})") from None
    if state.step != step or not isinstance(files, dict) or not files:
        raise CheckpointError(f"{source}: manifest names step {state.step} and {len(files)} files")
    digests = manifest.get("sha256")
    if int(manifest.get("format", 1)) >= 2 and (not isinstance(digests, dict) or set(digests) != set(files)):
        unnamed = sorted(set(files) - set(digests or {}))
        raise CheckpointError(f"{source}: corrupt checkpoint manifest (no sha256 for {unnamed or 'its files'})")
    return manifest


def checkpoint_versions(root: RunRoot) -> set[int]:
    """Weight versions named by the complete checkpoints (a trainer resumed from one holds
    that version's parameters): weight retention keeps them. :class:`CheckpointError`
    names a corrupt manifest."""
    return {int(read_manifest(root, step)["version"]) for step in complete_checkpoints(root)}


def latest_checkpoint(root: RunRoot) -> CheckpointState | None:
    """State of the newest complete checkpoint, or None."""
    steps = complete_checkpoints(root)
    if not steps:
        return None
    manifest = read_manifest(root, steps[-1])
    return CheckpointState(step=int(manifest["step"]), version=int(manifest["version"]))


def _local_files(tag_dir: Path) -> dict[str, tuple[int, str]]:
    """Relative name -> (size, sha256) of every file under ``tag_dir``."""
    return {
        p.relative_to(tag_dir).as_posix(): (p.stat().st_size, file_sha256(p))
        for p in sorted(tag_dir.rglob("*"))
        if p.is_file()
    }


def save_checkpoint(root: RunRoot, engine: TrainEngine, state: CheckpointState, work_dir: Path) -> None:
    """Save the engine's full training state as checkpoint ``state.step`` (then its manifest).

    Collective: every rank calls it. Each node's leader uploads the files its node wrote
    (a file listed by several nodes, e.g. on a shared disk, is uploaded by the first);
    rank 0 clears leftovers of an interrupted save first and writes the manifest last."""
    local = Path(work_dir) / "checkpoint-save"
    tag = _tag(state.step)
    leader = is_node_leader()
    if leader:
        shutil.rmtree(local, ignore_errors=True)
    barrier()
    engine.ds.save_checkpoint(
        str(local),
        tag=tag,
        client_state={"asyncrl": vars(state)},
        save_latest=False,
        exclude_frozen_parameters=engine.lora is not None,
    )
    barrier()
    tag_dir = local / tag
    listed = all_gather_objects(_local_files(tag_dir) if leader else {})
    owners: dict[str, int] = {}
    sizes: dict[str, int] = {}
    digests: dict[str, str] = {}
    for rank, files in enumerate(listed):
        for relname, (size, sha256) in files.items():
            owners.setdefault(relname, rank)
            sizes.setdefault(relname, size)
            digests.setdefault(relname, sha256)
    if not sizes:
        raise CheckpointError(f"DeepSpeed wrote no files for checkpoint {tag} under {tag_dir}")
    target = paths.checkpoint_dir(state.step)

    def clear() -> None:
        if engine.rank == 0:
            fs.delete_tree(root, target)  # leftovers of an interrupted save

    def upload() -> None:
        for relname in sorted(name for name, owner in owners.items() if owner == engine.rank):
            fs.upload_file(root, tag_dir / relname, paths.join(target, relname))

    run_and_agree(clear, f"clearing {root.display(target)}")
    run_and_agree(upload, f"uploading checkpoint {root.display(target)}")
    if engine.rank == 0:
        manifest = {
            "format": CHECKPOINT_FORMAT,
            "step": state.step,
            "version": state.version,
            "world_size": engine.world_size,
            "saved_at": time.time(),
            "files": sizes,
            "sha256": digests,
        }
        fs.put_if_absent(root, _marker(state.step), json.dumps(manifest).encode())
    if leader:
        shutil.rmtree(local, ignore_errors=True)


def saved_world_size(manifest: dict[str, Any]) -> int | None:
    """Data-parallel ranks that saved a checkpoint: the manifest's ``world_size``, else (a
    manifest written before it was recorded) its ZeRO file count; None for a checkpoint
    whose optimizer state is not partitioned (ZeRO stage 0)."""
    partitioned = zero_world_size(list(manifest["files"]))
    return None if partitioned is None else int(manifest.get("world_size", partitioned))


def load_checkpoint(root: RunRoot, engine: TrainEngine, step: int, work_dir: Path) -> CheckpointState:
    """Restore module, optimizer and scheduler state from complete checkpoint ``step``.

    Collective: every rank calls it. Each node's leader downloads every file; a checkpoint
    saved at another world size has its ZeRO optimizer files re-partitioned for this one
    (:func:`~asyncrl.tasks.trainer.zero_reshard.reshard_checkpoint_dir`), or
    :class:`CheckpointError` names both sizes and why it cannot be."""
    manifest = read_manifest(root, step)
    digests: dict[str, str] = manifest.get("sha256") or {}
    tag = _tag(step)
    local = Path(work_dir) / "checkpoint-load"
    source = root.display(paths.checkpoint_dir(step))
    leader = is_node_leader()

    def fetch() -> None:
        if not leader:
            return
        shutil.rmtree(local, ignore_errors=True)
        for relname, size in manifest["files"].items():
            target = local / tag / relname
            fs.download_file(root, paths.join(paths.checkpoint_dir(step), relname), target)
            if target.stat().st_size != size:
                raise CheckpointError(
                    f"{root.display(paths.join(paths.checkpoint_dir(step), relname))}: "
                    f"{target.stat().st_size} bytes, manifest says {size}"
                )
            expected = digests.get(relname)
            if expected is not None and (actual := file_sha256(target)) != expected:
                raise CheckpointError(
                    f"{root.display(paths.join(paths.checkpoint_dir(step), relname))}: sha256 {actual[:16]}..., "
                    f"manifest says {expected[:16]}...: the file changed after the checkpoint was saved"
                )
        saved = saved_world_size(manifest)
        if saved is not None and saved != engine.world_size:
            try:
                reshard = reshard_zero3_checkpoint_dir if engine.parameters_partitioned else reshard_checkpoint_dir
                reshard(local / tag, engine.world_size, engine_partition_sizes(engine.ds))
            except ReshardError as exc:
                raise CheckpointError(
                    f"{source} was saved by {saved} data-parallel ranks and cannot be loaded by "
                    f"{engine.world_size}: {exc}"
                ) from None

    run_and_agree(fetch, f"fetching checkpoint {source}")
    load_path, _ = engine.ds.load_checkpoint(
        str(local),
        tag=tag,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
        custom_load_fn=_load_trainable_only(source) if engine.lora is not None else None,
    )
    barrier()
    if leader:
        shutil.rmtree(local, ignore_errors=True)
    if load_path is None:
        raise CheckpointError(f"DeepSpeed could not load checkpoint {source}")
    return CheckpointState(step=int(manifest["step"]), version=int(manifest["version"]))


def _load_trainable_only(source: str) -> Callable[..., None]:
    """DeepSpeed's module loader for a checkpoint saved without frozen parameters (a LoRA
    engine's): every trainable parameter must be in it, and nothing the module lacks; the
    frozen ones keep the values the engine was built with. :class:`CheckpointError` names
    ``source`` and the keys otherwise."""

    def load(src: dict[str, Any], dst: Any) -> None:
        result = dst.load_state_dict(src, strict=False)
        frozen = {name for name, p in dst.named_parameters(remove_duplicate=False) if not p.requires_grad}
        missing = sorted(set(result.missing_keys) - frozen)
        if missing or result.unexpected_keys:
            raise CheckpointError(
                f"{source}: module state does not match the LoRA model: missing {missing[:4]}, "
                f"unexpected {sorted(result.unexpected_keys)[:4]} (saved by a run with other trainer.lora settings?)"
            )

    return load


def prune_checkpoints(root: RunRoot, keep: int) -> list[int]:
    """Delete all but the ``keep`` newest complete checkpoints (manifest first); return deleted steps.

    Incomplete checkpoint directories older than the newest complete one go too.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    complete = complete_checkpoints(root)
    kept = set(complete[-keep:])
    newest = complete[-1] if complete else -1
    deleted = []
    for name in fs.list_dir(root, paths.CHECKPOINTS_DIR):
        step = _parse_name(name)
        if step is None or step in kept or step > newest:
            continue
        fs.delete(root, _marker(step), missing_ok=True)
        fs.delete_tree(root, paths.checkpoint_dir(step))
        deleted.append(step)
    return sorted(deleted)
