"""A run's rollout servers start from the newest published weight version, fetched into a
local cache, or from ``model.path`` before any is published (:func:`serving_weights`)."""

from __future__ import annotations

from pathlib import Path

from asyncrl.configs.run_config import RunConfig
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.model.weight_fetch import fetch_weight_version, prune_weight_cache
from asyncrl.tasks.placement.launch_settings import serving_weights
from asyncrl.tasks.system.run_paths import run_paths


def weights_file(model_dir: Path) -> bytes:
    return (model_dir / "model.safetensors").read_bytes()


def test_servers_start_from_the_newest_published_version(
    tiny_model_dir: Path, weight_variants: dict[int, Path], tmp_path: Path
) -> None:
    config = RunConfig.model_validate(
        {
            "work_dir": str(tmp_path / "work"),
            "model": {"path": str(tiny_model_dir)},
            "data": {"train_path": str(tmp_path / "train.parquet")},
            "storage": {"root": f"file://{tmp_path / 'run'}"},
        }
    )
    paths = run_paths(config)
    assert serving_weights(config, paths) == (tiny_model_dir, 0, None)  # nothing published yet: model.path

    store = WeightStore(paths.root)
    store.publish(1, weight_variants[1])
    store.publish(2, weight_variants[2])
    model_dir, version, lease = serving_weights(config, paths)
    assert version == 2 and model_dir.is_relative_to(paths.work_dir / "weights-cache")
    assert weights_file(model_dir) == weights_file(weight_variants[2])
    again, _, second = serving_weights(config, paths)
    assert again == model_dir  # a restarted server reuses the copy
    # While a server starts on v2 (its lease held), another server's prune after loading v3
    # leaves v2 alone; once the servers are up (leases released), the prune deletes it.
    store.publish(3, weight_variants[1])
    cache, uri = paths.work_dir / "weights-cache", paths.root.uri
    fetch_weight_version(uri, {}, 3, cache)
    assert lease is not None and second is not None and lease.held
    assert prune_weight_cache(cache, uri, loaded=3) == [] and weights_file(model_dir) == weights_file(weight_variants[2])
    lease.release()
    assert prune_weight_cache(cache, uri, loaded=3) == []  # the other start still holds it
    second.release()
    lease.release()  # idempotent
    assert prune_weight_cache(cache, uri, loaded=3) == [2] and not model_dir.exists()


def test_servers_start_from_a_local_copy_of_a_remote_model_path(tmp_path: Path) -> None:
    """A vLLM server cannot load ``s3://...``: a remote ``model.path`` is copied into the cache
    once, as the trainer's start copies it (one fetch for both)."""
    import fsspec

    memory = fsspec.filesystem("memory")
    base = f"/models/{tmp_path.name}"
    memory.pipe({f"{base}/config.json": b"{}", f"{base}/model.safetensors": b"weights"})
    try:
        config = RunConfig.model_validate(
            {
                "work_dir": str(tmp_path / "work"),
                "model": {"path": f"memory://{base}"},
                "data": {"train_path": str(tmp_path / "train.parquet")},
                "storage": {"root": f"file://{tmp_path / 'run'}"},
            }
        )
        paths = run_paths(config)
        model_dir, version, lease = serving_weights(config, paths)
        assert version == 0 and lease is None and model_dir.is_relative_to(paths.work_dir / "weights-cache")
        assert weights_file(model_dir) == b"weights"
    finally:
        memory.rm(base, recursive=True)
