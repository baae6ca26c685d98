"""An outsider: a plain Python process (no Ray, nothing of this project) that inverts one
byte of another process's memory with process_vm_readv/process_vm_writev.

    python outsider_write.py PID ADDRESS     # prints the old and the new byte
"""

import ctypes
import sys


class IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def main(pid: int, addr: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    buf = (ctypes.c_ubyte * 1)()
    local, remote = IoVec(ctypes.addressof(buf), 1), IoVec(addr, 1)
    for call in (libc.process_vm_readv, None, libc.process_vm_writev):
        if call is None:
            old = buf[0]
            buf[0] = old ^ 0xFF
            continue
        call.restype = ctypes.c_ssize_t
        if call(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) != 1:
            sys.exit(f"{call.__name__} into pid {pid} at {addr:#x} failed: "
                     f"errno {ctypes.get_errno()}")
    sys.stdout.write(f"{old} {buf[0]}\n")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2], 0))
