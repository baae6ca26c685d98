"""plan_buckets: which parameters one coalesced gather takes, from metadata alone.

Tables of small cases: parameters next to each other in the gather order with
the same mesh and the same placements, each ``Shard`` or ``Replicate`` (FSDP2's
``(Shard(0),)``, HSDP's ``(Replicate(), Shard(0))``, EP x FSDP experts'
``(Shard(0), Shard(1))``), share a bucket while its gather memory fits
``bucket_bytes``; anything else is a bucket of its own; every rank cuts the
same buckets because they depend on the metadata only.
"""

import pytest

from weight_transfer.sender.buckets import GatherBucket, plan_buckets, reserve_bytes
from weight_transfer.types import MeshDesc, ParamMeta, Placement

MESH2 = MeshDesc(ranks=(0, 1), shape=(2,))
MESH2B = MeshDesc(ranks=(2, 3), shape=(2,))
MESH22 = MeshDesc(ranks=(0, 1, 2, 3), shape=(2, 2))
SHARD0 = (Placement(kind="shard", dim=0),)
REPL = (Placement(kind="replicate"),)
S = {d: Placement(kind="shard", dim=d) for d in range(3)}
R = Placement(kind="replicate")
EPXF = (S[0], S[1])  # stacked experts on (ep, dp_shard_in_ep)
HSDP = (R, S[0])  # on (dp_replicate, dp_shard)


def meta(name, rows=8, cols=4, mesh=MESH2, placements=SHARD0, dtype="float32"):
    shape = (rows, cols) if cols else (rows,)
    return ParamMeta(name=name, shape=shape, dtype=dtype, mesh=mesh, placements=placements)


def expert(name, experts=3, rows=7, cols=4, dtype="bfloat16"):
    """A stacked-experts parameter [experts, rows, cols] on the 2-D (ep, fsdp) mesh."""
    return ParamMeta(name=name, shape=(experts, rows, cols), dtype=dtype, mesh=MESH22,
                     placements=EPXF)


def hsdp(name, rows=5, cols=3, dtype="float32"):
    return meta(name, rows=rows, cols=cols, mesh=MESH22, placements=HSDP, dtype=dtype)


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
    # N-D meshes: stacked experts (EP x FSDP) and HSDP coalesce too, one run per layout
    ([meta("e", mesh=MESH22, placements=(S[0], S[0])), meta("a")],
     "bucket", 1 << 20, [(("e",), True), (("a",), True)]),
    ([expert("g0"), expert("d0"), expert("g1")], "bucket", 1 << 20,
     [(("g0", "d0", "g1"), True)]),
    ([hsdp("w"), hsdp("b", cols=0), expert("g"), hsdp("n")], "bucket", 1 << 20,
     [(("w", "b"), True), (("g",), True), (("n",), True)]),
    # same mesh, other placements: the run ends
    ([expert("g"), ParamMeta(name="h", shape=(3, 4, 4), dtype="float32", mesh=MESH22,
                                    placements=(S[0], S[2])),
      expert("d")], "bucket", 1 << 20, [(("g",), True), (("h",), True), (("d",), True)]),
    # no shard (all Replicate), Partial, or a placement per mesh dim missing: alone
    ([hsdp("a"), meta("r", mesh=MESH22, placements=(R, R)), hsdp("b")], "bucket", 1 << 20,
     [(("a",), True), (("r",), False), (("b",), True)]),
    ([hsdp("a"), meta("p", mesh=MESH22, placements=(R, Placement(kind="partial"))),
      meta("m", mesh=MESH22, placements=(S[0],))], "bucket", 1 << 20,
     [(("a",), True), (("p",), False), (("m",), False)]),
    # the byte cap applies as on 1-D meshes: two experts of 552 B each fit in 1104 B
    ([expert("g0"), expert("g1"), expert("g2")], "bucket", 2 * 552,
     [(("g0", "g1"), True), (("g2",), True)]),
    ([expert("g0"), expert("g1")], "param", 1 << 20, [(("g0",), False), (("g1",), False)]),
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


def test_reserve_of_n_d_buckets_is_the_largest_level():
    # [3, 7, 4] bf16 (168 B) on (ep=2, fsdp=2) as (Shard(0), Shard(1)):
    # level 0 (ep) sends [2, 7, 4] = 112 B (+16 aligned), gathers 2x, cuts the full 168 B:
    #   3 * 128 + 168 = 552; level 1 (fsdp) sends [2, 4, 4] = 64 B (+16), cuts 112 B:
    #   3 * 80 + 112 = 352; the peak is level 0's
    (b,) = plan_buckets([expert("g")], bucket_bytes=1 << 20)
    assert reserve_bytes(b) == 552
    (two,) = plan_buckets([expert("g"), expert("d")], bucket_bytes=1 << 20)
    assert reserve_bytes(two) == 2 * 552
    # HSDP [5, 3] f32 (60 B): only dp_shard is gathered: 3 rows (36 B + 16) x 3 + 60
    (h,) = plan_buckets([hsdp("w")], bucket_bytes=1 << 20)
    assert reserve_bytes(h) == (36 + 16) * 3 + 60
    # the inner level is the peak when the outer mesh dim is small: (1, 4) mesh, Shard(0) on
    # the size-1 dim sends 168 B (+16) x 2 + 168; the inner [3, 2, 4] = 48 B (+16) x 5 + 168
    mesh14 = MeshDesc(ranks=(0, 1, 2, 3), shape=(1, 4))
    (inner,) = plan_buckets([ParamMeta(name="g", shape=(3, 7, 4), dtype="bfloat16",
                                       mesh=mesh14, placements=EPXF)], bucket_bytes=1 << 20)
    assert reserve_bytes(inner) == max(184 * 2 + 168, 64 * 5 + 168)
    # every bucket of a plan fits, unless it holds a single parameter
    ps = [expert(f"e{i}", experts=2 + i % 3, rows=1 + 3 * i) for i in range(10)]
    for bb in (600, 2000, 6000):
        for bucket in plan_buckets(ps, bucket_bytes=bb):
            assert reserve_bytes(bucket) <= bb or len(bucket.params) == 1


def test_a_shard_dim_outside_the_tensor_names_the_parameter():
    bad = meta("w", mesh=MESH22, placements=(R, S[2]))
    with pytest.raises(ValueError, match=r"parameter 'w': placement Shard\(2\) on mesh dim 1 "
                                         r"shards tensor dim 2, but its shape \(8, 4\) has 2"):
        plan_buckets([bad])


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
