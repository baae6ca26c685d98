"""What weight transfer needs from an inference engine: its tensors, and a pause point.

The engine itself is not modified. An :class:`EngineAdapter` exposes the memory
regions that hold the engine's weights (one buffer with its tensors' names,
shapes, dtypes and byte offsets, registered with a NIC once at setup) and
pause/resume hooks, which the controller uses to keep generation from reading a
half-written version::

    for buf, tensors in adapter.region_buffers():
        desc = nic.register(buf)              # tensors: [(name, shape, dtype, offset)]
    adapter.pause()      # generation finishes its current step, then waits
    adapter.wait_idle()  # no step runs now: safe to write
    ...                  # remote WRITEs land in the engine's buffer
    adapter.resume()     # generation continues with the new weights

``weight_transfer.engines.reference.adapter.ReferenceEngineAdapter`` implements it for the
reference engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

TensorEntry = tuple[str, tuple[int, ...], str, int]


@runtime_checkable
class EngineAdapter(Protocol):
    """The engine-side interface of weight transfer."""

    @property
    def paused(self) -> bool: ...

    def region_buffers(self) -> list[tuple[torch.Tensor, Sequence[TensorEntry]]]:
        """``[(uint8 buffer, [(name, shape, dtype, byte offset), ...]), ...]``."""
        ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def wait_idle(self, timeout: float | None = None) -> bool:
        """After :meth:`pause`: True once no generation step runs, False after ``timeout``."""
        ...
