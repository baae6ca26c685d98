"""Random corruptions of real messages, thrown at the functions that receive them.

Real messages: a plan computed for tiny_llama on the local_cpu cluster over engine
regions registered on a real simnic (its whole-plan blob and each trainer's blob,
made by the real encoders), the engine ranks' metadata with those regions, the
trainer ranks' metadata, a real simnic peer info. Corruptions: flipped bytes of
a blob; a field of the decoded msgpack set to a negative, huge, wrong-typed or
other value, an entry dropped or duplicated (then re-encoded); a field of the
metadata set likewise. Every receiver either raises a ValueError that names
what was wrong, or returns a message that is still valid, checked here by an
independent oracle; a receiver that would write or connect has done nothing.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
from pathlib import Path

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from actors.messages import TrainerRankMeta, check_trainer_metas
from scheduling import compute_plan, load_cluster_config
from scheduling.config_metadata import engine_metas_from_config, trainer_meta_from_config
from scheduling.serialize import dumps_plan, loads_plan
from weight_transfer.integrity.receipt import check_engine_meta
from weight_transfer.model.models import load_model_config
from weight_transfer.plan.check import expected_piece_nbytes
from weight_transfer.plan.wire import dumps_trainer_plan, loads_trainer_plan
from weight_transfer.sender.executor import check_trainer_plan
from weight_transfer.transport.base import TransportError
from weight_transfer.transport.handshake import Connection, HostId, connect_peers
from weight_transfer.transport.simnic.nic import SimNic
from weight_transfer.types import DTYPE_SIZES

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
U64 = 1 << 64


@functools.cache
def world():
    """A real plan over regions registered on a real simnic (kept alive with its buffers)."""
    cfg = load_model_config(CONFIGS / "models" / "tiny_llama.yaml")
    cluster = load_cluster_config(CONFIGS / "clusters" / "local_cpu.yaml")
    tm = trainer_meta_from_config(cfg, cluster)
    target, bufs, engines = SimNic(owner="engines", nic="inode0/nic0"), [], []
    for e in engine_metas_from_config(cfg, cluster, fp8=False):
        bufs.append(torch.zeros(e.tensors[0].region.length, dtype=torch.uint8))
        real = dataclasses.replace(target.register(bufs[-1]), owner=f"{e.replica}/tp{e.rank}",
                                   nic=e.nic)
        engines.append(dataclasses.replace(
            e, tensors=tuple(dataclasses.replace(t, region=real) for t in e.tensors)))
    plan = compute_plan(tm, engines, cluster, model=cfg, fp8=False)
    return {"tm": tm, "engines": engines, "plan": plan, "target": target, "bufs": bufs,
            "plan_blob": dumps_plan(plan),
            "trainer_blobs": [dumps_trainer_plan(plan.trainer_plan(r.rank)) for r in tm.ranks]}


# --------------------------------------------------------------------------- blob corruption

VALUES = st.sampled_from([-1, -(1 << 40), 1 << 62, (1 << 63) - 1, U64 - 1, 0, 1, 7, 1000,
                          "bogus", "", None, 1.5, True, [], {"x": 1}])


def leaves(obj, out=None):
    """Every (container, key) of a decoded msgpack structure."""
    out = [] if out is None else out
    items = obj.items() if isinstance(obj, dict) else enumerate(obj)
    for k, v in list(items):
        out.append((obj, k))
        if isinstance(v, dict | list):
            leaves(v, out)
    return out


@st.composite
def corrupt_blob(draw, blob: bytes) -> bytes:
    """``blob`` with flipped bytes, or one field of its decoded form changed, re-encoded."""
    if draw(st.booleans()):
        data = bytearray(blob)
        for _ in range(draw(st.integers(1, 6))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= draw(st.integers(1, 255))
        return bytes(data)
    obj = msgpack.unpackb(blob, raw=False, strict_map_key=False)
    spots = leaves(obj)
    container, key = spots[draw(st.integers(0, len(spots) - 1))]
    how = draw(st.sampled_from(["set", "set", "nudge", "drop", "dup"]))
    if how == "nudge":  # a near miss: often still in range, sometimes still valid
        value = container[key]
        container[key] = (value + draw(st.integers(-2, 2)) if type(value) is int
                          else draw(VALUES))
    elif how == "set" or isinstance(container, dict):
        container[key] = draw(VALUES) if how == "set" else None
        if how == "drop":
            del container[key]
    elif how == "drop":
        del container[key]
    else:
        container.insert(key, copy.deepcopy(container[key]))
    return msgpack.packb(obj, use_bin_type=True)


def assert_trainer_plan_valid(plan, params):
    """Oracle for an accepted trainer plan: what its writes need to be safe."""
    shapes = {p.name: p.shape for p in params}
    ids = [t.task_id for t in plan.tasks]
    assert len(ids) == len(set(ids))
    for t in plan.tasks:
        assert t.src_rank == plan.rank
        assert t.region_offset >= 0 and t.region_offset + t.nbytes <= t.region.length
        assert t.region.addr >= 0 and t.region.addr + t.region.length <= U64
        p = t.piece
        assert p.dst_dtype in DTYPE_SIZES and p.nbytes == expected_piece_nbytes(p) > 0
        shape = shapes[p.src_param]
        assert len(p.src_slice) == len(shape)
        assert all(0 <= a < b <= d for (a, b), d in zip(p.src_slice, shape, strict=True))


@FAST
@given(data=st.data())
def test_corrupt_trainer_plans_are_refused_or_still_valid(data):
    w = world()
    rank = data.draw(st.integers(0, len(w["trainer_blobs"]) - 1))
    blob = data.draw(corrupt_blob(w["trainer_blobs"][rank]))
    try:
        plan = loads_trainer_plan(blob)
        check_trainer_plan(plan, w["tm"].params)
    except ValueError as err:
        assert str(err)  # says what was wrong
        event("refused")
        return
    event("accepted")
    assert_trainer_plan_valid(plan, w["tm"].params)


@FAST
@given(data=st.data())
def test_corrupt_plans_are_refused_or_still_valid(data):
    w = world()
    blob = data.draw(corrupt_blob(w["plan_blob"]))
    try:
        plan = loads_plan(blob)  # validates: every destination byte written once
    except ValueError as err:
        assert str(err)
        event("refused")
        return
    event("accepted")
    plan.validate()
    for r in plan.trainer_ranks:  # what a receiver does with it next works
        assert_trainer_plan_valid(plan.trainer_plan(r.rank), plan.params)
    assert plan.send_bytes().sum() == plan.recv_bytes().sum() == plan.bytes_total


def test_a_trainer_keeps_its_previous_plan_when_the_new_one_is_corrupt():
    from actors.trainer import TrainerMixin
    from weight_transfer.sync.barrier import BarrierKey

    w, t = world(), TrainerMixin()
    t.wt_attach(model=torch.nn.Linear(4, 4), rank=0, world=4)
    previous = object()
    t._wt_link = previous
    bad = bytearray(w["trainer_blobs"][0])
    bad[len(bad) // 2] ^= 0xFF
    for blob in (bytes(bad), b"\x93\x01", w["trainer_blobs"][0]):  # the last: foreign params
        with pytest.raises(ValueError):
            t.wt_connect(blob, [], store=("127.0.0.1", 1), barrier_key=BarrierKey.new(),
                         rank_info=w["tm"].ranks[0])
        assert t._wt_link is previous and t.wt_nic is None  # nothing replaced, no NIC opened


# --------------------------------------------------------------------------- metadata


def _set(obj, name, value):
    out = copy.copy(obj)
    object.__setattr__(out, name, value)
    return out


NUMS = st.sampled_from([-1, -(1 << 70), 0, 1, 3, 1 << 20, 1 << 62, 1 << 63, U64, U64 + 1,
                        True, 2.5, "7", None])


@st.composite
def corrupt_engine(draw, meta):
    kind = draw(st.sampled_from(["meta", "shard", "tensor", "region", "tensors"]))
    if kind == "meta":
        name = draw(st.sampled_from(["replica", "rank", "node", "nic"]))
        return _set(meta, name, draw(st.one_of(NUMS, st.sampled_from(["", "x"]))))
    if kind == "shard":
        name = draw(st.sampled_from(["tp_rank", "tp_size", "ep_rank", "ep_size"]))
        return _set(meta, "shard", _set(meta.shard, name, draw(NUMS)))
    tensors = list(meta.tensors)
    i = draw(st.integers(0, len(tensors) - 1))
    if kind == "tensors":
        how = draw(st.sampled_from(["drop", "dup", "swap", "empty"]))
        if how == "drop":
            del tensors[i]
        elif how == "dup":
            tensors.insert(i, tensors[i])
        elif how == "swap":
            tensors[0], tensors[i] = tensors[i], tensors[0]
        else:
            tensors = []
    elif kind == "tensor":
        name = draw(st.sampled_from(["name", "shape", "dtype", "offset"]))
        value = {"name": st.sampled_from(["", tensors[0].name, "other"]),
                 "shape": st.sampled_from([(-1,), (1 << 40, 1 << 40), (0,), (3, "4"), [2, 2],
                                           tensors[0].shape]),
                 "dtype": st.sampled_from(["float7", "", "int32", "bfloat16", None]),
                 "offset": NUMS}[name]
        tensors[i] = _set(tensors[i], name, draw(value))
    else:
        name = draw(st.sampled_from(["addr", "length", "rkey", "owner", "nic", "transport"]))
        region = _set(tensors[i].region, name, draw(st.one_of(NUMS, st.just(""))))
        tensors = [_set(t, "region", region) if t.region == tensors[i].region else t
                   for t in tensors]
    return _set(meta, "tensors", tuple(tensors))


def _uint(v, lo=0, hi=1 << 62):
    return type(v) is int and lo <= v <= hi


def engine_ok(m) -> bool:
    """Independent oracle: is this engine metadata safe to plan writes into?"""
    s, most = m.shard, 1 << 20  # ranks and parallel sizes: at most 2**20
    if not (isinstance(m.replica, str) and m.replica and _uint(m.rank, 0, most)
            and isinstance(m.node, str) and isinstance(m.nic, str) and m.nic):
        return False
    if not (_uint(s.tp_size, 1, most) and _uint(s.ep_size, 1, most)
            and _uint(s.tp_rank, 0, s.tp_size - 1) and _uint(s.ep_rank, 0, s.ep_size - 1)):
        return False
    if not m.tensors or len({t.name for t in m.tensors}) != len(m.tensors):
        return False
    spans = {}
    for t in m.tensors:
        r = t.region
        if not (isinstance(t.name, str) and t.name and t.dtype in DTYPE_SIZES
                and isinstance(t.shape, tuple) and all(_uint(d) for d in t.shape)
                and _uint(t.offset)):
            return False
        if not (all(isinstance(x, str) and x for x in (r.owner, r.nic, r.transport))
                and _uint(r.addr, 0, U64 - 1) and _uint(r.length, 1) and _uint(r.rkey, 0, U64 - 1)
                and r.addr + r.length <= U64):
            return False
        n = DTYPE_SIZES[t.dtype]
        for d in t.shape:
            n *= d
        if t.offset + n > r.length:
            return False
        spans.setdefault(r, []).append((t.offset, t.offset + n))
    for rows in spans.values():
        rows.sort()
        if any(b0 < a1 for (_, a1), (b0, _) in itertools.pairwise(rows)):
            return False
    return True


@FAST
@given(data=st.data())
def test_corrupt_engine_metadata_is_refused_exactly_when_unsafe(data):
    w = world()
    meta = w["engines"][data.draw(st.integers(0, len(w["engines"]) - 1))]
    bad = data.draw(corrupt_engine(meta))
    ok = engine_ok(bad)
    try:
        check_engine_meta(bad)
    except ValueError as err:
        assert not ok, f"refused a safe message: {err}"
        return
    assert ok, "accepted an unsafe engine metadata"


@st.composite
def corrupt_trainers(draw):
    w = world()
    host = HostId(hostname="h", address="127.0.0.1")
    metas = [TrainerRankMeta(rank=r.rank, world=len(w["tm"].ranks), node="n",
                             expert_naming="per_expert", params=w["tm"].params, host=host)
             for r in w["tm"].ranks]
    i = draw(st.integers(0, len(metas) - 1))
    kind = draw(st.sampled_from(["rank", "world", "expert_naming", "node", "host", "param",
                                 "params", "drop_rank", "dup_rank"]))
    if kind in ("rank", "world"):
        metas[i] = _set(metas[i], kind, draw(NUMS))
    elif kind == "expert_naming":
        metas[i] = _set(metas[i], kind, draw(st.sampled_from(["stacked", "sideways", ""])))
    elif kind == "node":
        metas[i] = _set(metas[i], kind, draw(st.sampled_from(["", "other", None])))
    elif kind == "host":
        metas[i] = _set(metas[i], kind, draw(st.sampled_from([None, "h", HostId(
            hostname=1, address="a")])))
    elif kind == "drop_rank":
        del metas[i]
    elif kind == "dup_rank":
        metas.append(metas[i])
    else:
        params = list(metas[i].params)
        j = draw(st.integers(0, len(params) - 1))
        if kind == "params":
            params.insert(j, params[j]) if draw(st.booleans()) else params.pop(j)
        else:
            p = params[j]
            field, value = draw(st.sampled_from([
                ("shape", (-4,)), ("shape", (*tuple(p.shape), 1 << 62)), ("dtype", "fp5"),
                ("name", ""), ("mesh", _set(p.mesh, "ranks", p.mesh.ranks * 2)),
                ("mesh", _set(p.mesh, "shape", (-1,))),
                ("placements", p.placements * 2),
                ("placements", tuple(_set(x, "dim", 9) for x in p.placements)),
                ("shape", p.shape)]))
            params[j] = _set(p, field, value)
        metas[i] = _set(metas[i], "params", tuple(params))
    return kind, metas


@FAST
@given(case=corrupt_trainers())
def test_corrupt_trainer_metadata_is_refused_naming_the_rank_or_field(case):
    kind, metas = case
    try:
        out = check_trainer_metas(metas)
    except ValueError as err:
        msg = str(err)
        assert "trainer" in msg, msg
        return
    # Accepted: still one world, ranks 0..n-1 once, unique valid parameters.
    assert sorted(m.rank for m in out) == list(range(out[0].world))
    for m in out:
        names = [p.name for p in m.params]
        assert len(names) == len(set(names)) and all(names)
        assert all(p.dtype in DTYPE_SIZES and all(_uint(d) for d in p.shape) for p in m.params)
        assert m.expert_naming in ("per_expert", "stacked")
        assert m.host is None or isinstance(m.host.hostname, str)
    assert kind not in ("drop_rank", "dup_rank")


# --------------------------------------------------------------------------- peer info


@FAST
@given(data=st.data())
def test_corrupt_peer_infos_connect_nothing(data):
    w = world()
    info = w["target"].peer_info("trainer0")
    field = data.draw(st.sampled_from(["owner", "nic", "transport", "endpoint", *info.endpoint]))
    if field in info.endpoint:
        ep = dict(info.endpoint)
        if data.draw(st.booleans()):
            del ep[field]
        else:
            ep[field] = data.draw(st.one_of(NUMS, st.sampled_from(["zz", "", "00ff"])))
        bad = _set(info, "endpoint", ep)
    else:
        bad = _set(info, field, data.draw(st.one_of(NUMS, st.sampled_from(
            ["", "rdma", "simnic", {1: 2}]))))
    writer = SimNic(owner="trainer0", nic="tnode0/nic0")
    try:
        connect_peers({"tnode0/nic0": writer}, [Connection(nic="tnode0/nic0", peer=bad)],
                      owner="trainer0")
    except ValueError as err:
        assert str(err)
        assert not writer._peers  # nothing connected
    except TransportError as err:  # well-formed but not a live peer: a clear transport error
        assert "peer" in str(err) and not writer._peers
    finally:
        writer.close()
