"""What the barrier store's client and server say to each other, and the store's limits.

A connection starts with the ``tcp`` transport's handshake (:mod:`weight_transfer.
transport.tcp.wire`, encrypted mode) under one key derived from the setup's barrier
secret (:func:`store_key`), so only the controller and the trainer ranks, which
got the :class:`~weight_transfer.sync.barrier.BarrierKey` over Ray, get past it.
Then each request is one sealed frame (``Header.op``: the operation, the payload:
its items) and each reply one sealed frame the other way (``Header.op``: a status,
the payload: the reply's items). Items are byte strings, length-prefixed
(:func:`pack_items`).

The limits hold for every client, key holders included: a key outside the setup's
namespace (``<barrier name>/``), a key over :data:`MAX_KEY_BYTES`, a value over
:data:`MAX_VALUE_BYTES` or a store that would pass its ``max_bytes`` is refused by
name, and a message over :data:`MAX_MESSAGE_BYTES` ends the session.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct

from weight_transfer.sync.barrier import BarrierKey
from weight_transfer.transport.tcp.client import sendmsg_all
from weight_transfer.transport.tcp.server import recv_exact
from weight_transfer.transport.tcp.wire import (
    PREFIX,
    SEALED_HEADER_BYTES,
    TAG_BYTES,
    Header,
    Opener,
    Sealer,
    identity,
)

MAX_VALUE_BYTES = 512  # an arrival is a 64-byte MAC, a count a few digits
MAX_KEY_BYTES = 256
MAX_STORE_BYTES = 16 << 20  # default cap of keys + values + ENTRY_BYTES per key
ENTRY_BYTES = 64  # counted per key on top of its key and value (the dict's own cost)
MAX_MESSAGE_BYTES = 1 << 20  # one request or reply (a wait on ~16k arrival keys)

# Operations (requests) and statuses (replies), in Header.op.
SET, GET, WAIT, CHECK, ADD, COMPARE_SET, DELETE, NUM_KEYS = range(1, 9)
OK, TIMED_OUT, REFUSED = range(3)
OP_NAMES = {SET: "set", GET: "get", WAIT: "wait", CHECK: "check", ADD: "add",
            COMPARE_SET: "compare_set", DELETE: "delete_key", NUM_KEYS: "num_keys"}

_COUNT = struct.Struct("<I")


def store_key(key: BarrierKey) -> bytes:
    """The store's link key: derived from the barrier secret, so it travels nowhere new."""
    msg = f"wt barrier store\0{key.setup_id}\0{key.name}".encode()
    return hmac.new(key.secret, msg, hashlib.sha256).digest()


def store_identity(key: BarrierKey) -> bytes:
    """The store's name in the handshake."""
    return identity("wt-barrier-store", key.name)


def namespace(key: BarrierKey) -> str:
    """The prefix of every key the store holds for this setup."""
    return f"{key.name}/"


def pack_items(items: list[bytes]) -> bytes:
    return b"".join([_COUNT.pack(len(items)),
                     *(_COUNT.pack(len(i)) + bytes(i) for i in items)])


def unpack_items(data: bytes | memoryview) -> list[bytes]:
    """The items of a payload; ValueError if it is not exactly a packed list."""
    view = memoryview(data)
    if len(view) < _COUNT.size:
        raise ValueError(f"a store message of {len(view)} B has no item count")
    (count,), at, out = _COUNT.unpack_from(view), _COUNT.size, []
    for _ in range(count):
        if at + _COUNT.size > len(view):
            raise ValueError(f"a store message ends inside item {len(out)} of {count}")
        (n,) = _COUNT.unpack_from(view, at)
        at += _COUNT.size
        if at + n > len(view):
            raise ValueError(f"item {len(out)} of a store message claims {n} B past its end")
        out.append(bytes(view[at:at + n]))
        at += n
    if at != len(view):
        raise ValueError(f"a store message has {len(view) - at} B after its {count} items")
    return out


def send_message(sock: socket.socket, sealer: Sealer, op: int, items: list[bytes]) -> None:
    """One request (``op``: an operation) or reply (``op``: a status), sealed."""
    payload = pack_items(items)
    header = Header(op=op, codec=0, seq=sealer.seq + 1, addr=0, rkey=0, offset=0,
                    raw_len=len(payload))
    sendmsg_all(sock, list(sealer.seal_frame(header, memoryview(payload))))


def recv_message(sock: socket.socket, opener: Opener) -> tuple[int, list[bytes]]:
    """``(op, items)`` of the next message, once authenticated; ValueError if it claims
    more than :data:`MAX_MESSAGE_BYTES` (nothing more is read) or is malformed,
    WireError if it is not authentic, ConnectionError at the end of the connection."""
    (n,) = PREFIX.unpack(recv_exact(sock, PREFIX.size))
    if n > MAX_MESSAGE_BYTES + TAG_BYTES:
        raise ValueError(f"a message of {n} B (at most {MAX_MESSAGE_BYTES} B)")
    sealed = recv_exact(sock, SEALED_HEADER_BYTES)
    body = bytearray(recv_exact(sock, n))
    header, plain = opener.open_frame(sealed, memoryview(body))
    if header.raw_len != len(plain):
        raise ValueError(f"a message of {len(plain)} B says {header.raw_len} B")
    return header.op, unpack_items(plain)
