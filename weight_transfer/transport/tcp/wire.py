"""Wire format of the ``tcp`` transport: handshake messages, session keys, sealed frames.

The steps of one connection (writer = client, target = server), in order:

1. HELLO (client): ``MAGIC | version | mode | codec | id length | client nonce | writer
   identity``; the identity is ``owner\\0nic`` of the writing NIC.
2. CHALLENGE (server): ``server nonce | server proof``, where both proofs are
   HMAC-SHA256 under the writer's link key over the transcript (both nonces,
   both identities, the mode and the codec), with different labels; the server
   knows the key only for writers the plan named (see :mod:`.tcp`); any other
   name, or another mode or codec, gets a challenge of the same size under a
   random key and fails at step 3 like a wrong key.
3. PROOF (client): ``client proof``; the server compares in constant time and
   answers ACCEPT (one byte) or closes.
4. Session keys: HKDF-SHA256 of the link key, salted with both nonces, bound to
   the transcript: one AES-256-GCM key per direction.
5. Frames (client -> server): ``prefix (payload length) | sealed header | payload``.
   The 48-byte header (op, codec, sequence number, region address and rkey,
   offset, raw length) is AES-GCM encrypted with nonce ``(0, seq)``; in the
   plain mode the payload is its associated data (GMAC: authenticated, not
   encrypted), in the encrypted mode the payload is encrypted with nonce
   ``(1, seq)`` and the sealed header as associated data. The receiver uses the
   sequence number it expects, so a replayed, reordered or dropped frame fails
   authentication.
6. Acks (server -> client): ``sealed (ack seq, frame seq, status)`` with the
   other direction's key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

MAGIC = b"WTT1"
VERSION = 1
NONCE_BYTES = 32
PROOF_BYTES = 32
TAG_BYTES = 16
MAX_ID_BYTES = 512
ACCEPT = b"\x01"

MODE_PLAIN, MODE_ENCRYPT = 0, 1
CODECS = {"none": 0, "lz4": 1, "zstd": 2}
OP_WRITE, OP_READ = 1, 2

HELLO = struct.Struct("<4sBBBH")  # magic, version, mode, codec, identity length
PREFIX = struct.Struct("<I")  # bytes after the sealed header
HEADER = struct.Struct("<BBHIQQQQQ")  # op, codec, 0, 0, seq, addr, rkey, offset, raw length
SEALED_HEADER_BYTES = HEADER.size + TAG_BYTES
ACK = struct.Struct("<QQB7x")  # ack seq, frame seq, status
SEALED_ACK_BYTES = ACK.size + TAG_BYTES

# Status of an ack (0: written); every other is a refused write that wrote nothing.
OK, NO_WINDOW, NOT_GRANTED, OUT_OF_BOUNDS, UNKNOWN_REGION, BAD_OP, BAD_PAYLOAD = range(7)
STATUS_TEXT = {
    NO_WINDOW: "outside an update window (the engine is not paused for an update)",
    NOT_GRANTED: "into a region the plan did not give this writer",
    OUT_OF_BOUNDS: "outside the region's bounds",
    UNKNOWN_REGION: "into a region not registered there (wrong rkey or deregistered)",
    BAD_OP: "an operation other than WRITE (there is no remote read)",
    BAD_PAYLOAD: "whose payload does not decompress to its declared length",
}


class WireError(Exception):
    """A malformed or unauthenticated message (internal: the caller maps it)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Header:
    """The authenticated header of one frame."""

    op: int
    codec: int
    seq: int
    addr: int
    rkey: int
    offset: int
    raw_len: int

    def pack(self) -> bytes:
        return HEADER.pack(self.op, self.codec, 0, 0, self.seq, self.addr, self.rkey,
                           self.offset, self.raw_len)

    @classmethod
    def unpack(cls, data: bytes) -> Header:
        op, codec, _, _, seq, addr, rkey, offset, raw_len = HEADER.unpack(data)
        return cls(op=op, codec=codec, seq=seq, addr=addr, rkey=rkey, offset=offset,
                   raw_len=raw_len)


def identity(owner: str, nic: str) -> bytes:
    """The bytes that name a NIC in the handshake."""
    out = f"{owner}\0{nic}".encode()
    if len(out) > MAX_ID_BYTES:
        raise ValueError(f"NIC name {owner}/{nic} is longer than {MAX_ID_BYTES} bytes")
    return out


class KeyText(str):
    """A link key as hex text in a peer info: its repr hides it (logs, error messages)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "'<link key>'"


def new_link_key() -> bytes:
    """A fresh random link key (32 bytes) for one (writer, target) pair of one setup."""
    return os.urandom(32)


def pack_hello(mode: int, codec: int, nonce: bytes, writer_id: bytes) -> bytes:
    return HELLO.pack(MAGIC, VERSION, mode, codec, len(writer_id)) + nonce + writer_id


def unpack_hello_head(data: bytes) -> tuple[int, int, int]:
    """``(mode, codec, identity length)`` of a HELLO head; WireError if malformed."""
    magic, version, mode, codec, id_len = HELLO.unpack(data)
    if magic != MAGIC or version != VERSION:
        raise WireError(f"not a wt-tcp hello (magic {magic!r}, version {version})")
    if mode not in (MODE_PLAIN, MODE_ENCRYPT) or codec not in CODECS.values():
        raise WireError(f"unknown mode {mode} or codec {codec}")
    if not 0 < id_len <= MAX_ID_BYTES:
        raise WireError(f"identity length {id_len} outside 1..{MAX_ID_BYTES}")
    return mode, codec, id_len


def transcript(mode: int, codec: int, nonce_c: bytes, nonce_s: bytes, writer_id: bytes,
               target_id: bytes) -> bytes:
    """What both proofs and the session keys are bound to."""
    return b"|".join((MAGIC, bytes([VERSION, mode, codec]), nonce_c, nonce_s,
                      writer_id, target_id))


def proof(key: bytes, label: bytes, data: bytes) -> bytes:
    return hmac.new(key, label + data, hashlib.sha256).digest()


def check_proof(key: bytes, label: bytes, data: bytes, got: bytes) -> bool:
    return hmac.compare_digest(proof(key, label, data), got)


def session_keys(key: bytes, nonce_c: bytes, nonce_s: bytes,
                 data: bytes) -> tuple[bytes, bytes]:
    """``(client->server, server->client)`` AES-256-GCM keys of one connection."""
    okm = HKDF(algorithm=hashes.SHA256(), length=64, salt=nonce_c + nonce_s,
               info=b"wt-tcp session|" + data).derive(key)
    return okm[:32], okm[32:]


def _nonce(part: int, seq: int) -> bytes:
    return struct.pack("<IQ", part, seq)


class Sealer:
    """Seals the frames of one direction of one connection (sequence numbers from 1)."""

    def __init__(self, key: bytes, *, encrypt: bool) -> None:
        self._gcm, self.encrypt, self.seq = AESGCM(key), encrypt, 0

    def seal_frame(self, header: Header, payload: memoryview) -> tuple[bytes, bytes, object]:
        """``(prefix, sealed header, payload to send)``; ``header.seq`` must be the next."""
        assert header.seq == self.seq + 1, (header.seq, self.seq)
        self.seq = header.seq
        if self.encrypt:
            sealed = self._gcm.encrypt(_nonce(0, header.seq), header.pack(), b"")
            body: object = self._gcm.encrypt(_nonce(1, header.seq), payload, sealed)
        else:
            sealed = self._gcm.encrypt(_nonce(0, header.seq), header.pack(), payload)
            body = payload
        return PREFIX.pack(len(body)), sealed, body  # type: ignore[arg-type]

    def seal_ack(self, frame_seq: int, status: int) -> bytes:
        self.seq += 1
        return self._gcm.encrypt(_nonce(2, self.seq), ACK.pack(self.seq, frame_seq, status), b"")


class Opener:
    """Opens the frames of one direction: the next sequence number or WireError."""

    def __init__(self, key: bytes, *, encrypt: bool) -> None:
        self._gcm, self.encrypt, self.seq = AESGCM(key), encrypt, 0

    def open_frame(self, sealed: bytes, payload: memoryview) -> tuple[Header, memoryview]:
        """The header and the plain payload, once both are authenticated; nothing is
        trusted before. WireError names what failed; the sequence number is used up."""
        seq = self.seq + 1
        try:
            if self.encrypt:
                raw = self._gcm.decrypt(_nonce(0, seq), sealed, b"")
                plain = memoryview(self._gcm.decrypt(_nonce(1, seq), payload, sealed))
            else:
                raw = self._gcm.decrypt(_nonce(0, seq), sealed, payload)
                plain = payload
        except InvalidTag:
            raise WireError(f"frame {seq}: authentication failed (tampered, replayed, "
                            "reordered or sealed with another key)") from None
        header = Header.unpack(raw)
        if header.seq != seq:
            raise WireError(f"frame {seq}: header carries sequence number {header.seq}")
        self.seq = seq
        return header, plain

    def open_ack(self, sealed: bytes) -> tuple[int, int]:
        """``(frame seq, status)`` of the next ack; WireError if not authentic."""
        seq = self.seq + 1
        try:
            ack_seq, frame_seq, status = ACK.unpack(self._gcm.decrypt(_nonce(2, seq), sealed,
                                                                      b""))
        except InvalidTag:
            raise WireError(f"ack {seq}: authentication failed") from None
        if ack_seq != seq:
            raise WireError(f"ack {seq}: carries sequence number {ack_seq}")
        self.seq = seq
        return frame_seq, status
