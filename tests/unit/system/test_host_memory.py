"""return_freed_memory_to_os: freed megabyte blocks leave the process (glibc), the user's
own glibc variables win, bad thresholds are refused."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from asyncrl.tasks.system.host_memory import _glibc_mallopt, return_freed_memory_to_os

# A child that frees 64 MiB-worth of 2 MiB blocks below a live 256 KiB block, after a
# 16 MiB block raised glibc's dynamic mmap threshold above 2 MiB; it reports its resident
# memory (kB) before and after the frees.
CHILD = r"""
import ctypes, ctypes.util, json, os, sys
from asyncrl.tasks.system.host_memory import return_freed_memory_to_os
if sys.argv[1] == "set":
    assert return_freed_memory_to_os()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
from asyncrl.bench.process_memory import read_process_memory
def rss():
    return read_process_memory(os.getpid()).rss_bytes // 1024
big = libc.malloc(16 << 20); libc.memset(big, 1, 16 << 20); libc.free(big)
blocks = []
for _ in range(32):
    block = libc.malloc(2 << 20); libc.memset(block, 1, 2 << 20); blocks.append(block)
pin = libc.malloc(256 << 10); libc.memset(pin, 1, 256 << 10)
before = rss()
for block in blocks:
    libc.free(block)
print(json.dumps({"before": before, "after": rss()}))
"""

def _freed_kib(mode: str) -> int:
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True, env=env)
    figures = json.loads(out.stdout)
    return figures["before"] - figures["after"]


@pytest.mark.skipif(_glibc_mallopt() is None, reason="mallopt is glibc's; elsewhere nothing is set")
def test_freed_blocks_leave_the_process_only_with_the_fixed_threshold() -> None:
    # 32 x 2 MiB = 65,536 kB freed. glibc's default keeps them in the heap (below the
    # live block); with the threshold fixed at 1 MiB each was its own mapping.
    assert _freed_kib("default") < 16_000
    assert _freed_kib("set") > 60_000


def test_the_users_glibc_variables_are_kept() -> None:
    assert return_freed_memory_to_os(environ={"MALLOC_MMAP_THRESHOLD_": "65536"}) is False
    assert return_freed_memory_to_os(environ={"MALLOC_TRIM_THRESHOLD_": "0"}) is False


def test_a_threshold_below_one_byte_is_refused() -> None:
    with pytest.raises(ValueError, match="threshold_bytes"):
        return_freed_memory_to_os(0, environ={})
