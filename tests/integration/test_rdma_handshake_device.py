"""The two-way connection set-up on a real RDMA device: 2 writer NICs x 3 target NICs.

The NICs are built the way the actors build them (``TransportSpec.open``, the
registry) and connected with the functions the actors and the controller call
(:mod:`weight_transfer.transport.handshake`): one RC QP per pair and side; then
every writer writes into every target region and the bytes land exactly.
Needs an RDMA device (the ``rdma`` marker skips with the reason without one;
``WT_RDMA_DEVICE`` and ``WT_RDMA_GID_INDEX`` choose it, RoCE needs a GID with an
address). The in-process verbs model runs the same path in
``tests/unit/test_handshake.py``.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from weight_transfer.transport.handshake import (
    Endpoint,
    Link,
    answer_requests,
    connect_peers,
    requests_by_owner,
    route_answers,
)
from weight_transfer.transport.options import parse_transport

pytestmark = pytest.mark.rdma  # skipped by tests/conftest.py without pyverbs or a device

OPTIONS = {"device": os.environ.get("WT_RDMA_DEVICE") or None,
           "gid_index": int(os.environ.get("WT_RDMA_GID_INDEX", "0"))}


def test_every_pair_connects_both_ways_and_bytes_land():
    spec = parse_transport("rdma", OPTIONS, where="WT_RDMA_*")
    writers = {f"trainer{r}": spec.open(owner=f"trainer{r}", nic="w") for r in range(2)}
    targets = {f"engine0/tp{r}": spec.open(owner=f"engine0/tp{r}", nic="t") for r in range(3)}
    nics = {**writers, **targets}
    try:
        buffers = {o: np.zeros(1 << 20, dtype=np.uint8) for o in targets}
        regions = {o: nics[o].register(buffers[o]) for o in targets}
        links = [Link(writer=Endpoint(owner=w, nic="w"), target=Endpoint(owner=t, nic="t"))
                 for w in writers for t in targets]
        requests = requests_by_owner(links)
        answers = {o: answer_requests({nics[o].nic: nics[o]}, reqs, owner=o)
                   for o, reqs in requests.items()}
        for owner, conns in route_answers(requests, answers).items():
            assert connect_peers({nics[owner].nic: nics[owner]}, conns, owner=owner) == \
                (3 if owner in writers else 2)
        half = (1 << 20) // 2
        want = {o: np.random.default_rng(i).integers(0, 256, 1 << 20, dtype=np.uint8)
                for i, o in enumerate(targets)}

        async def run():
            await asyncio.gather(*(
                writers[w].write(want[t][k * half:(k + 1) * half], regions[t], k * half)
                for k, w in enumerate(writers) for t in targets))

        asyncio.run(run())
        for o in targets:
            assert np.array_equal(buffers[o], want[o]), o
    finally:
        for nic in nics.values():
            nic.close()
