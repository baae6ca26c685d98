"""plan_buckets: which parameters one coalesced gather takes, from metadata alone.

Tables of small cases: FSDP2 parameters (``Shard(0)`` on a 1-D mesh) next to
each other in the gather order share a bucket while its gather memory fits
``bucket_bytes``; anything else is a bucket of its own; every rank cuts the
same buckets because they depend on the metadata only.
"""

import pytest

from weight_transfer.buckets import GatherBucket, plan_buckets, reserve_bytes
from weight_transfer.types import MeshDesc, ParamMeta, Placement

MESH2 = MeshDesc(ranks=(0, 1), shape=(2,))
MESH2B = MeshDesc(ranks=(2, 3), shape=(2,))
MESH22 = MeshDesc(ranks=(0, 1, 2, 3), shape=(2, 2))
SHARD0 = (Placement(kind="shard", dim=0),)
REPL = (Placement(kind="replicate"),)


def meta(name, rows=8, cols=4, mesh=MESH2, placements=SHARD0, dtype="float32"):
    shape = (rows, cols) if cols else (rows,)
    return ParamMeta(name=name, shape=shape, dtype=dtype, mesh=mesh, placements=placements)


def layout(buckets: list[GatherBucket]) -> list[tuple[tuple[str, ...], bool]]:
    return [(tuple(p.name for p in b.params), b.coalesced) for b in buckets]


# reserve of one 8x4 float32 parameter (128 B) on 2 ranks, coalesced:
# padded local (4 rows = 64 B + 16 B alignment) x (world + 1) + full 128 B = 368 B
ONE = 368


@pytest.mark.parametrize(("params", "mode", "bucket_bytes", "want"), [
    ([], "bucket", 1 << 20, []),
    # three FSDP2 parameters that fit: one coalesced bucket
    ([meta("a"), meta("b"), meta("c")], "bucket", 1 << 20, [(("a", "b", "c"), True)]),
    # per-parameter mode: one full_tensor() each
    ([meta("a"), meta("b")], "param", 1 << 20, [(("a",), False), (("b",), False)]),
    # exactly two fit (2 x 368 B); the third opens a new bucket
    ([meta("a"), meta("b"), meta("c")], "bucket", 2 * ONE,
     [(("a", "b"), True), (("c",), True)]),
    # a parameter larger than the bucket is a bucket of one (still coalesced)
    ([meta("a"), meta("big", rows=1024)], "bucket", 2 * ONE,
     [(("a",), True), (("big",), True)]),
    # another mesh ends the run
    ([meta("a"), meta("b", mesh=MESH2B), meta("c", mesh=MESH2B)], "bucket", 1 << 20,
     [(("a",), True), (("b", "c"), True)]),
    # not FSDP2's layout (Replicate, a 2-D EP x FSDP mesh): alone, through full_tensor()
    ([meta("a"), meta("r", placements=REPL), meta("b")], "bucket", 1 << 20,
     [(("a",), True), (("r",), False), (("b",), True)]),
    ([meta("e", mesh=MESH22, placements=(Placement(kind="shard", dim=0),) * 2), meta("a")],
     "bucket", 1 << 20, [(("e",), False), (("a",), True)]),
])
def test_buckets_follow_the_gather_order(params, mode, bucket_bytes, want):
    got = plan_buckets(params, mode=mode, bucket_bytes=bucket_bytes)
    assert layout(got) == want
    # every parameter exactly once, in the given order
    assert [p.name for b in got for p in b.params] == [p.name for p in params]


def test_reserve_counts_padded_input_gather_buffer_and_full_tensors():
    (b,) = plan_buckets([meta("a")], bucket_bytes=1 << 20)
    assert reserve_bytes(b) == ONE
    (two,) = plan_buckets([meta("a"), meta("b")], bucket_bytes=1 << 20)
    assert reserve_bytes(two) == 2 * ONE
    # 5 rows over 2 ranks pad to 3 rows (48 B + 16 B), x3, plus the 80 B tensor
    (odd,) = plan_buckets([meta("odd", rows=5)], bucket_bytes=1 << 20)
    assert reserve_bytes(odd) == (48 + 16) * 3 + 80
    (alone,) = plan_buckets([meta("r", placements=REPL)], bucket_bytes=1 << 20)
    assert reserve_bytes(alone) == 128  # full_tensor(): the full tensor only
    # every bucket of a plan fits, unless it holds a single parameter
    ps = [meta(f"p{i}", rows=4 * (i + 1)) for i in range(10)]
    for bb in (400, 1000, 5000):
        for bucket in plan_buckets(ps, bucket_bytes=bb):
            assert reserve_bytes(bucket) <= bb or len(bucket.params) == 1


def test_key_names_the_first_parameter_and_the_count():
    b1, = plan_buckets([meta("a")], bucket_bytes=1 << 20)
    b3, = plan_buckets([meta("a"), meta("b"), meta("c")], bucket_bytes=1 << 20)
    assert (b1.key, b3.key, b3.nbytes) == ("a", "a (+2)", 3 * 128)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"mode": "layer"}, "gather mode must be one of .*'layer'"),
    ({"bucket_bytes": 0}, "bucket_bytes must be positive, got 0"),
])
def test_bad_arguments_name_what_is_wrong(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_buckets([meta("a")], **kwargs)
