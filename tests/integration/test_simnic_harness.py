"""The RemoteTarget harness itself: start-up errors, commands, blocking, killing."""

from __future__ import annotations

import asyncio
import os

import pytest

from actors.tools.testkit.harness import (
    GUARD_BYTE,
    RemoteTarget,
    RemoteTargetError,
    proc_activity,
)
from weight_transfer.transport import TransportError


def test_errors_at_start_come_back_with_the_childs_message():
    with pytest.raises(ValueError, match="unknown transport 'nope'") as err:
        RemoteTarget("nope", nbytes=4096).start()
    assert any("raised in target process" in n for n in err.value.__notes__)
    with pytest.raises(ValueError, match="max_inflight"):
        RemoteTarget("simnic", nbytes=4096, transport_opts={"max_inflight": 0}).start()
    with pytest.raises(ValueError, match="nbytes must be a positive int"):
        RemoteTarget("simnic", nbytes=0)
    with pytest.raises(ValueError, match="guard_bytes"):
        RemoteTarget("simnic", nbytes=1, guard_bytes=-1)


def test_buffer_layout_commands_and_lifecycle(make_target):
    t = make_target("simnic", nbytes=10_000, guard_bytes=100, owner="engine3",
                    transport_opts={"nic": "n9"})
    assert (t.region.owner, t.region.nic, t.region.length) == ("engine3", "n9", 10_000)
    assert t.region.addr % (2 << 20) == 0  # huge-page aligned: fast process_vm_writev
    assert t.peer_info.endpoint["pid"] == t.pid != os.getpid()
    assert t.read(-100, 10_200) == bytes([GUARD_BYTE]) * 10_200
    t.fill(7)
    assert t.read(-1, 3) == bytes([GUARD_BYTE, 7, 7])
    assert t.read(9_999, 2) == bytes([7, GUARD_BYTE])
    with pytest.raises(ValueError, match="outside region"):
        t.read(10_000, 101)
    with pytest.raises(ValueError, match="private"):
        t.call("_table")
    assert t.call("peer_info", "x").owner == "engine3"
    assert t.get_peer_info("x").endpoint["table_fd"] == t.peer_info.endpoint["table_fd"]
    with pytest.raises(RemoteTargetError, match="already started"):
        t.start()
    t.close()
    t.close()
    with pytest.raises(RemoteTargetError, match="not running"):
        t.read(0, 1)


def test_blocking_and_releasing(make_target, make_simnic):
    t = make_target("simnic", nbytes=1 << 20)
    nic = make_simnic(owner="writer")
    nic.connect(t.peer_info)
    with pytest.raises(RemoteTargetError, match="without block"):
        t.release()
    t.block()
    with pytest.raises(RemoteTargetError, match="blocked; release"):
        t.read(0, 1)
    act = proc_activity(t.pid)
    asyncio.run(nic.write(b"while asleep", t.region, 3))
    assert proc_activity(t.pid).switches == act.switches
    t.release()
    assert t.read(3, 12) == b"while asleep"
    with t.blocked():
        pass
    t.block()
    t.close()  # releases, then closes
    assert not t.alive


def test_killed_target(make_target, make_simnic):
    t = make_target("simnic", nbytes=4096)
    t.block()
    t.kill()
    assert not t.alive
    with pytest.raises(RemoteTargetError, match=r"exited \(code -9\)"):
        t.read(0, 1)
    nic = make_simnic(owner="writer")
    with pytest.raises(TransportError, match="cannot connect"):
        nic.connect(t.peer_info)
    t.close()
