"""Wire format of the ``tcp`` transport: hello, proofs, session keys, sealed frames, codecs.

Pure: no socket. A frame opens only with the key and the sequence number it was
sealed with; a tampered header or payload, a replay and a reordering fail; in the
plain mode the payload travels in clear but authenticated, in the encrypted mode
it does not appear on the wire; decompression is bounded by the declared length.
"""

from __future__ import annotations

import concurrent.futures
import os

import pytest

from weight_transfer.transport.tcp.codec import Codec, CodecError
from weight_transfer.transport.tcp.wire import (
    HEADER,
    HELLO,
    MODE_ENCRYPT,
    MODE_PLAIN,
    NO_WINDOW,
    OP_WRITE,
    SEALED_ACK_BYTES,
    SEALED_HEADER_BYTES,
    Header,
    Opener,
    Sealer,
    WireError,
    check_proof,
    identity,
    pack_hello,
    proof,
    session_keys,
    transcript,
    unpack_hello_head,
)

KEY = bytes(range(32))


def _header(seq: int, n: int = 10) -> Header:
    return Header(op=OP_WRITE, codec=0, seq=seq, addr=0x1000, rkey=7, offset=16, raw_len=n)


def test_header_round_trips_in_48_bytes():
    h = _header(3)
    assert HEADER.size == 48 and SEALED_HEADER_BYTES == 64 and SEALED_ACK_BYTES == 40
    assert Header.unpack(h.pack()) == h


@pytest.mark.parametrize("encrypt", [False, True])
def test_frames_open_in_order_with_their_key(encrypt):
    sealer, opener = Sealer(KEY, encrypt=encrypt), Opener(KEY, encrypt=encrypt)
    for seq, data in ((1, b"0123456789"), (2, b"abcdefghij")):
        prefix, sealed, body = sealer.seal_frame(_header(seq), memoryview(data))
        assert int.from_bytes(prefix, "little") == len(body) == len(data) + 16 * encrypt
        assert (bytes(body) == data) is (not encrypt)  # plain: authenticated, in clear
        header, plain = opener.open_frame(sealed, memoryview(bytes(body)))
        assert header == _header(seq) and bytes(plain) == data


@pytest.mark.parametrize("encrypt", [False, True])
@pytest.mark.parametrize("what", ["payload", "header", "key", "replay", "reorder"])
def test_a_frame_that_is_not_the_next_authentic_one_is_refused(encrypt, what):
    sealer, opener = Sealer(KEY, encrypt=encrypt), Opener(KEY, encrypt=encrypt)
    frames = [sealer.seal_frame(_header(s), memoryview(b"x" * 10)) for s in (1, 2)]
    _, sealed, body = frames[1 if what == "reorder" else 0]
    sealed, body = bytearray(sealed), bytearray(bytes(body))
    if what == "payload":
        body[3] ^= 1
    elif what == "header":
        sealed[5] ^= 1
    elif what == "key":
        opener = Opener(os.urandom(32), encrypt=encrypt)
    elif what == "replay":
        opener.open_frame(bytes(sealed), memoryview(bytes(body)))  # frame 1 once: fine
    with pytest.raises(WireError, match="authentication failed"):
        opener.open_frame(bytes(sealed), memoryview(bytes(body)))


def test_acks_are_sealed_and_ordered():
    sealer, opener = Sealer(KEY, encrypt=False), Opener(KEY, encrypt=False)
    first, second = sealer.seal_ack(1, 0), sealer.seal_ack(2, NO_WINDOW)
    assert opener.open_ack(first) == (1, 0)
    with pytest.raises(WireError):
        opener.open_ack(first)  # replayed
    assert opener.open_ack(second) == (2, NO_WINDOW)


def test_hello_parses_and_refuses_what_is_not_ours():
    wid = identity("trainer0", "nic0")
    msg = pack_hello(MODE_ENCRYPT, 2, b"n" * 32, wid)
    assert unpack_hello_head(msg[:HELLO.size]) == (MODE_ENCRYPT, 2, len(wid))
    for bad in (b"GET / HTTP/1.1\r\n"[:HELLO.size], pack_hello(7, 0, b"n" * 32, wid),
                pack_hello(MODE_PLAIN, 9, b"n" * 32, wid), b"WTT1\x02" + msg[5:]):
        with pytest.raises(WireError):
            unpack_hello_head(bad[:HELLO.size])
    with pytest.raises(ValueError, match="longer than"):
        identity("x" * 600, "nic0")


def test_proofs_are_bound_to_label_key_and_transcript():
    data = transcript(0, 0, b"c" * 32, b"s" * 32, b"w", b"t")
    other = transcript(0, 0, b"c" * 32, b"S" * 32, b"w", b"t")
    p = proof(KEY, b"client", data)
    assert check_proof(KEY, b"client", data, p)
    assert not check_proof(KEY, b"server", data, p)  # a reflected proof does not pass
    assert not check_proof(KEY, b"client", other, p)
    assert not check_proof(os.urandom(32), b"client", data, p)
    c2s, s2c = session_keys(KEY, b"c" * 32, b"s" * 32, data)
    assert c2s != s2c and (c2s, s2c) != session_keys(KEY, b"c" * 32, b"S" * 32, other)


@pytest.mark.parametrize("name", ["none", "lz4", "zstd"])
def test_codecs_round_trip_and_bound_the_output(name):
    codec = Codec(name)
    data = memoryview(b"abcd" * 4096)
    cid, payload = codec.compress(data)
    assert (cid == 0) is (name == "none") and len(payload) <= len(data)
    assert bytes(codec.decompress(cid, memoryview(bytes(payload)), len(data))) == bytes(data)
    with pytest.raises(CodecError):
        codec.decompress(cid, memoryview(bytes(payload)), len(data) - 1)
    random = memoryview(os.urandom(4096))  # incompressible: sent raw
    assert codec.compress(random)[0] == 0


def test_a_codec_other_than_the_links_is_refused():
    with pytest.raises(CodecError, match="this link uses"):
        Codec("lz4").decompress(2, memoryview(b"zz"), 2)


@pytest.mark.parametrize("name", ["lz4", "zstd"])
def test_one_codec_serves_many_threads(name):
    codec = Codec(name)
    blocks = [bytes([i]) * 8192 + os.urandom(64) for i in range(16)]

    def roundtrip(block):
        cid, payload = codec.compress(memoryview(block))
        return bytes(codec.decompress(cid, memoryview(bytes(payload)), len(block)))

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert list(pool.map(roundtrip, blocks * 4)) == blocks * 4
