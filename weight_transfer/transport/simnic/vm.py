"""Low-level memory and process helpers behind the simulated NIC (Linux only).

* :func:`vm_write` copies local bytes into another process's address space with
  ``process_vm_writev`` (through ctypes, which releases the GIL during the call),
  retrying short writes; the target process runs no code.
* :func:`~weight_transfer.sender.host_memory.prefault` (from the public
  :mod:`weight_transfer.sender.host_memory`, with ``alloc_buffer``) makes a registered
  region's pages present before a write needs them.
* :class:`ProcessHandle` tracks one peer process through a pidfd, so a dead
  peer is detected without polling and a recycled pid is never written to.

Usage::

    handle = ProcessHandle.open(pid, start_time=proc_start_time(pid))
    vm_write(handle.pid, remote_addr, addr, 1 << 20)
"""

from __future__ import annotations

import ctypes
import errno
import math
import os
import select

from weight_transfer.sender.host_memory import PAGE_SIZE, prefault

__all__ = ["PAGE_SIZE", "ProcessHandle", "host_identity", "prefault", "proc_start_time",
           "vm_write"]


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_process_vm_writev = _libc.process_vm_writev
_process_vm_writev.restype = ctypes.c_ssize_t
_process_vm_writev.argtypes = [
    ctypes.c_int,
    ctypes.POINTER(_IoVec),
    ctypes.c_ulong,
    ctypes.POINTER(_IoVec),
    ctypes.c_ulong,
    ctypes.c_ulong,
]


def vm_write(pid: int, remote_addr: int, local_addr: int, nbytes: int) -> None:
    """Copy ``nbytes`` from ``local_addr`` here to ``remote_addr`` in process ``pid``.

    Retries short writes; raises :class:`OSError` with the errno (``ESRCH``: the
    process is gone, ``EFAULT``: an address is not mapped, ``EPERM``: not allowed).
    """
    done = 0
    while done < nbytes:
        local = _IoVec(local_addr + done, nbytes - done)
        remote = _IoVec(remote_addr + done, nbytes - done)
        n = _process_vm_writev(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if n < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_writev to pid {pid}: {os.strerror(err)}")
        if n == 0:
            raise OSError(errno.EFAULT, f"process_vm_writev to pid {pid} made no progress")
        done += n


# --------------------------------------------------------------------------- processes


def proc_start_time(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/pid/stat)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        raise ProcessLookupError(errno.ESRCH, f"no process {pid}") from None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    return int(stat[stat.rindex(b")") + 2 :].split()[19])


def host_identity() -> tuple[str, int]:
    """(boot id, pid-namespace inode): two processes may exchange pids only if both match."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot_id = f.read().strip()
    return boot_id, os.stat("/proc/self/ns/pid").st_ino


class ProcessHandle:
    """One live peer process, held through a pidfd (immune to pid reuse)."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid = pid
        self._pidfd = pidfd

    @classmethod
    def open(cls, pid: int, *, start_time: int) -> ProcessHandle:
        """Open ``pid`` if it is still the process that started at ``start_time``.

        Raises :class:`ProcessLookupError` if it exited or its pid was reused.
        """
        pidfd = os.pidfd_open(pid)  # ProcessLookupError if gone
        # Checked after pidfd_open: the pidfd now names the process we verified.
        try:
            actual = proc_start_time(pid)
        except ProcessLookupError:
            os.close(pidfd)
            raise
        if actual != start_time:
            os.close(pidfd)
            raise ProcessLookupError(
                errno.ESRCH, f"pid {pid} was reused (start time {actual}, expected {start_time})"
            )
        return cls(pid, pidfd)

    def alive(self) -> bool:
        """False once the process has exited (a zombie counts as exited)."""
        return not self.wait_exit(0.0)

    def wait_exit(self, timeout: float, wake_fd: int | None = None) -> bool:
        """Sleep up to ``timeout`` s; True as soon as the process exits.

        Returns early (False) if ``wake_fd`` becomes readable.
        """
        if self._pidfd < 0:
            return True
        poller = select.poll()  # not select(): fd numbers may exceed FD_SETSIZE
        poller.register(self._pidfd, select.POLLIN)
        if wake_fd is not None:
            poller.register(wake_fd, select.POLLIN)
        events = poller.poll(max(0, math.ceil(timeout * 1000)))
        return any(fd == self._pidfd for fd, _ in events)

    def close(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
