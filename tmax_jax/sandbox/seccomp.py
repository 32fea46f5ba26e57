"""The seccomp filter every sandboxed process runs under (bwrap ``--seccomp FD``).

A classic-BPF program over ``struct seccomp_data`` (nr: u32 at 0, arch: u32 at 4, args: u64 from 16):
a process of another architecture is killed, the listed system calls fail with EPERM, ``clone``
with any namespace flag fails with EPERM, and ``clone3`` fails with ENOSYS (its flags sit behind a
pointer that BPF cannot read; libc then falls back to ``clone``). Everything else is allowed.

What is denied, and why: mounting and mount-API calls (a root that remounts ``/usr`` read-write or
binds a fake interpreter over the verifier's), namespace changes (``setns``/``unshare``/namespace
``clone``: a nested user namespace would hand out fresh capabilities), ``ptrace`` and cross-process
memory access, the kernel keyring (shared by every process of a host user: a channel between
sandboxes), ``bpf``, ``perf_event_open``, ``userfaultfd``, ``io_uring`` (a syscall path that seccomp
cannot see into), module and kexec loading, file handles (``open_by_handle_at`` escapes bind mounts),
clock, swap, reboot, accounting and quota control, and ``syslog``. The kernel denies most of these
to a user namespace's root already; the filter makes that independent of kernel configuration and
of capabilities within the namespace.
"""

from __future__ import annotations

import os
import platform
import struct

# BPF opcodes (linux/bpf_common.h, linux/filter.h).
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06
_RET_KILL_PROCESS = 0x80000000
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_EPERM = 1
_ENOSYS = 38
# CLONE_NEWTIME | NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
_CLONE_NS_FLAGS = (
    0x00000080 | 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
)
_X32_SYSCALL_BIT = 0x40000000

# Names common to both tables; numbers per architecture (arch/x86/entry/syscalls/syscall_64.tbl and
# include/uapi/asm-generic/unistd.h).
DENIED = (
    "mount", "umount2", "pivot_root", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount",
    "fspick", "mount_setattr", "setns", "unshare", "ptrace", "process_vm_readv", "process_vm_writev",
    "kcmp", "pidfd_getfd", "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "init_module", "finit_module",
    "delete_module", "kexec_load", "kexec_file_load", "open_by_handle_at", "name_to_handle_at",
    "swapon", "swapoff", "reboot", "acct", "quotactl", "quotactl_fd", "settimeofday", "clock_settime",
    "clock_adjtime", "adjtimex", "syslog", "lookup_dcookie", "vhangup", "nfsservctl",
)  # fmt: skip
_X86_64 = {
    "mount": 165, "umount2": 166, "pivot_root": 155, "open_tree": 428, "move_mount": 429,
    "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
    "setns": 308, "unshare": 272, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
    "kcmp": 312, "pidfd_getfd": 438, "keyctl": 250, "add_key": 248, "request_key": 249, "bpf": 321,
    "perf_event_open": 298, "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "init_module": 175, "finit_module": 313, "delete_module": 176,
    "kexec_load": 246, "kexec_file_load": 320, "open_by_handle_at": 304, "name_to_handle_at": 303,
    "swapon": 167, "swapoff": 168, "reboot": 169, "acct": 163, "quotactl": 179, "quotactl_fd": 443,
    "settimeofday": 164, "clock_settime": 227, "clock_adjtime": 305, "adjtimex": 159, "syslog": 103,
    "lookup_dcookie": 212, "vhangup": 153, "nfsservctl": 180, "clone": 56, "clone3": 435,
}  # fmt: skip
_AARCH64 = {
    "mount": 40, "umount2": 39, "pivot_root": 41, "open_tree": 428, "move_mount": 429,
    "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
    "setns": 268, "unshare": 97, "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271,
    "kcmp": 272, "pidfd_getfd": 438, "keyctl": 219, "add_key": 217, "request_key": 218, "bpf": 280,
    "perf_event_open": 241, "userfaultfd": 282, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "init_module": 105, "finit_module": 273, "delete_module": 106,
    "kexec_load": 104, "kexec_file_load": 294, "open_by_handle_at": 265, "name_to_handle_at": 264,
    "swapon": 224, "swapoff": 225, "reboot": 142, "acct": 89, "quotactl": 60, "quotactl_fd": 443,
    "settimeofday": 170, "clock_settime": 112, "clock_adjtime": 266, "adjtimex": 171, "syslog": 116,
    "lookup_dcookie": 18, "vhangup": 58, "nfsservctl": 42, "clone": 220, "clone3": 435,
}  # fmt: skip
# (AUDIT_ARCH_*, syscall table, whether the x32 ABI must be refused)
ARCHES = {"x86_64": (0xC000003E, _X86_64, True), "aarch64": (0xC00000B7, _AARCH64, False)}


def _ins(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def program(arch: str | None = None) -> bytes:
    """The filter as ``struct sock_filter[]`` bytes, ready for bwrap's ``--seccomp FD``."""
    arch = arch or platform.machine()
    if arch == "arm64":
        arch = "aarch64"
    if arch not in ARCHES:
        raise OSError(f"no seccomp syscall table for architecture {arch!r} (known: {sorted(ARCHES)})")
    audit_arch, table, refuse_x32 = ARCHES[arch]
    denied = [table[name] for name in DENIED]
    # Layout: header, one jump per denied call, clone/clone3 checks, then the return block.
    body: list[tuple[int, int, int, int]] = []  # (code, jt, jf, k) with jt/jf as labels to resolve
    EPERM, ENOSYS, CLONE = "eperm", "enosys", "clone"
    body.append((_LD_W_ABS, 0, 0, 4))
    body.append((_JEQ_K, 1, 0, audit_arch))
    body.append((_RET_K, 0, 0, _RET_KILL_PROCESS))
    body.append((_LD_W_ABS, 0, 0, 0))
    if refuse_x32:
        body.append((_JGE_K, EPERM, 0, _X32_SYSCALL_BIT))
    for nr in denied:
        body.append((_JEQ_K, EPERM, 0, nr))
    body.append((_JEQ_K, ENOSYS, 0, table["clone3"]))
    body.append((_JEQ_K, CLONE, 0, table["clone"]))
    body.append((_RET_K, 0, 0, _RET_ALLOW))
    labels = {CLONE: len(body)}
    body.append((_LD_W_ABS, 0, 0, 16))  # low 32 bits of args[0] (little-endian on both arches)
    body.append((_JSET_K, EPERM, 0, _CLONE_NS_FLAGS))
    body.append((_RET_K, 0, 0, _RET_ALLOW))
    labels[EPERM] = len(body)
    body.append((_RET_K, 0, 0, _RET_ERRNO | _EPERM))
    labels[ENOSYS] = len(body)
    body.append((_RET_K, 0, 0, _RET_ERRNO | _ENOSYS))
    out = []
    for i, (code, jt, jf, k) in enumerate(body):
        jt = labels[jt] - i - 1 if isinstance(jt, str) else jt
        jf = labels[jf] - i - 1 if isinstance(jf, str) else jf
        if not (0 <= jt <= 255 and 0 <= jf <= 255):
            raise AssertionError("seccomp program too long for 8-bit jumps")
        out.append(_ins(code, jt, jf, k))
    return b"".join(out)


def write_program(path: os.PathLike | str, arch: str | None = None) -> str:
    """Write the filter to ``path`` (mode 0400) and return the path."""
    data = program(arch)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o400)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    return str(path)
