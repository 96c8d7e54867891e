"""The sandbox's seccomp filter (classic BPF, loaded by ``bwrap --seccomp FD``): it refuses System V
shared memory. A fresh IPC namespace has no limit on it (``kernel.shmall`` is 2^64), its segments
live in the kernel's own tmpfs and outlive every process that detached them, so without a memory
cgroup a program could hold any amount of the host's memory there (600 MB under ``memory_mb=256``
when tried). POSIX shared memory (``/dev/shm``, what ``multiprocessing`` uses) stays, sized. On
x86-64 a system call through another ABI (i386, x32) kills the process: nothing the sandbox runs
needs one, and the filter only knows the 64-bit numbers."""

from __future__ import annotations

import errno
import platform
import struct

_LD_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_RET = 0x06  # BPF_RET | BPF_K
_ARCH, _NR = 4, 0  # offsets in struct seccomp_data
_ALLOW, _KILL_PROCESS, _ERRNO = 0x7FFF0000, 0x80000000, 0x00050000

ARCHES = {
    # machine: (AUDIT_ARCH_*, shmget's number, the first number of another ABI or None)
    "x86_64": (0xC000003E, 29, 0x40000000),
    "aarch64": (0xC00000B7, 194, None),
}


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def program(machine: str | None = None) -> bytes | None:
    """The filter for ``machine`` (default: this host's) as ``struct sock_filter`` bytes, or None
    where the sandbox knows no system call numbers for it (then no filter is loaded)."""
    arch = ARCHES.get(machine or platform.machine())
    if arch is None:
        return None
    audit, shmget, other_abi = arch
    head = [_op(_LD_ABS, _ARCH), _op(_JEQ, audit, jt=1), _op(_RET, _KILL_PROCESS), _op(_LD_ABS, _NR)]
    if other_abi is None:
        body = [_op(_JEQ, shmget, jt=1), _op(_RET, _ALLOW), _op(_RET, _ERRNO | errno.EPERM)]
    else:  # x32's numbers (nr | 0x40000000) under the 64-bit arch: killed
        body = [
            _op(_JGE, other_abi, jt=3),
            _op(_JEQ, shmget, jt=1),
            _op(_RET, _ALLOW),
            _op(_RET, _ERRNO | errno.EPERM),
            _op(_RET, _KILL_PROCESS),
        ]
    return b"".join(head + body)
