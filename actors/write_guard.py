"""Record a rank's failed WRITEs instead of aborting its transfer.

``full_tensor()`` is a collective: if one trainer rank stopped at its first
failed WRITE, the other ranks would wait for it in their next gather until the
process-group timeout. Passed as the executor's ``on_write_error``, a
:class:`WriteGuard` keeps a rank whose writes fail (peer gone, link down,
region revoked) gathering and joining every barrier, and reports afterwards
which replicas missed bytes, so the controller can mark exactly those
replicas torn::

    guard = WriteGuard(label="trainer rank 3")
    transfer = RankTransfer(..., transport=nic, on_write_error=guard.record)
    guard.reset(); report = await transfer.run(version)
    guard.failures()       # [WriteFailure(replica, owner, count, nbytes, error)]
"""

from __future__ import annotations

import logging

from actors.reports import WriteFailure
from weight_transfer.transport.base import TransportError
from weight_transfer.types import WriteTask

log = logging.getLogger(__name__)


class WriteGuard:
    """Failed WRITEs per destination replica: count, bytes, first error."""

    def __init__(self, *, label: str = "transport") -> None:
        self.label = label
        self._failed: dict[str, list] = {}  # replica -> [owner, count, nbytes, first error]

    def reset(self) -> None:
        self._failed = {}

    def record(self, task: WriteTask, exc: TransportError) -> None:
        """The executor's ``on_write_error``: count ``task`` as not landed."""
        entry = self._failed.setdefault(
            task.dst_replica, [task.region.owner, 0, 0, f"{type(exc).__name__}: {exc}"]
        )
        entry[1] += 1
        entry[2] += task.nbytes
        if entry[1] == 1:
            log.warning("%s: write into %s failed: %s", self.label, task.region.describe(), exc)

    def failures(self) -> list[WriteFailure]:
        return [
            WriteFailure(replica=replica, owner=owner, count=count, nbytes=nbytes, error=error)
            for replica, (owner, count, nbytes, error) in sorted(self._failed.items())
        ]
