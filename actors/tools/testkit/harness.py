"""A target process for transport tests and benchmarks: registered memory in ANOTHER process.

:class:`RemoteTarget` spawns a child (multiprocessing ``spawn``) that builds one
NIC with ``make_transport(kind, owner=..., **transport_opts)``, allocates a
pre-faulted, huge-page-advised buffer of ``guard_bytes + nbytes + guard_bytes``
filled with :data:`GUARD_BYTE`, registers the middle ``nbytes`` (2 MiB-aligned)
and sends back its :class:`RegionDesc` and :class:`PeerInfo`. The parent then
drives it over a pipe; errors raised in the child come back as the same
exception, with the child's traceback as a note. It works for every backend
(``kind="simnic"``, ``"mooncake"``, ``"rdma"``)::

    with RemoteTarget(nbytes=1 << 20, guard_bytes=4096) as target:
        nic = make_transport("simnic", owner="writer")
        nic.connect(target.peer_info)
        asyncio.run(nic.write(data, target.region, 0))
        assert target.read(-4096, 4096) == bytes([GUARD_BYTE]) * 4096  # guard intact
        with target.blocked():     # the child sleeps in read(2): it runs no code
            asyncio.run(nic.write(data, target.region, 0))
        target.kill()              # SIGKILL, e.g. to test a dead peer

Offsets of ``read``/``digest`` are relative to the registered region; negative
ones (down to ``-guard_bytes``) and ones past its end reach into the guards.
:func:`proc_activity` reads a process's CPU time and context switches from
/proc, to prove a blocked target did not run while it was written to.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import platform
import signal
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weight_transfer.errors import WeightTransferError
from weight_transfer.sender import host_memory
from weight_transfer.types import EngineRankMeta, PeerInfo, RegionDesc

GUARD_BYTE = 0xA5
_READ_SYSCALL = {"x86_64": 0, "aarch64": 63}.get(platform.machine())


class RemoteTargetError(WeightTransferError, RuntimeError):
    """The target process failed, exited, or cannot take the command now."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcActivity:
    """CPU time (clock ticks) and context switches of all threads of a process."""

    cpu_ticks: int
    switches: int
    states: tuple[str, ...]


def proc_activity(pid: int) -> ProcActivity:
    """Sum of user+system ticks and of (non)voluntary context switches over all threads."""
    ticks = switches = 0
    states = []
    for task in sorted(Path(f"/proc/{pid}/task").iterdir()):
        stat = (task / "stat").read_bytes()
        fields = stat[stat.rindex(b")") + 2 :].split()
        states.append(fields[0].decode())
        ticks += int(fields[11]) + int(fields[12])
        for line in (task / "status").read_text().splitlines():
            if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")):
                switches += int(line.split()[1])
    return ProcActivity(cpu_ticks=ticks, switches=switches, states=tuple(states))


# --------------------------------------------------------------------------- child side


class _Child:
    """The target process's state: one NIC and one guarded, registered buffer."""

    def __init__(self, kind: str, nbytes: int, guard: int, opts: dict[str, Any], owner: str):
        from weight_transfer.transport import make_transport

        self.nbytes, self.guard = nbytes, guard
        huge = host_memory.HUGE_PAGE_SIZE
        lead = -(-guard // huge) * huge  # keeps the region aligned
        self.mapping, off, addr = host_memory.alloc_buffer(lead + nbytes + guard, fill=GUARD_BYTE)
        self.addr = addr + lead
        self.view = memoryview(self.mapping)[off + lead - guard : off + lead + nbytes + guard]
        self.transport = make_transport(kind, owner=owner, **opts)
        self.region = self.transport.register(self.view[guard : guard + nbytes])

    def _span(self, offset: int, n: int) -> slice:
        if n < 0 or offset < -self.guard or offset + n > self.nbytes + self.guard:
            raise ValueError(
                f"range ({offset}, {n} B) is outside region+guards "
                f"[-{self.guard}, {self.nbytes + self.guard})"
            )
        return slice(self.guard + offset, self.guard + offset + n)

    def read(self, offset: int, n: int) -> bytes:
        return bytes(self.view[self._span(offset, n)])

    def digest(self, offset: int, n: int) -> str:
        return hashlib.sha256(self.view[self._span(offset, n)]).hexdigest()

    def fill(self, byte: int) -> None:
        ctypes.memset(self.addr, byte, self.nbytes)

    def deregister(self) -> None:
        self.transport.deregister(self.region)

    def connect(self, peer: PeerInfo) -> None:
        self.transport.connect(peer)

    def peer_info(self, remote_owner: str) -> PeerInfo:
        return self.transport.peer_info(remote_owner)

    def call(self, method: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        if method.startswith("_"):
            raise ValueError(f"call: {method!r} is private")
        return getattr(self.transport, method)(*args, **kwargs)


def _send_error(conn: mpc.Connection, exc: BaseException) -> None:
    tb = traceback.format_exc()
    try:
        pickle.loads(pickle.dumps(exc))
        conn.send(("err", exc, tb))
    except Exception:
        conn.send(("err", RemoteTargetError(f"{type(exc).__name__}: {exc}"), tb))


def _child_main(
    kind: str, nbytes: int, guard: int, opts: dict[str, Any], owner: str, peer_owner: str,
    conn: mpc.Connection, release: mpc.Connection,
) -> None:
    try:
        child = _Child(kind, nbytes, guard, opts, owner)
        conn.send(("ok", (child.region, child.peer_info(peer_owner), os.getpid())))
    except BaseException as e:
        _send_error(conn, e)
        return
    try:
        while True:
            try:
                cmd, args = conn.recv()
            except EOFError:  # the parent is gone
                return
            if cmd == "block":
                conn.send(("ok", release.fileno()))
                os.read(release.fileno(), 1)  # a plain blocking read: no code of ours runs
                conn.send(("ok", None))
                continue
            try:
                value = None if cmd == "close" else getattr(child, cmd)(*args)
            except BaseException as e:
                _send_error(conn, e)
                continue
            if cmd == "close":
                break
            conn.send(("ok", value))
    finally:
        child.transport.close()
    conn.send(("ok", None))


# --------------------------------------------------------------------------- parent side


class RemoteTarget:
    """A child process holding registered memory; see the module docstring."""

    def __init__(
        self,
        kind: str = "simnic",
        *,
        nbytes: int,
        guard_bytes: int = 4096,
        transport_opts: dict[str, Any] | None = None,
        owner: str = "target",
        peer_owner: str = "writer",
        timeout: float = 120.0,
    ) -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"RemoteTarget: nbytes must be a positive int, not {nbytes!r}")
        if isinstance(guard_bytes, bool) or not isinstance(guard_bytes, int) or guard_bytes < 0:
            raise ValueError(f"RemoteTarget: guard_bytes must be an int >= 0, not {guard_bytes!r}")
        self.kind, self.nbytes, self.guard_bytes = kind, nbytes, guard_bytes
        self.owner, self.timeout = owner, timeout
        self._args = (kind, nbytes, guard_bytes, dict(transport_opts or {}), owner, peer_owner)
        self._proc: Any = None
        self._blocked = False
        self.region: RegionDesc | None = None
        self.peer_info: PeerInfo | None = None
        self.pid = 0

    def __enter__(self) -> RemoteTarget:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        if self._proc is not None:
            raise RemoteTargetError(f"target {self.owner} is already started")
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        release_r, self._release_w = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=_child_main, args=(*self._args, child_conn, release_r),
            name=f"remote-target-{self.owner}", daemon=True,
        )
        self._proc.start()
        child_conn.close()
        release_r.close()
        try:
            self.region, self.peer_info, self.pid = self._reply("start", self.timeout)
        except BaseException:
            self._teardown()
            raise

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    # -- commands
    def read(self, offset: int, n: int) -> bytes:
        return self._call("read", offset, n)

    def digest(self, offset: int, n: int) -> str:
        """sha256 hex digest of a range (cheap to compare for large regions)."""
        return self._call("digest", offset, n)

    def fill(self, byte: int) -> None:
        self._call("fill", byte)

    def deregister(self) -> None:
        self._call("deregister")

    def connect(self, peer: PeerInfo) -> None:
        self._call("connect", peer)

    def get_peer_info(self, remote_owner: str) -> PeerInfo:
        return self._call("peer_info", remote_owner)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call a public method of the child's transport (e.g. ``set_link``)."""
        return self._call("call", method, args, kwargs)

    def block(self) -> None:
        """Put the child in a plain blocking read(2); returns once it sleeps there."""
        fd = self._call("block")
        self._blocked = True
        deadline = time.monotonic() + self.timeout
        while not self._sleeping_in_read(fd):
            if not self.alive or time.monotonic() > deadline:
                raise RemoteTargetError(f"target process {self.pid} did not block in read(2)")
            time.sleep(0.001)

    def release(self) -> None:
        if not self._blocked:
            raise RemoteTargetError("release() without block()")
        os.write(self._release_w.fileno(), b"\x01")
        self._blocked = False
        self._reply("release", self.timeout)

    @contextlib.contextmanager
    def blocked(self) -> Iterator[None]:
        self.block()
        try:
            yield
        finally:
            if self.alive:
                self.release()

    def kill(self) -> None:
        """SIGKILL the child and reap it."""
        if self._proc is None:
            return
        if self._proc.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._proc.pid, signal.SIGKILL)
        self._proc.join()
        self._blocked = False

    def close(self) -> None:
        """Close the child's transport and let it exit (kill it if it does not). Idempotent."""
        if self._proc is None:
            return
        try:
            if self._blocked and self.alive:
                self.release()
            if self.alive:
                self._call("close", timeout=30.0)
                self._proc.join(timeout=30.0)
        finally:
            self._teardown()

    def _teardown(self) -> None:
        self.kill()
        self._conn.close()
        self._release_w.close()
        self._proc = None

    # -- plumbing
    def _call(self, cmd: str, *args: Any, timeout: float | None = None) -> Any:
        if self._proc is None:
            raise RemoteTargetError(f"target is not running (cannot {cmd})")
        if self._blocked:
            raise RemoteTargetError(f"target is blocked; release() it before {cmd}")
        if not self._proc.is_alive():
            raise RemoteTargetError(
                f"target process {self.pid} exited (code {self._proc.exitcode}); cannot {cmd}"
            )
        self._conn.send((cmd, args))
        return self._reply(cmd, self.timeout if timeout is None else timeout)

    def _reply(self, cmd: str, timeout: float) -> Any:
        ready = mpc.wait([self._conn, self._proc.sentinel], timeout)
        if not ready:
            raise TimeoutError(
                f"target process {self._proc.pid} did not answer {cmd} within {timeout} s"
            )
        try:
            status, value, *tb = self._conn.recv() if self._conn.poll() else (None, None)
        except (EOFError, OSError):
            status = None
        if status is None:
            self._proc.join()
            raise RemoteTargetError(
                f"target process {self._proc.pid} ({self.kind}) exited with code "
                f"{self._proc.exitcode} during {cmd}"
            )
        if status == "err":
            value.add_note(f"raised in target process {self._proc.pid} ({cmd}):\n{tb[0]}")
            raise value
        return value

    def _sleeping_in_read(self, fd: int) -> bool:
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_bytes()
            if stat[stat.rindex(b")") + 2 :].split()[0] != b"S":
                return False
            if _READ_SYSCALL is None:
                return True
            call = Path(f"/proc/{self.pid}/syscall").read_text().split()
        except OSError:
            return False
        return call[0] == str(_READ_SYSCALL) and int(call[1], 16) == fd


def start_engine_targets(
    stack: contextlib.ExitStack, layout: list[EngineRankMeta]
) -> tuple[list[RemoteTarget], list[EngineRankMeta]]:
    """One :class:`RemoteTarget` (simnic) per engine rank of a synthetic layout
    (``scheduling.config_metadata.engine_metas_from_config``), each as large as the rank's
    region and entered on ``stack``; returns the targets and the engine metadata re-pointed
    at the targets' live regions, ready to plan against."""
    targets = [stack.enter_context(RemoteTarget(
        nbytes=e.tensors[0].region.length, guard_bytes=0, owner=str(e.id),
        transport_opts={"nic": e.tensors[0].region.nic})) for e in layout]
    engines = [dataclasses.replace(e, tensors=tuple(
        dataclasses.replace(t, region=tg.region) for t in e.tensors))
        for e, tg in zip(layout, targets, strict=True)]
    return targets, engines
