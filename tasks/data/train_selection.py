"""Which files of a growing data folder a run trains on: a pure function of the folder's
listing, the files earlier runs trained on, ``data.replay_fraction`` and the run's seed."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Sequence

from asyncrl.storage.train_manifest import TrainFile, TrainSelection


def select_train_files(
    listing: Sequence[TrainFile], earlier: Collection[TrainFile], replay_fraction: float, seed: int
) -> TrainSelection:
    """The files a run trains on.

    - new = the listed files whose (URI, digest) is not in ``earlier``: a file rewritten with
      other bytes is new, a file trained on before and unchanged is not;
    - k = min(#earlier-listed, ceil(replay_fraction x #new)) files trained on before are
      replayed: those with the smallest sha256(seed, the new files' identities, URI, digest).
      Each earlier file's rank depends only on it, the seed and this run's new files, so the
      picks do not shift when the folder's order does, differ from run to run as new files
      arrive (a nightly run keeps one seed), and are the same for the same inputs;
    - files = new + replayed, in listing order. With no new file, files = every listed file
      (a run then trains on the folder as a single file's run does) and new = replayed = ():
      the caller ends the run instead when ``data.require_new_files`` asks for new data.

    Counted in files, not rows: no earlier file is read to choose, and a file is the unit
    the runs record. ``ValueError`` naming ``data.replay_fraction`` outside [0, 1].
    """
    if not 0.0 <= replay_fraction <= 1.0:
        raise ValueError(f"data.replay_fraction: {replay_fraction} must be in [0, 1]")
    trained = set(earlier)
    new = tuple(f for f in listing if f not in trained)
    if not new:
        return TrainSelection(files=tuple(listing), new=(), replayed=(), listed=len(listing))
    old = [f for f in listing if f in trained]
    count = min(len(old), math.ceil(round(replay_fraction * len(new), 9)))  # 0.1 x 30 is 3, not 4
    salt = hashlib.sha256("\n".join(f"{f.uri}\t{f.digest}" for f in sorted(new)).encode()).hexdigest()

    def rank(file: TrainFile) -> str:
        return hashlib.sha256(f"{seed}\n{salt}\n{file.uri}\n{file.digest}".encode()).hexdigest()

    picked = set(sorted(old, key=rank)[:count])
    replayed = tuple(f for f in listing if f in picked)
    chosen = set(new) | picked
    return TrainSelection(
        files=tuple(f for f in listing if f in chosen), new=new, replayed=replayed, listed=len(listing)
    )
