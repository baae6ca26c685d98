"""level_shapes: the block a rank holds at each sharded level, as DTensor chunks it.

``torch.chunk`` per mesh dim, outermost first: ``ceil(n / m)`` rows per rank,
the last ranks fewer or none; the innermost level is the rank's local shard,
which :func:`weight_transfer.sender.gather_nd.gather_nd` checks before gathering.
"""

import pytest
import torch

from weight_transfer.sender.buckets import shard_levels
from weight_transfer.sender.gather_nd import level_shapes
from weight_transfer.types import MeshDesc, ParamMeta, Placement

S0, S1, R = Placement(kind="shard", dim=0), Placement(kind="shard", dim=1), Placement(
    kind="replicate")
MESH22 = MeshDesc(ranks=(0, 1, 2, 3), shape=(2, 2))


@pytest.mark.parametrize(("shape", "placements", "coord", "want"), [
    # stacked experts [3, 7, 4] on (ep=2, fsdp=2): experts 2 | 1, then rows 4 | 3
    ((3, 7, 4), (S0, S1), (0, 0), [(3, 7, 4), (2, 7, 4), (2, 4, 4)]),
    ((3, 7, 4), (S0, S1), (1, 1), [(3, 7, 4), (1, 7, 4), (1, 3, 4)]),
    # one expert over ep=2: the second EP rank holds none
    ((1, 1, 3), (S0, S1), (1, 0), [(1, 1, 3), (0, 1, 3), (0, 1, 3)]),
    # HSDP: the replicate dim keeps the block
    ((5, 3), (R, S0), (1, 1), [(5, 3), (2, 3)]),
    # the same tensor dim twice: chunks of chunks
    ((7, 3), (S0, S0), (0, 1), [(7, 3), (4, 3), (2, 3)]),
    ((7, 3), (S0, S0), (1, 1), [(7, 3), (3, 3), (1, 3)]),
])
def test_blocks_follow_torch_chunk(shape, placements, coord, want):
    meta = ParamMeta(name="w", shape=shape, dtype="float32", mesh=MESH22, placements=placements)
    got = level_shapes(shape, shard_levels(meta), coord)
    assert got == want
    # the same as chunking a real tensor, level by level
    block = torch.empty(shape)
    for (k, m, d), s in zip(shard_levels(meta), got[1:], strict=True):
        parts = list(torch.chunk(block, m, dim=d))
        block = parts[coord[k]] if coord[k] < len(parts) else block.narrow(d, 0, 0)
        assert tuple(block.shape) == s
