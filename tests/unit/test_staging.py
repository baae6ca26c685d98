"""Staging registered once: the ring's arithmetic, the arena's FIFO waits, and a real plan
replayed for several updates that allocates and registers nothing after setup.

The rdma runs use the in-process verbs model of ``test_rdma_transport`` (its
``Fabric`` counts every MR made); the simnic runs record every write's source.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_rdma_transport import Fabric, fake_verbs, stand_in_plain_verbs

import weight_transfer.sender.staging as staging
from scheduling import compute_plan, load_cluster_config
from scheduling.config_metadata import engine_metas_from_config, trainer_meta_from_config
from weight_transfer.engines.reference.loader import load_engine_shard
from weight_transfer.engines.reference.random_state import random_state_dict
from weight_transfer.model.models import load_model_config
from weight_transfer.sender import bucket_prepare
from weight_transfer.sender.executor import RankTransfer
from weight_transfer.sender.prepare import as_bytes, prepare_pieces, prepare_pieces_into
from weight_transfer.sender.staging import ALIGN, RingAllocator, StagingArena, piece_slots
from weight_transfer.transport import make_transport
from weight_transfer.transport.base import TransportBase
from weight_transfer.transport.simnic.nic import SimNic

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


# ---------------------------------------------------------------- the ring, pure


@pytest.mark.parametrize(
    ("capacity", "steps", "want"),
    [
        # (op, arg): ("a", nbytes) -> start or None; ("f", start) frees
        (100, [("a", 40), ("a", 40), ("a", 40)], [0, 40, None]),
        (100, [("a", 40), ("a", 40), ("f", 0), ("a", 40)], [0, 40, None, 0]),  # wraps to 0
        (100, [("a", 40), ("a", 40), ("f", 40), ("a", 40)], [0, 40, None, None]),  # oldest held
        (100, [("a", 60), ("f", 0), ("a", 60)], [0, None, 0]),  # empty ring restarts at 0
        (100, [("a", 30), ("a", 30), ("f", 0), ("a", 50), ("a", 10)], [0, 30, None, None, 60]),
        (100, [("a", 50), ("a", 40), ("f", 0), ("a", 30), ("a", 20), ("a", 10)],
         [0, 50, None, 0, 30, None]),  # wrapped: the tail past the oldest waits its turn
        (100, [("a", 100)], [0]),
    ],
)
def test_ring_places_ranges_in_order_and_reuses_only_behind_the_oldest(capacity, steps, want):
    ring = RingAllocator(capacity)
    got = []
    for op, arg in steps:
        if op == "a":
            got.append(ring.alloc(arg))
        else:
            got.append(ring.free(arg))
    assert got == want


class ScanRing(RingAllocator):
    """The ring with its first free-lookup (a scan of every live range): the model."""

    def free(self, start: int) -> None:
        entry = next((e for e in self._live if e[0] == start and not e[2]), None)
        if entry is None:
            raise ValueError(f"no live range starts at {start} of the ring")
        self._open.pop(start)
        entry[2] = 1
        self.held -= entry[1] - entry[0]
        while self._live and self._live[0][2]:
            self._live.popleft()


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40), st.integers(0, 10**6)),
                max_size=120))
def test_ring_frees_in_any_order_as_the_scanning_model_does(ops):
    ring, model, live = RingAllocator(100), ScanRing(100), []
    for alloc, nbytes, pick in ops:
        if alloc or not live:
            got, want = ring.alloc(nbytes), model.alloc(nbytes)
            assert got == want
            if got is not None:
                live.append(got)
        else:
            start = live.pop(pick % len(live))
            ring.free(start)
            model.free(start)
        assert ring.held == model.held and list(ring._live) == list(model._live)
    for start in live:
        ring.free(start)
    assert ring.held == 0 and not ring._live


def test_ring_refuses_bad_sizes_and_unknown_frees():
    ring = RingAllocator(64)
    with pytest.raises(ValueError, match="cannot allocate 65 B from a ring of 64 B"):
        ring.alloc(65)
    with pytest.raises(ValueError, match="no live range starts at 8"):
        ring.free(8)


def test_piece_slots_align_every_piece():
    offsets, total = piece_slots([1, ALIGN, ALIGN + 1, 3])
    assert offsets == [0, ALIGN, 2 * ALIGN, 4 * ALIGN]
    assert total == 5 * ALIGN


# ---------------------------------------------------------------- the arena


class CountingNic(TransportBase):
    """A transport stand-in that counts source registrations."""

    registers_sources = True

    def __init__(self):
        self.registered, self.released = [], []

    def register_source(self, buf):
        self.registered.append((buf.data_ptr(), buf.numel()))
        return len(self.registered)

    def deregister_source(self, handle):
        self.released.append(handle)


def test_arena_is_registered_once_and_hands_out_fifo_ranges():
    nic = CountingNic()
    arena = StagingArena(4096, transport=nic)
    assert nic.registered == [(arena.buffer.data_ptr(), 4096)]
    assert arena.buffer.data_ptr() % (2 << 20) == 0  # huge-page aligned host memory

    async def scenario():
        a = await arena.acquire(3000)
        waiter = asyncio.create_task(arena.acquire(2000))  # does not fit beside a
        await asyncio.sleep(0.01)
        assert not waiter.done()
        arena.release(a)
        b = await asyncio.wait_for(waiter, 5)
        return a, b

    a, b = asyncio.run(scenario())
    assert (a.start, b.start) == (0, 0)
    assert b.buf.data_ptr() == arena.buffer.data_ptr() and b.buf.numel() == 2000
    assert arena.peak == 3000
    arena.close()
    arena.close()
    assert nic.released == [1]


def test_a_request_larger_than_the_arena_gets_a_one_off_buffer(caplog):
    arena = StagingArena(1024)
    with caplog.at_level(logging.WARNING, logger="weight_transfer.sender.staging"):
        lease = asyncio.run(arena.acquire(5000))
    assert lease.oversized and lease.buf.numel() == 5000
    assert arena.oversized == 1
    assert "5000 B to stage exceed the 1024 B arena" in caplog.text
    arena.release(lease)  # nothing to give back to the ring
    assert arena.ring.held == 0


def test_prepare_into_staging_equals_fresh_prepare():
    cfg = load_model_config(CONFIGS / "models" / "tiny_moe.yaml")
    cluster = load_cluster_config(CONFIGS / "clusters" / "local_cpu.yaml")
    state = random_state_dict(cfg, seed=1)
    engines = engine_metas_from_config(cfg, cluster, fp8=True)
    plan = compute_plan(trainer_meta_from_config(cfg, cluster), engines, cluster, model=cfg,
                        fp8=True)
    pieces = {}
    for p in plan.pieces:
        pieces.setdefault(p.src_param, []).append(p)
    for name, ps in pieces.items():
        offsets, total = piece_slots([p.nbytes for p in ps])
        buf = torch.full((total,), 0xAB, dtype=torch.uint8)
        outs = [buf[o : o + p.nbytes] for o, p in zip(offsets, ps, strict=True)]
        prepare_pieces_into(state[name], ps, outs)
        for out, want in zip(outs, prepare_pieces(state[name], ps), strict=True):
            assert torch.equal(out, as_bytes(want)), name


def test_prepare_into_names_the_piece_when_the_buffer_is_wrong():
    cfg = load_model_config(CONFIGS / "models" / "tiny_llama.yaml")
    cluster = load_cluster_config(CONFIGS / "clusters" / "local_cpu.yaml")
    engines = engine_metas_from_config(cfg, cluster, fp8=False)
    plan = compute_plan(trainer_meta_from_config(cfg, cluster), engines, cluster, model=cfg,
                        fp8=False)
    p = plan.pieces[0]
    full = random_state_dict(cfg, seed=0)[p.src_param]
    with pytest.raises(ValueError, match=f"holds {p.nbytes - 1} B, the piece has {p.nbytes}"):
        prepare_pieces_into(full, [p], [torch.zeros(p.nbytes - 1, dtype=torch.uint8)])


# ---------------------------------------------------------------- a plan, several updates


class Replay:
    """tiny_moe (FP8) planned over engine buffers registered on one target NIC."""

    def __init__(self, target, writer):
        self.cfg = load_model_config(CONFIGS / "models" / "tiny_moe.yaml")
        cluster = load_cluster_config(CONFIGS / "clusters" / "local_cpu.yaml")
        self.meta = trainer_meta_from_config(self.cfg, cluster)
        self.buffers, engines = {}, []
        for e in engine_metas_from_config(self.cfg, cluster, fp8=True):
            buf = torch.zeros(e.tensors[0].region.length, dtype=torch.uint8)
            real = target.register(buf)
            self.buffers[(e.replica, e.rank)] = buf
            engines.append(dataclasses.replace(e, tensors=tuple(
                dataclasses.replace(t, region=real) for t in e.tensors)))
        self.engines = engines
        self.plan = compute_plan(self.meta, engines, cluster, model=self.cfg, fp8=True)
        self.writer = writer
        self.state = random_state_dict(self.cfg, seed=0)

    def transfers(self, **kw):
        return [RankTransfer(plan=self.plan.trainer_plan(r.rank), params=self.meta.params,
                             get_param=lambda n: self.state[n], transport=self.writer,
                             watermark_bytes=1 << 20, **kw)
                for r in self.meta.ranks]

    def update(self, transfers, version):
        for name, new in random_state_dict(self.cfg, seed=version).items():
            self.state[name].copy_(new)  # new weights every step, in place as an optimizer's

        async def run_all():
            return [await t.run(version=version) for t in transfers]

        return asyncio.run(run_all())

    def check_bytes(self):
        for e in self.engines:
            want = load_engine_shard(self.cfg, self.state, e.shard, fp8=True)
            buf = self.buffers[(e.replica, e.rank)]
            for t in e.tensors:
                assert torch.equal(buf[t.offset : t.offset + t.nbytes], as_bytes(want[t.name]))


@pytest.fixture
def fabric():
    return Fabric(stand_in_plain_verbs())


def rdma_pair(fabric):
    w = make_transport("rdma", owner="trainers", nic="w", verbs=fake_verbs(fabric))
    t = make_transport("rdma", owner="engines", nic="t", verbs=fake_verbs(fabric))
    w.connect(t.peer_info("trainers"))
    t.connect(w.peer_info("engines"))
    return w, t


def test_staged_updates_make_no_mr_and_no_buffer_after_setup(fabric, monkeypatch):
    writer, target = rdma_pair(fabric)
    allocations = []
    real_alloc = staging.allocate_staging
    monkeypatch.setattr(staging, "allocate_staging",
                        lambda *a, **kw: allocations.append(a[0]) or real_alloc(*a, **kw))
    monkeypatch.setattr(bucket_prepare, "prepare_pieces", None)  # no fresh-tensor path
    r = Replay(target, writer)
    transfers = r.transfers()
    arenas = [t.arena for t in transfers if t.arena is not None]
    assert len(allocations) == len(arenas) == writer.registrations > 0  # one per rank, at setup
    for t in transfers:  # the trainer memory zero-copy pieces read from, also at setup
        t.register_sources()
    mrs, regs = fabric.mrs_created, writer.registrations
    for version in (1, 2, 3):
        reports = r.update(transfers, version)
        assert sum(rep.bytes_written for rep in reports) == r.plan.bytes_total
        r.check_bytes()
        assert (fabric.mrs_created, writer.registrations) == (mrs, regs), f"update {version}"
    assert len(allocations) == len(arenas)
    assert all(a.oversized == 0 for a in arenas)
    for t in transfers:
        t.close()
    assert len(fabric.mrs) == len(r.buffers)  # the arenas' MRs are gone, the targets' remain


def test_fresh_pieces_register_an_mr_per_write(fabric):
    writer, target = rdma_pair(fabric)
    r = Replay(target, writer)
    transfers = r.transfers(staging=False)
    mrs = fabric.mrs_created
    r.update(transfers, 1)
    r.check_bytes()
    assert fabric.mrs_created - mrs == r.plan.num_tasks  # the cost staging removes


class RecordingNic(SimNic):
    """A simnic that records the address range of every write's source."""

    sources: list[tuple[int, int]]

    async def write(self, src, dst, dst_offset=0):
        self.sources.append((src.data_ptr(), src.numel() * src.element_size()))
        await super().write(src, dst, dst_offset)


def test_simnic_writes_from_the_arenas_or_straight_from_the_parameters():
    """simnic needs no registration: pieces that are slices of a parameter are sent from it,
    every piece that is cut, cast or quantized from the arena; nothing else."""
    target = SimNic(owner="engines", nic="t")
    writer = RecordingNic(owner="trainers", nic="w")
    try:
        writer.connect(target.peer_info("trainers"))
        r = Replay(target, writer)
        transfers = r.transfers()
        arenas = [(t.arena.buffer.data_ptr(), t.arena.capacity) for t in transfers if t.arena]
        for version in (1, 2):
            writer.sources = []
            r.update(transfers, version)
            r.check_bytes()
            params = [(v.data_ptr(), v.numel() * v.element_size()) for v in r.state.values()]
            assert len(writer.sources) == r.plan.num_tasks
            staged = [any(a <= addr and addr + n <= a + cap for a, cap in arenas)
                      for addr, n in writer.sources]
            direct = [any(a <= addr and addr + n <= a + cap for a, cap in params)
                      for addr, n in writer.sources]
            assert all(s or d for s, d in zip(staged, direct, strict=True))
            assert sum(staged) > 0 and sum(direct) > 0
        assert not any(t.device_memory for t in transfers)  # simnic reads host memory only
        for t in transfers:
            t.close()
    finally:
        writer.close()
        target.close()


class GpuRecorder(TransportBase):
    """Writes through a simnic (host memory), recording where each source lived."""

    registers_sources = True

    def __init__(self, inner, *, device_memory: bool):
        self.inner, self.supports_device_memory = inner, device_memory
        self.on_gpu: list[bool] = []

    def register_source(self, buf):
        return buf.data_ptr()

    def deregister_source(self, handle):
        pass

    async def write(self, src, dst, dst_offset=0):
        self.on_gpu.append(src.is_cuda)
        await self.inner.write(src.cpu() if src.is_cuda else src, dst, dst_offset)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize("device_memory", [True, False])
def test_on_cuda_pieces_stay_on_the_gpu_when_the_nic_reads_it(device_memory):
    target, inner = SimNic(owner="engines", nic="t"), SimNic(owner="trainers", nic="w")
    try:
        inner.connect(target.peer_info("trainers"))
        writer = GpuRecorder(inner, device_memory=device_memory)
        r = Replay(target, writer)
        transfers = r.transfers(device="cuda")
        arenas = [t.arena for t in transfers if t.arena is not None]
        assert all(a.buffer.is_cuda == device_memory for a in arenas)
        assert all(a.buffer.is_pinned() for a in arenas if not device_memory)
        for version in (1, 2):
            r.update(transfers, version)
            r.check_bytes()
        assert writer.on_gpu and all(g == device_memory for g in writer.on_gpu)
        for t in transfers:
            t.close()
    finally:
        inner.close()
        target.close()
