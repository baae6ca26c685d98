"""A transport wrapper that records failed writes instead of aborting the rank's step.

``full_tensor()`` is a collective: if one trainer rank stopped at its first
failed WRITE, the other ranks would wait for it in their next gather until the
process-group timeout. Wrapped in a :class:`WriteGuard`, a rank whose writes
fail (peer gone, link down, region revoked) keeps gathering and joins every
barrier, and reports afterwards which replicas missed bytes, so the
controller can mark exactly those replicas torn::

    guard = WriteGuard(nic, replica_of={region: "engine0", ...})
    step = TrainerStep(..., transport=guard)
    guard.reset(); report = await step.run(version)
    guard.failures()       # [WriteFailure(replica, owner, count, nbytes, error)]
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from actors.reports import WriteFailure
from weight_transfer.transport.base import TransportError, source_buffer
from weight_transfer.types import RegionDesc

log = logging.getLogger(__name__)


class WriteGuard:
    """Forwards writes to ``inner``; a :class:`TransportError` is recorded, not raised."""

    def __init__(
        self, inner: Any, *, replica_of: Mapping[RegionDesc, str], label: str = ""
    ) -> None:
        self.inner = inner
        self.replica_of = dict(replica_of)
        self.label = label or getattr(inner, "label", "transport")
        self._failed: dict[str, list] = {}  # replica -> [owner, count, nbytes, first error]

    @property
    def device_memory(self) -> bool:
        return bool(getattr(self.inner, "device_memory", False))

    def reset(self) -> None:
        self._failed = {}

    async def write(self, src: Any, dst: RegionDesc, dst_offset: int = 0) -> None:
        try:
            await self.inner.write(src, dst, dst_offset)
        except TransportError as exc:
            replica = self.replica_of.get(dst, dst.owner)
            entry = self._failed.setdefault(
                replica, [dst.owner, 0, 0, f"{type(exc).__name__}: {exc}"]
            )
            entry[1] += 1
            entry[2] += source_buffer(src).nbytes
            if entry[1] == 1:
                log.warning("%s: write into %s failed: %s", self.label, dst.describe(), exc)

    def failures(self) -> list[WriteFailure]:
        return [
            WriteFailure(replica=replica, owner=owner, count=count, nbytes=nbytes, error=error)
            for replica, (owner, count, nbytes, error) in sorted(self._failed.items())
        ]
