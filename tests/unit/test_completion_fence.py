"""The completion fence, against the model verbs device with completions held back.

A trainer writes a version into an engine rank's shadow through the real RDMA
transport (``RdmaTransport`` over ``test_rdma_transport``'s in-process model of a
verbs device). The device here holds every work completion until the test releases
it (and, in one variant, has already moved the bytes: landed but not completed, as
a NIC may). While any completion is outstanding the controller's fence
(:func:`actors.controller.checks.completion_fence`, what both the shadow flip and the
in-place resume wait on) does not clear the replica, whatever bytes landed; a
partial report does not clear it either; only once every WRITE completed at its
writer and its report is seen does it clear, and then the flip serves exactly the
written bytes.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_rdma_transport import Fabric, FakeQP, fake_verbs, stand_in_plain_verbs

from actors.controller.checks import completion_fence
from weight_transfer.engines.fence import CommandFence
from weight_transfer.engines.registered import RegisteredMemory
from weight_transfer.engines.shadow.rank import ShadowControl
from weight_transfer.engines.shadow.store import ShadowCopy, ShadowError
from weight_transfer.integrity.checksums import IntegrityPolicy
from weight_transfer.sender.retry import RetryingWriter, RetryPolicy
from weight_transfer.sender.run_log import RunLog
from weight_transfer.transport import make_transport
from weight_transfer.transport.options import DEFAULT_TRANSPORT
from weight_transfer.types import Piece, ShardSpec, WriteTask

N, CHUNK = 64 * 1024, 8 * 1024


class HeldQP(FakeQP):
    """A QP whose completions wait for ``fabric.release()``; the bytes land at post time
    (``fabric.land_early``) or at the completion."""

    def post_send(self, wr):
        fabric = self.pd.fabric
        assert self.unpolled < self.cap, "send queue overflow"
        self.unpolled += 1
        status = self._execute(wr) if fabric.land_early else None
        fabric.held.append((self, wr, status))


def release(fabric, count=None):
    """Complete the first ``count`` held work requests (all: None)."""
    count = len(fabric.held) if count is None else count
    done, fabric.held = fabric.held[:count], fabric.held[count:]
    for qp, wr, status in done:
        qp.cq.push(wr.wr_id, qp._execute(wr) if status is None else status)
        qp.cq.entries[-1].qp = qp


class Boundary:
    def pause(self):
        pass

    def resume(self):
        pass

    def wait_idle(self, timeout=None):
        return True


def engine_rank(target):
    live = torch.zeros(N, dtype=torch.uint8)
    shadow = torch.zeros(N, dtype=torch.uint8)
    entries = [("w", (N,), "uint8", 0)]
    fence, mem = CommandFence("engine0/tp0"), RegisteredMemory("engine0/tp0")
    mem.nics["inode0/nic0"] = target  # the rank's NIC: the model device's
    ctl = ShadowControl("engine0/tp0", "reference", fence=fence, mem=mem, boundary=Boundary())
    ctl.copy = ShadowCopy("engine0/tp0", "reference", live=[(live, entries)],
                          shadow=[(shadow, entries)])
    meta = mem.register(DEFAULT_TRANSPORT, ctl.copy.region_buffers(), nic_names=["inode0/nic0"],
                        node="node", address="127.0.0.1", replica="engine0", rank=0,
                        shard=ShardSpec(tp_rank=0, tp_size=1))
    ctl.bind()
    return ctl, live, shadow, meta.tensors[0].region


def tasks(region):
    return [WriteTask(task_id=i, mesh_group=0, src_rank=0, dst_replica="engine0", dst_rank=0,
                      region=region, region_offset=i * CHUNK,
                      piece=Piece(dst_tensor="w", dst_offset=i * CHUNK, nbytes=CHUNK,
                                  dst_dtype="uint8", src_param="w",
                                  src_slice=((i * CHUNK, (i + 1) * CHUNK),)))
            for i in range(N // CHUNK)]


def seen(run):  # what the controller holds once the rank's report arrived
    return SimpleNamespace(transfer=SimpleNamespace(dest_bytes=dict(run.dest_bytes)))


@pytest.mark.parametrize("land_early", [False, True], ids=["in-flight", "landed-not-completed"])
def test_no_flip_before_every_write_completed_and_was_seen(land_early):
    fabric = Fabric(stand_in_plain_verbs())
    fabric.held, fabric.land_early = [], land_early
    verbs = fake_verbs(fabric)
    verbs.qp = SimpleNamespace(**{**vars(verbs.qp), "QP": HeldQP})
    writer = make_transport("rdma", owner="trainer0", nic="tnode0/nic0", verbs=verbs,
                            max_inflight=4, chunk_bytes=CHUNK)
    target = make_transport("rdma", owner="engine0/tp0", nic="inode0/nic0", verbs=verbs)
    writer.connect(target.peer_info("trainer0"))
    target.connect(writer.peer_info("engine0/tp0"))
    ctl, live, shadow, region = engine_rank(target)
    src = torch.from_numpy(np.random.default_rng(7).integers(0, 256, N, dtype=np.uint8))
    planned = {0: {"engine0": {0: N}}}
    ctl.fence.version = 1
    assert ctl.stage(2, epoch=1)

    async def main():
        run = RunLog(version=2, writer=RetryingWriter(writer, RetryPolicy()))
        reports = {}

        async def write(t):
            piece = src[t.region_offset:t.region_offset + t.nbytes]
            await run.writer.write(piece, t.region, t.region_offset)
            run.landed(t, piece, IntegrityPolicy())  # counted once the WRITE completed

        async def trainer():  # its writes run concurrently, as the executor's do
            await asyncio.gather(*(write(t) for t in tasks(region)))
            reports[0] = seen(run)

        job = asyncio.create_task(trainer())
        try:
            for step in range(3):
                for _spin in range(50):
                    await asyncio.sleep(0)
                assert fabric.held and not job.done()  # writes posted, completions held
                fence = completion_fence(planned, reports, replicas=["engine0"])
                assert fence.cleared == () and "no report seen" in fence.pending["engine0"]
                partial = completion_fence(planned, {0: seen(run)}, replicas=["engine0"])
                assert partial.cleared == () and f"of {N} B into engine0/tp0" in \
                    partial.pending["engine0"]
                assert torch.equal(live, torch.zeros(N, dtype=torch.uint8))  # serves the old
                if step == 0:  # landed (or not) before any completion: not cleared either way
                    assert bool(shadow.any()) is land_early
                release(fabric, 2)  # two completions arrive; the rest still outstanding
        finally:  # complete everything, so that the writer's window can end
            while not job.done():
                release(fabric)
                await asyncio.sleep(0)
        await job
        return reports

    reports = asyncio.run(main())
    assert completion_fence(planned, reports, replicas=["engine0"]).cleared == ("engine0",)
    assert ctl.flip(2, epoch=2, deadline=None)
    assert torch.equal(live, src) and ctl.fence.version == 2
    writer.close()
    target.close()


def test_the_fence_names_each_missing_writer_and_engine_rank():
    planned = {0: {"engine0": {0: 10, 1: 5}}, 1: {"engine0": {1: 7}, "engine1": {0: 3}},
               2: {"engine1": {1: 4}}}
    done = {0: seen(SimpleNamespace(dest_bytes={"engine0/tp0": 10, "engine0/tp1": 5})),
            1: seen(SimpleNamespace(dest_bytes={"engine0/tp1": 6, "engine1/tp0": 3}))}
    fence = completion_fence(planned, done, replicas=["engine0", "engine1", "engine2"])
    assert fence.cleared == ("engine2",)  # nothing planned into it: nothing to wait for
    assert fence.pending == {"engine0": "trainer rank 1: 6 of 7 B into engine0/tp1 completed",
                             "engine1": "trainer rank 2: no report seen"}


def test_a_flip_before_the_stage_is_refused_whatever_landed():
    fabric = Fabric(stand_in_plain_verbs())
    target = make_transport("rdma", owner="engine0/tp0", nic="inode0/nic0",
                            verbs=fake_verbs(fabric))
    ctl, live, shadow, _ = engine_rank(target)
    shadow.fill_(3)
    with pytest.raises(ShadowError, match="flip to version 2 refused"):
        ctl.flip(2, epoch=1, deadline=None)
    assert not live.any()
    target.close()
