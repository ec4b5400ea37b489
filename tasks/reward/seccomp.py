"""A seccomp deny-list for the code sandbox, as a classic BPF program built with ``struct``.

bubblewrap loads it (``--seccomp FD``) just before it executes the program, so bwrap's own
setup is unaffected and every process of the program inherits it (it can never be removed).
The program checks ``seccomp_data.arch``: a foreign ABI (i386, arm32 compat) and, on x86_64,
the x32 ABI fail every call; for the native ABI each denied number jumps to
``ret ERRNO(EPERM)``, anything else is allowed. Denied calls fail with EPERM rather than
killing the process, so a probing program gets an ordinary OSError. Denied: ptrace and
cross-process memory access, kernel attack surface (bpf, io_uring, userfaultfd,
perf_event_open, keys), mounts and namespaces, file handles, kernel and machine control,
and memfds. The BPF listing and why each call is denied: ``docs/internals/reward.md``.
"""

from __future__ import annotations

import errno
import platform
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

# Classic BPF opcodes (linux/filter.h, linux/bpf_common.h).
BPF_LD_W_ABS = 0x00 | 0x00 | 0x20  # BPF_LD | BPF_W | BPF_ABS
BPF_JEQ_K = 0x05 | 0x10 | 0x00  # BPF_JMP | BPF_JEQ | BPF_K
BPF_JGE_K = 0x05 | 0x30 | 0x00  # BPF_JMP | BPF_JGE | BPF_K
BPF_RET_K = 0x06 | 0x00  # BPF_RET | BPF_K
# Return values (linux/seccomp.h) and the offsets of struct seccomp_data.
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_DATA_NR_OFFSET = 0
SECCOMP_DATA_ARCH_OFFSET = 4
# linux/audit.h
AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_AARCH64 = 0xC00000B7
X32_SYSCALL_BIT = 0x40000000
_INSTRUCTION = struct.Struct("=HBBI")  # struct sock_filter { __u16 code; __u8 jt; __u8 jf; __u32 k; }

DENIED_SYSCALLS: tuple[str, ...] = (
    "ptrace", "process_vm_readv", "process_vm_writev",
    "bpf", "io_uring_setup", "io_uring_enter", "io_uring_register", "userfaultfd", "perf_event_open",
    "keyctl", "add_key", "request_key",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns",
    "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    "name_to_handle_at", "open_by_handle_at",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "swapon", "swapoff", "reboot",
    "memfd_create", "memfd_secret",
)  # fmt: skip
"""Names of the system calls the sandbox denies with EPERM (see the module docstring)."""


@dataclass(frozen=True)
class SyscallArch:
    """One architecture: its AUDIT_ARCH value, whether it has the x32 ABI, its syscall numbers."""

    name: str
    audit_arch: int
    has_x32: bool
    numbers: Mapping[str, int]


X86_64 = SyscallArch(
    "x86_64",
    AUDIT_ARCH_X86_64,
    True,
    MappingProxyType({  # arch/x86/entry/syscalls/syscall_64.tbl
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
        "bpf": 321, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "userfaultfd": 323, "perf_event_open": 298,
        "keyctl": 250, "add_key": 248, "request_key": 249,
        "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "unshare": 272, "setns": 308,
        "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
        "mount_setattr": 442, "name_to_handle_at": 303, "open_by_handle_at": 304,
        "kexec_load": 246, "kexec_file_load": 320, "init_module": 175, "finit_module": 313, "delete_module": 176,
        "swapon": 167, "swapoff": 168, "reboot": 169,
        "memfd_create": 319, "memfd_secret": 447,
    }),
)  # fmt: skip
AARCH64 = SyscallArch(
    "aarch64",
    AUDIT_ARCH_AARCH64,
    False,
    MappingProxyType({  # include/uapi/asm-generic/unistd.h
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271,
        "bpf": 280, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "userfaultfd": 282, "perf_event_open": 241,
        "keyctl": 219, "add_key": 217, "request_key": 218,
        "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51, "unshare": 97, "setns": 268,
        "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
        "mount_setattr": 442, "name_to_handle_at": 264, "open_by_handle_at": 265,
        "kexec_load": 104, "kexec_file_load": 294, "init_module": 105, "finit_module": 273, "delete_module": 106,
        "swapon": 224, "swapoff": 225, "reboot": 142,
        "memfd_create": 279, "memfd_secret": 447,
    }),
)  # fmt: skip
ARCHES: Mapping[str, SyscallArch] = MappingProxyType(
    {"x86_64": X86_64, "amd64": X86_64, "aarch64": AARCH64, "arm64": AARCH64}
)


class SeccompUnsupported(Exception):
    """The machine's architecture has no syscall table here, so no filter can be built."""


def native_arch(machine: str | None = None) -> SyscallArch:
    """The SyscallArch of ``machine`` (default: ``platform.machine()``)."""
    name = (machine if machine is not None else platform.machine()).lower()
    arch = ARCHES.get(name)
    if arch is None:
        raise SeccompUnsupported(
            f"seccomp filter: no syscall table for architecture {name!r} (known: x86_64, aarch64); "
            "the code sandbox cannot deny dangerous system calls here"
        )
    return arch


def _instruction(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return _INSTRUCTION.pack(code, jt, jf, k)


def build_filter(arch: SyscallArch, denied: tuple[str, ...] = DENIED_SYSCALLS, err: int = errno.EPERM) -> bytes:
    """The BPF program (module docstring) as the bytes of a ``struct sock_filter`` array."""
    missing = [name for name in denied if name not in arch.numbers]
    if missing:
        raise SeccompUnsupported(f"seccomp filter: no {arch.name} syscall number for {missing}")
    numbers = sorted({arch.numbers[name] for name in denied})
    deny = SECCOMP_RET_ERRNO | (err & 0xFFFF)
    program = [
        _instruction(BPF_LD_W_ABS, SECCOMP_DATA_ARCH_OFFSET),
        _instruction(BPF_JEQ_K, arch.audit_arch, jt=1, jf=0),
        _instruction(BPF_RET_K, deny),
        _instruction(BPF_LD_W_ABS, SECCOMP_DATA_NR_OFFSET),
    ]
    checks: list[tuple[int, int]] = ([(BPF_JGE_K, X32_SYSCALL_BIT)] if arch.has_x32 else []) + [
        (BPF_JEQ_K, nr) for nr in numbers
    ]
    for i, (code, k) in enumerate(checks):
        to_deny = len(checks) - i  # skip the remaining checks and the ALLOW return
        if to_deny > 255:
            raise SeccompUnsupported(f"seccomp filter: {len(checks)} checks do not fit 8-bit jumps")
        program.append(_instruction(code, k, jt=to_deny, jf=0))
    program += [_instruction(BPF_RET_K, SECCOMP_RET_ALLOW), _instruction(BPF_RET_K, deny)]
    return b"".join(program)


def decode_filter(program: bytes) -> list[tuple[int, int, int, int]]:
    """The ``(code, jt, jf, k)`` instructions of a program built by build_filter (for tests and debugging)."""
    if len(program) % _INSTRUCTION.size:
        raise ValueError(
            f"seccomp filter: {len(program)} bytes is not a whole number of {_INSTRUCTION.size}-byte instructions"
        )
    return [_INSTRUCTION.unpack_from(program, offset) for offset in range(0, len(program), _INSTRUCTION.size)]
