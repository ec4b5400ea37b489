"""The sandbox's seccomp BPF program, checked by running it in a small classic-BPF interpreter
(the subset build_filter emits) and against the kernel headers' syscall numbers."""

from __future__ import annotations

import errno
import re
import struct
from pathlib import Path

import pytest

from asyncrl.tasks.reward.seccomp import (
    AARCH64,
    AUDIT_ARCH_AARCH64,
    AUDIT_ARCH_X86_64,
    BPF_JEQ_K,
    BPF_JGE_K,
    BPF_LD_W_ABS,
    BPF_RET_K,
    DENIED_SYSCALLS,
    SECCOMP_RET_ALLOW,
    SECCOMP_RET_ERRNO,
    X32_SYSCALL_BIT,
    X86_64,
    SeccompUnsupported,
    SyscallArch,
    build_filter,
    decode_filter,
    native_arch,
)

DENY = SECCOMP_RET_ERRNO | errno.EPERM
ALLOWED_X86_64 = {"read": 0, "write": 1, "mmap": 9, "clone": 56, "fork": 57, "execve": 59, "getpid": 39, "exit_group": 231}
ALLOWED_AARCH64 = {"read": 63, "write": 64, "mmap": 222, "clone": 220, "execve": 221, "getpid": 172, "exit_group": 94}


def run_filter(program: bytes, nr: int, arch: int) -> int:
    """What the kernel would return for a call ``nr`` through ABI ``arch`` (seccomp_data: nr, arch)."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, *([0] * 6))
    accumulator = 0
    pc = 0
    instructions = decode_filter(program)
    while True:
        code, jt, jf, k = instructions[pc]
        if code == BPF_LD_W_ABS:
            accumulator = struct.unpack_from("=I", data, k)[0]
        elif code == BPF_JEQ_K:
            pc += jt if accumulator == k else jf
        elif code == BPF_JGE_K:
            pc += jt if accumulator >= k else jf
        elif code == BPF_RET_K:
            return k
        else:
            raise AssertionError(f"instruction {pc}: unexpected opcode {code:#x}")
        pc += 1


@pytest.mark.parametrize(("arch", "allowed"), [(X86_64, ALLOWED_X86_64), (AARCH64, ALLOWED_AARCH64)], ids=["x86_64", "aarch64"])
def test_filter_denies_the_list_and_allows_the_rest(arch: SyscallArch, allowed: dict[str, int]) -> None:
    program = build_filter(arch)
    for name in DENIED_SYSCALLS:
        assert run_filter(program, arch.numbers[name], arch.audit_arch) == DENY, name
    for name, nr in allowed.items():
        assert run_filter(program, nr, arch.audit_arch) == SECCOMP_RET_ALLOW, name
    foreign = AUDIT_ARCH_AARCH64 if arch is X86_64 else AUDIT_ARCH_X86_64
    assert run_filter(program, allowed["getpid"], foreign) == DENY  # any foreign ABI: denied
    assert run_filter(program, allowed["getpid"], 0x40000003) == DENY  # i386
    x32_getpid = X32_SYSCALL_BIT | ALLOWED_X86_64["getpid"]
    assert run_filter(program, x32_getpid, arch.audit_arch) == (DENY if arch.has_x32 else SECCOMP_RET_ALLOW)


@pytest.mark.parametrize("arch", [X86_64, AARCH64], ids=["x86_64", "aarch64"])
def test_program_layout(arch: SyscallArch) -> None:
    instructions = decode_filter(build_filter(arch))
    numbers = {arch.numbers[name] for name in DENIED_SYSCALLS}
    # arch check (3) + load nr (1) + x32 check + one jeq per number + allow + deny
    assert len(instructions) == 4 + int(arch.has_x32) + len(numbers) + 2
    assert instructions[1] == (BPF_JEQ_K, 1, 0, arch.audit_arch)
    assert {k for code, _, _, k in instructions if code == BPF_JEQ_K} - {arch.audit_arch} == numbers
    assert instructions[-2:] == [(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW), (BPF_RET_K, 0, 0, DENY)]


@pytest.mark.parametrize(
    ("arch", "header", "pattern"),
    [
        (X86_64, "/usr/include/x86_64-linux-gnu/asm/unistd_64.h", r"#define __NR_(\w+)\s+(\d+)"),
        (AARCH64, "/usr/include/asm-generic/unistd.h", r"#define __NR(?:3264)?_(\w+)\s+(\d+)"),
    ],
    ids=["x86_64", "aarch64"],
)
def test_syscall_numbers_match_the_kernel_headers(arch: SyscallArch, header: str, pattern: str) -> None:
    path = Path(header)
    if not path.exists():
        pytest.skip(f"{header} not installed (linux-libc-dev)")
    table = {name: int(nr) for name, nr in re.findall(pattern, path.read_text())}
    known = {name: nr for name, nr in arch.numbers.items() if name in table}
    assert known == {name: table[name] for name in known}
    # Headers older than Linux 5.14 lack the newest calls (memfd_secret, mount_setattr...).
    assert len(known) >= len(DENIED_SYSCALLS) - 4, sorted(set(DENIED_SYSCALLS) - set(known))


def test_unknown_architecture_is_refused_by_name() -> None:
    with pytest.raises(SeccompUnsupported, match="'riscv64'"):
        native_arch("riscv64")
    assert native_arch("x86_64") is X86_64 and native_arch("arm64") is AARCH64
    with pytest.raises(SeccompUnsupported, match=r"no x86_64 syscall number for \['nosuchcall'\]"):
        build_filter(X86_64, ("nosuchcall",))
