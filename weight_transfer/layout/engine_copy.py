"""Copy one engine rank's registered memory into another replica's (same layout).

A new or restarted replica fetches the current version from a peer replica:
every region of the source rank is written, whole, into the matching region
of the destination rank. The two ranks must have the same tensors at the same
offsets in regions of the same sizes (:func:`layout_key`)::

    jobs = copy_jobs(src_meta, dst_meta, nics, owner="engine0/tp0")
    for nic, (addr, length), region in jobs: await nic.write((addr, length), region, 0)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from weight_transfer.types import EngineRankMeta, RegionDesc


def regions_of(meta: EngineRankMeta) -> list[RegionDesc]:
    """The distinct regions of an engine rank, in the order its tensors first use them."""
    return list(dict.fromkeys(t.region for t in meta.tensors))


def layout_key(meta: EngineRankMeta) -> list[tuple]:
    """What two ranks must share for a byte-for-byte copy: tensors, offsets, region sizes."""
    index = {r: i for i, r in enumerate(regions_of(meta))}
    return [(t.name, t.shape, t.dtype, t.offset, index[t.region], t.region.length)
            for t in meta.tensors]


def copy_jobs(src: EngineRankMeta, dst: EngineRankMeta, nics: Mapping[str, Any], *,
              owner: str) -> list[tuple[Any, tuple[int, int], RegionDesc]]:
    """(local NIC, (address, length) of a source region, destination region) per region;
    ValueError when the layouts differ."""
    if layout_key(src) != layout_key(dst):
        raise ValueError(f"{owner} cannot fill {dst.id}: different tensor "
                         "layout (a new replica must have the TP layout of its peer)")
    return [(nics[s.nic], (s.addr, s.length), d)
            for s, d in zip(regions_of(src), regions_of(dst), strict=True)]
