"""Checks on receipt: each bad field is a ValueError naming where and what was wrong."""

import copy
import dataclasses

import msgpack
import numpy as np
import pytest
from test_receipt_properties import world

from actors.messages import check_trainer_metas
from scheduling.serialize import loads_plan
from weight_transfer.integrity.receipt import check_engine_meta, check_peer_info, check_region
from weight_transfer.plan.wire import loads_trainer_plan
from weight_transfer.transport.handshake import Connection, answer_requests, connect_peers
from weight_transfer.transport.simnic.nic import SimNic
from weight_transfer.types import PeerInfo, RegionDesc


def _set(obj, **fields):
    out = copy.copy(obj)
    for k, v in fields.items():
        object.__setattr__(out, k, v)
    return out


REGION = RegionDesc(owner="engine0/tp0", nic="n0", addr=4096, length=1 << 20, rkey=7)


@pytest.mark.parametrize("fields,match", [
    ({"length": -4}, r"task 3: region length must be an integer in \[1, .*\], not -4"),
    ({"length": 0}, r"region length .* not 0"),
    ({"addr": 1 << 64}, r"region addr must be an integer in \[0, 18446744073709551615\]"),
    ({"addr": (1 << 64) - 16, "length": 32}, r"runs past 2\*\*64"),
    ({"rkey": -1}, r"region rkey"),
    ({"owner": ""}, r"region owner must be a non-empty string"),
    ({"addr": True}, r"region addr must be an integer"),
])
def test_region_fields(fields, match):
    with pytest.raises(ValueError, match=match):
        check_region(_set(REGION, **fields), "task 3")


def engine():
    return world()["engines"][0]


@pytest.mark.parametrize("change,match", [
    (lambda m: _set(m, tensors=(_set(m.tensors[0], dtype="float7"), *m.tensors[1:])),
     r"engine0/tp0 tensor 'model.embed_tokens.weight': unknown dtype 'float7'"),
    (lambda m: _set(m, tensors=(_set(m.tensors[0], shape=(-1, 4)), *m.tensors[1:])),
     r"shape\[0\] must be an integer in \[0, .*\], not -1"),
    (lambda m: _set(m, tensors=(*m.tensors, m.tensors[0])), r"is listed twice"),
    (lambda m: _set(m, tensors=(_set(m.tensors[0], offset=m.tensors[0].region.length),
                                *m.tensors[1:])), r"lie outside its \d+ B region"),
    (lambda m: _set(m, tensors=(m.tensors[0], _set(m.tensors[1], offset=8), *m.tensors[2:])),
     r"overlap in one region"),
    (lambda m: _set(m, shard=_set(m.shard, tp_rank=5)), r"shard tp_rank must be .*\[0, 1\]"),
    (lambda m: _set(m, rank=-1), r"engine0: rank must be an integer"),
    (lambda m: _set(m, tensors=()), r"tensors must be a non-empty tuple"),
    (lambda m: _set(m, served_by_flip="yes"), r"engine0/tp0: served_by_flip must be a bool"),
])
def test_engine_metadata_fields(change, match):
    check_engine_meta(engine())  # the real one passes
    with pytest.raises(ValueError, match=match):
        check_engine_meta(change(engine()))


def trainer_metas():
    from actors.messages import TrainerRankMeta

    tm = world()["tm"]
    return [TrainerRankMeta(rank=r.rank, world=4, node="n", expert_naming="per_expert",
                            params=tm.params) for r in tm.ranks]


@pytest.mark.parametrize("change,match", [
    (lambda ms: [*ms[:3], _set(ms[3], rank=2)], r"ranks \[0, 1, 2, 2\]"),
    (lambda ms: ms[:3], r"ranks \[0, 1, 2\] of world sizes \[4\]"),
    (lambda ms: [_set(ms[0], rank=4), *ms[1:]], r"trainer metadata 0: rank must be .*\[0, 3\]"),
    (lambda ms: [_set(ms[0], expert_naming="sideways"), *ms[1:]],
     r"trainer rank 0: expert_naming must be one of"),
    (lambda ms: [_set(ms[0], params=(*ms[0].params, ms[0].params[0])), *ms[1:]],
     r"trainer rank 0: parameter 'model.embed_tokens.weight' is listed twice"),
    (lambda ms: [_set(ms[0], params=(_set(ms[0].params[0], dtype="fp5"),)), *ms[1:]],
     r"trainer rank 0 param 0 'model.embed_tokens.weight': unknown dtype 'fp5'"),
])
def test_trainer_metadata_fields(change, match):
    check_trainer_metas(trainer_metas())
    with pytest.raises(ValueError, match=match):
        check_trainer_metas(change(trainer_metas()))


def _repack(blob, edit):
    obj = msgpack.unpackb(blob, raw=False, strict_map_key=False)
    edit(obj)
    return msgpack.packb(obj, use_bin_type=True)


def test_trainer_plan_blob_fields_are_named():
    blob = world()["trainer_blobs"][0]
    cases = [
        (lambda o: o["pieces"][0].__setitem__(2, -8), r"pieces\[0\]: nbytes must be"),
        (lambda o: o["pieces"][0].__setitem__(2, o["pieces"][0][2] + 2),
         r"pieces\[0\]: nbytes \d+, but its slice .* makes \d+"),
        (lambda o: o["regions"][0].__setitem__(3, -1), r"regions\[0\]: region length"),
        (lambda o: o["groups"][0][3].__setitem__(1, 10 ** 6),
         r"groups\[0\] task 0: piece must be an integer in \[0, \d+\]"),
        (lambda o: o["groups"][0][3].__setitem__(5, 1 << 40), r"outside its \d+ B region"),
        (lambda o: o["groups"][0][3].pop(), r"is not a multiple of 6"),
        (lambda o: o["strings"].append(3), r"strings must be a list of strings"),
        (lambda o: o.__setitem__("rank", -2), r"trainer_plan blob: rank must be"),
    ]
    for edit, match in cases:
        with pytest.raises(ValueError, match=match):
            loads_trainer_plan(_repack(blob, edit))
    with pytest.raises(ValueError, match="msgpack cannot decode it"):
        loads_trainer_plan(blob[: len(blob) // 2])


def test_plan_blob_columns_are_named():
    blob = world()["plan_blob"]

    def bad_piece(o):
        dt, raw = o["columns"]["task_piece"]
        col = np.frombuffer(raw, dtype=np.dtype(dt).newbyteorder("<")).copy()
        col[3] = 99999
        o["columns"]["task_piece"][1] = col.tobytes()

    with pytest.raises(ValueError, match=r"column task_piece row 3: 99999 is not in \[0, \d+\]"):
        loads_plan(_repack(blob, bad_piece))
    with pytest.raises(ValueError, match=r"column task_src must be an integer dtype"):
        loads_plan(_repack(blob, lambda o: o["columns"]["task_src"].__setitem__(0, "float32")))
    with pytest.raises(ValueError, match=r"ranks\[1\] is rank 0; trainer ranks run 0..n-1"):
        loads_plan(_repack(blob, lambda o: o["ranks"][1].__setitem__(0, 0)))


def test_bad_connections_connect_none_and_bad_requests_answer_none():
    target = world()["target"]
    good = target.peer_info("trainer0")
    writer = SimNic(owner="trainer0", nic="t0")
    try:
        bad = dataclasses.replace(good, endpoint={**good.endpoint, "pid": -3})
        with pytest.raises(ValueError, match=r"endpoint pid must be an int in \[1, "):
            connect_peers({"t0": writer}, [Connection(nic="t0", peer=good),
                                           Connection(nic="t0", peer=bad)], owner="trainer0")
        assert not writer._peers  # the good one was not connected either
        wrong = dataclasses.replace(good, transport="rdma")
        with pytest.raises(ValueError, match=r"connection 0 \(t0\): peer engines@inode0/nic0 "
                                             r"speaks 'rdma', this NIC 'simnic'"):
            connect_peers({"t0": writer}, [Connection(nic="t0", peer=wrong)], owner="trainer0")
        with pytest.raises(ValueError, match=r"trainer0: info request 0 must be an InfoRequest"):
            answer_requests({"t0": writer}, ["t0"], owner="trainer0")
    finally:
        writer.close()
    with pytest.raises(ValueError, match="peer endpoint must be a mapping with string keys"):
        check_peer_info(PeerInfo(owner="a", nic="b", transport="simnic", endpoint={1: 2}), "x")
