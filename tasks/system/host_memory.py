"""Freed tensor memory handed back to the operating system at once (glibc's malloc).

glibc serves an allocation below its *mmap threshold* from the heap, and a heap keeps what
is freed for reuse: it shrinks only from its top. The threshold starts at 128 KiB and rises
to the size of each large block freed (up to 32 MiB), so after a few steps a trainer's
per-layer temporaries (weight gradients, activations: megabytes each) all come from the
heap, and a backward pass leaves gigabytes resident that no tensor holds (measured:
``docs/results/scale.md``). With a fixed threshold every block of at least that size is its
own ``mmap`` and ``free`` unmaps it, so resident memory follows the live tensors.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Callable, Mapping

logger = logging.getLogger(__name__)

MMAP_THRESHOLD_BYTES = 1 << 20
"""Blocks of at least 1 MiB are mapped on their own (the ``mallopt`` value set)."""
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
ENV_OVERRIDES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
"""glibc's own variables: a process started with either keeps the user's choice."""


def return_freed_memory_to_os(
    threshold_bytes: int = MMAP_THRESHOLD_BYTES, environ: Mapping[str, str] | None = None
) -> bool:
    """Fix glibc's mmap threshold at ``threshold_bytes`` (and the heap's trim threshold at
    twice it), so freed blocks of that size or more leave the process at once; call it
    before the large allocations start. True once set; False where malloc is not glibc's
    (nothing changed) or where the environment sets glibc's own variables (kept)."""
    if threshold_bytes < 1:
        raise ValueError(f"threshold_bytes must be >= 1, got {threshold_bytes}")
    source = os.environ if environ is None else environ
    if any(name in source for name in ENV_OVERRIDES):
        return False
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, threshold_bytes)) and bool(mallopt(M_TRIM_THRESHOLD, 2 * threshold_bytes))


def _glibc_mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``int mallopt(int, int)``, or None without it (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 - present in glibc only
    except (OSError, AttributeError):
        logger.debug("%s is not glibc: malloc thresholds left as they are", name)
        return None
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt
