"""Sparse delta codec, sender and engine apply, without a transport: every record and
header is "written" by copying its bytes where the write would land. Seeded random change
patterns over many cases (dtypes, densities, clustered and scattered), 0% and 100%
changed, a dropped record, a stale base, a torn slot."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from weight_transfer.delta.codec import (
    PAGE,
    Encoding,
    apply,
    changed,
    choose,
    encode,
    encoded_size,
)
from weight_transfer.engines.delta import DeltaArena, arena_layout
from weight_transfer.sender.delta.send import DeltaDirective, DeltaSender, DeltaSlot
from weight_transfer.types import Piece, RegionDesc, WriteTask

DTYPES = {"bfloat16": 2, "float8_e4m3fn": 1, "float32": 4}


def _mutate(rng: np.random.Generator, base: np.ndarray, itemsize: int, frac: float,
            clustered: bool) -> np.ndarray:
    new = base.copy()
    n = base.nbytes // itemsize
    k = round(frac * n)
    if k == 0:
        return new
    if clustered:
        start = int(rng.integers(0, max(1, n - k + 1)))
        idx = np.arange(start, start + k)
    else:
        idx = rng.choice(n, size=k, replace=False)
    view = new.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[itemsize])
    view[idx] ^= rng.integers(1, 255, size=k).astype(view.dtype)  # every one changes
    return new


@pytest.mark.parametrize("seed", range(40))
def test_encode_apply_roundtrip_random(seed: int) -> None:
    rng = np.random.default_rng(seed)
    itemsize = [1, 2, 4][seed % 3]
    n = int(rng.integers(1, 3 * PAGE))
    base = rng.integers(0, 256, size=n * itemsize, dtype=np.uint8)
    frac = [0.0, 1.0, 0.004, 0.04, 0.25, 0.7, 1 / n][seed % 7]
    new = _mutate(rng, base, itemsize, frac, clustered=bool(seed % 2))
    idx = changed(base, new, itemsize)
    for kind in Encoding:
        k, payload = encode(new, idx, itemsize, kind)
        assert payload.nbytes == encoded_size(k, n, idx.size, itemsize)
        dst = base.copy()
        apply(dst, k, payload, itemsize, idx.size)
        assert np.array_equal(dst, new), (kind, frac)
    best, _ = encode(new, idx, itemsize)
    assert best == choose(n, idx.size, itemsize)


def test_choice_follows_density() -> None:
    n = 1 << 20
    assert choose(n, 0, 2) is Encoding.SPARSE
    assert choose(n, n // 100, 1) is Encoding.SPARSE  # fp8 at lr 1e-6: 0.4% changed
    assert choose(n, n // 4, 2) is Encoding.BITMAP  # bf16 at lr 1e-5: ~25%
    assert choose(n, n, 2) is Encoding.DENSE  # everything changed


def test_apply_refuses_a_payload_of_the_wrong_size() -> None:
    base = np.zeros(1000, dtype=np.uint8)
    new = base.copy()
    new[::7] = 1
    idx = changed(base, new, 1)
    kind, payload = encode(new, idx, 1, Encoding.SPARSE)
    dst = base.copy()
    with pytest.raises(ValueError, match="payload"):
        apply(dst, kind, payload[:-8], 1, idx.size)
    assert np.array_equal(dst, base)  # nothing written


# ------------------------------------------------------------------------ sender + arena


class Fleet:
    """Engine ranks' registered buffers and arenas in local memory; writes are copies."""

    def __init__(self, pieces: list[Piece], replicas: int, fraction: float = 0.5) -> None:
        total = sum(p.nbytes for p in pieces)
        self.engines, self.tasks, self.arenas, slots = {}, [], {}, {}
        for r in range(replicas):
            owner = f"engine{r}/tp0"
            buf = np.zeros(total, dtype=np.uint8)
            region = RegionDesc(owner=owner, nic="n", addr=1000 + r, length=total, rkey=1)
            self.engines[region.addr] = buf
            off = 0
            for _i, p in enumerate(pieces):
                self.tasks.append(WriteTask(task_id=len(self.tasks), mesh_group=0, src_rank=0,
                                            piece=p, dst_replica=f"engine{r}", dst_rank=0,
                                            region=region, region_offset=off))
                off += p.nbytes
            layout, _ = arena_layout({0: total}, fraction)
            arena = DeltaArena(layout, owner=owner)
            self.arenas[owner] = arena
            aregion = RegionDesc(owner=owner, nic="n", addr=5000 + r, length=arena.nbytes,
                                 rkey=2)
            slots[owner] = DeltaSlot(region=aregion, offset=layout[0][0], size=layout[0][1])
        self.sender = DeltaSender(slots, rank=0)
        self.held = {f"engine{r}": None for r in range(replicas)}
        self.wire = 0

    def write(self, src: torch.Tensor, region: RegionDesc, offset: int) -> None:
        data = src.numpy()
        self.wire += data.nbytes
        if region.addr >= 5000:
            dst = self.arenas[region.owner].buffer.numpy()
        else:
            dst = self.engines[region.addr]
        dst[offset : offset + data.nbytes] = data

    def update(self, version: int, values: dict[Piece, np.ndarray], *, anchor: bool = False,
               drop: set[int] = frozenset(), flush: int | None = None) -> list:
        """One update; records written one by one, or (``flush``) as the sender's runs
        once ``flush`` bytes of an engine rank's wait, and the rest before the headers."""
        s = self.sender
        s.begin(DeltaDirective(version=version, anchor=anchor, held=dict(self.held)))
        enc = {p: s.encode(p, torch.from_numpy(v)) for p, v in values.items()}
        for t in self.tasks:
            where = s.place(t, enc[t.piece])
            if t.task_id in drop:
                continue
            if where is None:
                self.write(torch.from_numpy(values[t.piece]), t.region, t.region_offset)
            elif flush is None:
                self.write(*where)
            else:
                for run in s.take(min_bytes=flush):
                    self.write(run.src, run.region, run.offset)
        for run in s.take() if flush is not None else ():
            self.write(run.src, run.region, run.offset)
        for src, region, off in s.finish():
            self.write(src, region, off)
        done = []
        for owner, arena in self.arenas.items():
            replica = owner.split("/")[0]
            res = arena.apply(version=version, held=self.held[replica], buffers=self.engines)
            ranges = set(res.stale)
            bad = res.bad_slots
            repair = [t for t in self.tasks if t.region.owner == owner and (
                bad or (t.region.addr, t.region_offset, t.nbytes) in ranges)]
            for src, t in s.repair(repair):
                self.write(src, t.region, t.region_offset)
            self.held[replica] = version
            done.append(res)
        return done

    def expect(self, values: dict[Piece, np.ndarray]) -> None:
        for t in self.tasks:
            got = self.engines[t.region.addr][t.region_offset : t.region_offset + t.nbytes]
            assert np.array_equal(got, values[t.piece]), t


def _pieces(rng: np.random.Generator, count: int) -> list[Piece]:
    out = []
    for i in range(count):
        dtype = list(DTYPES)[i % 3]
        n = int(rng.integers(1, 20000)) * DTYPES[dtype]
        name = f"w{i}" + ("_scale_inv" if dtype == "float32" else "")
        out.append(Piece(dst_tensor=name, dst_offset=0, nbytes=n, dst_dtype=dtype,
                         src_param=f"p{i}", src_slice=((0, n),)))
    return out


@pytest.mark.parametrize("flush", [None, 0, 4096, 1 << 30])  # one by one, or batched
@pytest.mark.parametrize("seed", range(12))
def test_delta_updates_equal_dense_updates(seed: int, flush: int | None) -> None:
    rng = np.random.default_rng(100 + seed)
    pieces = _pieces(rng, 6)
    fleet = Fleet(pieces, replicas=2)
    values = {p: rng.integers(0, 256, p.nbytes, dtype=np.uint8) for p in pieces}
    fleet.update(1, values)  # first update: dense (no base yet)
    fleet.expect(values)
    for v in range(2, 8):
        frac = float(rng.choice([0.0, 0.001, 0.01, 0.05, 0.3, 1.0]))
        values = {p: _mutate(rng, x, DTYPES[p.dst_dtype], frac, bool(rng.integers(2)))
                  for p, x in values.items()}
        results = fleet.update(v, values, anchor=(v == 5), flush=flush)
        fleet.expect(values)
        assert all(r.ok for r in results)
        if frac <= 0.01 and v != 5:
            assert fleet.sender.stats.delta_tasks == len(fleet.tasks)
        if frac == 1.0:
            assert fleet.sender.stats.delta_tasks == 0


def test_dropped_record_is_caught_and_repaired() -> None:
    rng = np.random.default_rng(7)
    pieces = _pieces(rng, 4)
    fleet = Fleet(pieces, replicas=1)
    values = {p: rng.integers(0, 256, p.nbytes, dtype=np.uint8) for p in pieces}
    fleet.update(1, values)
    values = {p: _mutate(rng, x, DTYPES[p.dst_dtype], 0.01, False) for p, x in values.items()}
    # A record's write dropped: its header still says it was sent (slot digest fails).
    res = fleet.update(2, values, drop={1})
    assert res[0].bad_slots == (0,)
    fleet.expect(values)  # repaired dense
    values = {p: _mutate(rng, x, DTYPES[p.dst_dtype], 0.01, False) for p, x in values.items()}
    assert all(r.ok for r in fleet.update(3, values))
    fleet.expect(values)


def test_stale_base_goes_dense() -> None:
    rng = np.random.default_rng(8)
    pieces = _pieces(rng, 3)
    fleet = Fleet(pieces, replicas=2)
    values = {p: rng.integers(0, 256, p.nbytes, dtype=np.uint8) for p in pieces}
    fleet.update(1, values)
    # engine1 missed a version (the controller's view: torn): its tasks go dense.
    fleet.held["engine1"] = None
    values = {p: _mutate(rng, x, DTYPES[p.dst_dtype], 0.01, False) for p, x in values.items()}
    fleet.update(2, values)
    assert fleet.sender.stats.dense_tasks == 3 and fleet.sender.stats.delta_tasks == 3
    fleet.expect(values)
    # The controller believes engine0 holds version 2, but its bytes were changed behind
    # its back: the digest check refuses the record, the range is re-sent dense.
    fleet.engines[1000][5] ^= 0xFF
    values = {p: _mutate(rng, x, DTYPES[p.dst_dtype], 0.01, False) for p, x in values.items()}
    res = fleet.update(3, values)
    assert any("digest" in why for r in res for why in r.reasons)
    fleet.expect(values)
    # An engine that reports another held version than the record's base: refused.
    values = {p: _mutate(rng, x, DTYPES[p.dst_dtype], 0.01, False) for p, x in values.items()}
    arena = fleet.arenas["engine0/tp0"]
    fleet.held["engine0"] = 3
    s = fleet.sender
    s.begin(DeltaDirective(version=4, held={"engine0": 3, "engine1": 3}))
    enc = {p: s.encode(p, torch.from_numpy(v)) for p, v in values.items()}
    for t in fleet.tasks:
        where = s.place(t, enc[t.piece])
        assert where is not None
        fleet.write(*where)
    for src, region, off in s.finish():
        fleet.write(src, region, off)
    res = arena.apply(version=4, held=2, buffers=fleet.engines)
    assert len(res.stale) == 3 and all("base version 3" in r for r in res.reasons)


def test_records_placed_back_to_back_are_taken_as_one_run_per_engine_rank() -> None:
    rng = np.random.default_rng(11)
    pieces = _pieces(rng, 5)
    fleet = Fleet(pieces, replicas=2)
    values = {p: rng.integers(0, 256, p.nbytes, dtype=np.uint8) for p in pieces}
    fleet.update(1, values)
    values = {p: _mutate(rng, x, DTYPES[p.dst_dtype], 0.01, False) for p, x in values.items()}
    s = fleet.sender
    s.begin(DeltaDirective(version=2, held={"engine0": 1, "engine1": 1}))
    enc = {p: s.encode(p, torch.from_numpy(v)) for p, v in values.items()}
    placed: dict[str, list] = {}
    for t in fleet.tasks:
        where = s.place(t, enc[t.piece])
        assert where is not None
        placed.setdefault(t.region.owner, []).append((t, where))
        if len(placed[t.region.owner]) == 2:  # two records: below the bar, nothing taken
            assert s.take(min_bytes=1 << 20) == []
    runs = {r.region.owner: r for r in s.take(min_bytes=1)}
    assert sorted(runs) == sorted(placed)
    for owner, got in placed.items():
        run = runs[owner]
        assert run.tasks == [t for t, _ in got]
        assert (run.region, run.offset) == got[0][1][1:]  # where the first record goes
        # its bytes: every record's, back to back, as written one by one
        want = np.concatenate([w[0].numpy() for _, w in got])
        assert np.array_equal(run.src.numpy(), want)
    assert s.take() == []  # taken once
    for run in runs.values():
        fleet.write(run.src, run.region, run.offset)
    for src, region, off in s.finish():
        fleet.write(src, region, off)
    for owner, arena in fleet.arenas.items():
        assert arena.apply(version=2, held=1, buffers=fleet.engines).ok, owner
    fleet.expect(values)


def test_full_slot_sends_the_rest_dense() -> None:
    rng = np.random.default_rng(9)
    pieces = _pieces(rng, 6)
    fleet = Fleet(pieces, replicas=1, fraction=0.001)  # the 64 KiB minimum slot
    values = {p: rng.integers(0, 256, p.nbytes, dtype=np.uint8) for p in pieces}
    fleet.update(1, values)
    values = {p: _mutate(rng, x, DTYPES[p.dst_dtype], 0.6, False) for p, x in values.items()}
    fleet.update(2, values)
    fleet.expect(values)


def test_held_version_is_the_last_resumed_one_unless_held_since() -> None:
    from weight_transfer.engines.delta_rank import held_version

    ev = [("resume", 3, 0.0), ("pause", None, 1.0)]
    assert held_version(ev, None) == 3  # this update's pause
    assert held_version([*ev, ("pause", None, 2.0)], None) is None  # a hold: torn
    assert held_version([("version", 5, 0.0)], 5) == 5  # no pause during updates
    assert held_version([], None) is None


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(itemsize=st.sampled_from([1, 2, 4]), n=st.integers(1, 3 * PAGE + 7),
       seed=st.integers(0, 2**32 - 1), frac=st.floats(0.0, 1.0))
def test_any_change_pattern_roundtrips_in_every_encoding(itemsize, n, seed, frac) -> None:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size=n * itemsize, dtype=np.uint8)
    new = _mutate(rng, base, itemsize, frac, clustered=bool(seed % 2))
    idx = changed(base, new, itemsize)
    view = {1: np.uint8, 2: np.uint16, 4: np.uint32}[itemsize]
    assert np.array_equal(idx, np.flatnonzero(base.view(view) != new.view(view)))
    for kind in Encoding:
        k, payload = encode(new, idx, itemsize, kind)
        dst = base.copy()
        apply(dst, k, payload, itemsize, idx.size)
        assert np.array_equal(dst, new)
