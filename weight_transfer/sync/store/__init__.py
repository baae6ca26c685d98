"""The trainers' barrier store: ours, small, and in a process of its own.

The barrier between mesh groups (:mod:`weight_transfer.sync.barrier`) needs a
key-value store every trainer rank reaches. torch's ``TCPStore`` answers anyone
on its port and stores whatever it is sent (an outsider stored 256 MiB in the
controller in a second). This store holds only what the plan needs:

- only key holders get in: a connection proves a key derived from the setup's
  barrier secret (which only Ray carries) in the ``tcp`` transport's handshake,
  through the same event-driven gate (a flood costs no thread; at most
  ``max_pending`` unproven connections, the oldest pushed out first);
- only the setup's keys (``<barrier name>/...``), values of at most
  :data:`~.protocol.MAX_VALUE_BYTES`, at most ``max_bytes`` in all;
- it runs in a child process of its owner (:class:`~.process.BarrierStore`), so
  even a flood it cannot refuse cheaply lands there, not in the controller.

Modules: :mod:`.protocol` (limits, messages), :mod:`.server` (the server and the
child's entry point), :mod:`.client` (the Store subset the barrier uses),
:mod:`.process` (the handle that owns the child).
"""

from weight_transfer.sync.store.client import StoreClient, StoreTimeout
from weight_transfer.sync.store.process import BarrierStore
from weight_transfer.sync.store.protocol import MAX_STORE_BYTES, MAX_VALUE_BYTES

__all__ = ["MAX_STORE_BYTES", "MAX_VALUE_BYTES", "BarrierStore", "StoreClient", "StoreTimeout"]
