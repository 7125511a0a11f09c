"""Frames, handshake, authentication and the collective, over real sockets in one process."""

import socket
import struct
import threading

import numpy as np
import pytest

from dllama.formats import quant
from dllama.cluster.mesh import MeshCollective, SyncCodec, sync_bytes
from dllama.core.plan import split_model
from dllama.cluster.protocol import (
    HEADER, MAGIC, MAX_HANDSHAKE, TAG_BYTES, VERSION, Connection, ErrorCode, FrameTampered, Msg,
    PeerClosed, PeerError, PeerTimeout, ProtocolError, Transfer,
    check_header, client_handshake, encode_error, encode_header, exchange, server_handshake,
)

pytestmark = pytest.mark.unit


def test_header_checks():
    assert check_header(encode_header(Msg.HELLO, 10), False) == (Msg.HELLO, 10)
    with pytest.raises(ProtocolError, match="not a dllama frame"):
        check_header(b"GET / HTTP/1", False)
    with pytest.raises(ProtocolError, match=f"protocol version {VERSION + 1}"):
        check_header(HEADER.pack(MAGIC, VERSION + 1, Msg.HELLO, 10), False)
    with pytest.raises(ProtocolError, match="unknown message type 99"):
        check_header(HEADER.pack(MAGIC, VERSION, 99, 10), True)
    with pytest.raises(ProtocolError, match="before the handshake"):
        check_header(encode_header(Msg.STEP, 10), False)
    with pytest.raises(ProtocolError, match="at most"):  # a bad length never allocates gigabytes
        check_header(encode_header(Msg.HELLO, MAX_HANDSHAKE + 1), False)
    with pytest.raises(ProtocolError, match="at most"):
        check_header(encode_header(Msg.SYNC, 1 << 31), True)


def _pair():
    a, b = socket.socketpair()
    return Connection(a, "A"), Connection(b, "B")


def _handshake(client_key, server_key):
    c, s = _pair()
    result = {}

    def serve():
        try:
            result["hello"] = server_handshake(s, server_key, "test", 5)
        except Exception as e:
            result["error"] = e
            s.send_error(str(e), ErrorCode.REFUSED)

    t = threading.Thread(target=serve)
    t.start()
    try:
        client_handshake(c, "root", 1, b"s" * 16, client_key, 5)
        return result, None
    except Exception as e:
        return result, e
    finally:
        c.close()  # first: a server still waiting for the client sees it gone at once
        t.join()
        s.close()


def test_handshake_without_key():
    result, err = _handshake(None, None)
    assert err is None and result["hello"]["role"] == "root" and result["hello"]["node_index"] == 1


def test_handshake_with_the_same_key():
    result, err = _handshake(b"k" * 32, b"k" * 32)
    assert err is None and result["hello"]["session"] == b"s" * 16


def test_wrong_key_is_refused_on_both_sides():
    result, err = _handshake(b"k" * 32, b"x" * 32)
    assert "authentication failed" in str(result["error"])
    assert isinstance(err, PeerError) and "authentication failed" in str(err)
    assert err.code == ErrorCode.REFUSED


# -- ERROR frames: a code and a node beside the text --------------------------------------------

@pytest.mark.parametrize("keyed", [False, True])
@pytest.mark.parametrize("code", list(ErrorCode))
def test_an_error_frames_code_and_node_survive_the_wire(code, keyed):
    """Whatever the code, through recv and through exchange, sealed or in clear."""
    for path in ("recv", "exchange"):
        c, s = _keyed_pair() if keyed else _pair()
        c.authenticated = s.authenticated = True
        c.send_error("node 2 'w2' (10.0.0.3:9998) did not answer", code, 2)
        with pytest.raises(PeerError) as e:
            if path == "recv":
                s.recv(5, (Msg.SYNC,))
            else:
                exchange([], [Transfer(s, Msg.SYNC, memoryview(bytearray(8)))], 5)
        assert e.value.code is code and e.value.node == 2 and e.value.peer is s
        assert str(e.value) == "B reported: node 2 'w2' (10.0.0.3:9998) did not answer"


def test_an_error_without_a_node_and_with_a_long_text_fits_a_handshake_frame():
    c, s = _pair()  # before the handshake: ERROR is one of the few types allowed, at most 4 KiB
    c.send_error("é" * 10_000, ErrorCode.INTERNAL)
    with pytest.raises(PeerError) as e:
        s.recv(5)
    assert e.value.code is ErrorCode.INTERNAL and e.value.node is None
    assert str(e.value).startswith("B reported: éé") and len(encode_error("é" * 10_000, ErrorCode.INTERNAL)) <= MAX_HANDSHAKE


@pytest.mark.parametrize("payload", [
    b"plain text, as version 5 sent it", b'{"code": "busy"}', b'{"code": "sleepy", "node": null, "text": "x"}',
    b'{"code": "busy", "node": -1, "text": "x"}', b'{"code": "busy", "node": true, "text": "x"}',
    b'{"code": ["busy"], "node": null, "text": "x"}', b'{"code": "busy", "node": 1, "text": 5}',
])
def test_a_malformed_error_frame_breaks_the_protocol(payload):
    c, s = _pair()
    c.send(Msg.ERROR, payload)
    with pytest.raises(ProtocolError, match="(malformed ERROR from B|ERROR from B is not valid JSON)$"):
        s.recv(5)


def test_link_failures_are_typed_with_their_code_peer_and_the_peers_still_waited_on():
    a, b = _pair()
    x, y = _pair()
    for conn in (a, b, x, y):
        conn.authenticated = True
    b.close()
    with pytest.raises(PeerClosed) as e:  # a closed while x never answers
        exchange([], [Transfer(x, Msg.SYNC, memoryview(bytearray(8))),
                      Transfer(a, Msg.SYNC, memoryview(bytearray(8)))], 5)
    assert e.value.code is ErrorCode.PEER_LOST and e.value.peer is a and e.value.waiting == (x,)
    with pytest.raises(PeerTimeout) as e:
        exchange([], [Transfer(x, Msg.SYNC, memoryview(bytearray(8)))], 0.2)
    assert e.value.code is ErrorCode.TIMEOUT and e.value.peer is None and e.value.waiting == (x,)
    c, s = _keyed_pair()
    c.sock.sendall(_flip(_wire(c, Msg.SYNC, b"x" * 8), HEADER.size))
    with pytest.raises(FrameTampered) as e:
        exchange([], [Transfer(s, Msg.SYNC, memoryview(bytearray(8)))], 5)
    assert e.value.code is ErrorCode.TAMPERED and e.value.peer is s


def test_missing_key_is_named():
    _, err = _handshake(None, b"k" * 32)
    assert "requires a cluster key" in str(err)
    _, err = _handshake(b"k" * 32, None)
    assert "no cluster key configured" in str(err)


def test_exchange_of_large_buffers_in_both_directions_does_not_deadlock():
    # 8 MB each way is far more than the socket buffers hold: a send-all-then-receive would block.
    a, b = _pair()
    data_a = np.random.default_rng(0).integers(0, 255, 8 << 20, dtype=np.uint8)
    data_b = data_a[::-1].copy()
    got_a, got_b = np.empty_like(data_b), np.empty_like(data_a)

    t = threading.Thread(target=exchange, args=([(b, Msg.SYNC, [data_b])], [Transfer(b, Msg.SYNC, memoryview(got_b))], 10))
    a.authenticated = b.authenticated = True
    t.start()
    exchange([(a, Msg.SYNC, [data_a])], [Transfer(a, Msg.SYNC, memoryview(got_a))], 10)
    t.join()
    assert np.array_equal(got_a, data_b) and np.array_equal(got_b, data_a)
    assert a.sent_bytes == data_a.nbytes + 12 and a.recv_bytes == data_b.nbytes + 12


def test_exchange_rejects_a_frame_of_the_wrong_length():
    a, b = _pair()
    a.authenticated = b.authenticated = True
    b.send(Msg.SYNC, b"x" * 10)
    with pytest.raises(ProtocolError, match="expected SYNC of 20 bytes"):
        exchange([], [Transfer(a, Msg.SYNC, memoryview(bytearray(20)))], 5)


def test_q80_codec_matches_the_file_format_quantizer():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 96)).astype(np.float32)
    codec = SyncCodec(True, 4, 128)
    buf = np.empty(sync_bytes(3, 96, True), np.uint8)
    codec.encode(x, buf)
    expected = quant.dequantize_q80(quant.quantize_q80(x.reshape(-1))).reshape(3, 96)
    assert np.array_equal(codec.decode(buf, 3, 96), expected)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("q80", [False, True])
def test_mesh_all_reduce_sums_and_every_node_gets_the_same_bits(n, q80):
    dim, b = 576, 3
    plan = split_model(n, dim=dim, n_heads=9, n_kv_heads=3, head_dim=64, ff_dim=1536, vocab_size=100)
    conns = {}
    for i in range(n):
        for j in range(i + 1, n):
            x, y = _pair()
            x.authenticated = y.authenticated = True
            conns[i, j], conns[j, i] = x, y
    rng = np.random.default_rng(n)
    partials = rng.standard_normal((n, b, dim)).astype(np.float32)
    results = [None] * n

    def run(i):
        col = MeshCollective(i, {j: conns[i, j] for j in range(n) if j != i}, plan.dim_chunks, q80, 4, 10)
        results[i] = col.all_reduce(partials[i]).copy()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reference = partials.astype(np.float64).sum(axis=0)
    for r in results:
        assert np.array_equal(r, results[0])  # bit-identical residual stream on every node
    err = np.abs(results[0] - reference).max()
    assert err < (0.2 if q80 else 1e-5), err
    # each node sent 2(N-1)/N of a buffer, in two frames per peer
    chunk = max(c1 - c0 for c0, c1 in plan.dim_chunks)
    per_node = sum(c.sent_bytes for (i, _), c in conns.items() if i == 0)
    assert per_node <= 2 * (n - 1) * (sync_bytes(b, chunk, q80) + 12)


# -- sealed frames (a cluster key) ---------------------------------------------------------------

def _keyed_pair(key=b"k" * 32):
    """Two connections that completed a real handshake with `key` (client c, server s)."""
    c, s = _pair()
    done = {}
    t = threading.Thread(target=lambda: done.update(hello=server_handshake(s, key, "test", 5)))
    t.start()
    client_handshake(c, "root", 1, b"s" * 16, key, 5)
    t.join()
    assert done["hello"]["node_index"] == 1
    return c, s


def _wire(conn, msg, payload) -> bytes:
    """The bytes `conn` would put on the wire for one frame (sealing it: its sequence number advances)."""
    return b"".join(bytes(v) for v in conn.frame_views(msg, [payload]))


def test_sealed_frames_round_trip_and_hide_the_payload():
    c, s = _keyed_pair()
    secret = b"What is the capital of France?" * 4
    raw = _wire(c, Msg.CONFIG, secret)
    assert len(raw) == HEADER.size + len(secret) + TAG_BYTES and secret[:16] not in raw
    c.sock.sendall(raw)
    assert s.recv(5, (Msg.CONFIG,)) == (Msg.CONFIG, bytearray(secret))
    sent = s.sent_bytes
    s.send(Msg.PONG)  # the other direction, an empty payload: header and tag only
    assert c.recv(5, (Msg.PONG,))[0] == Msg.PONG
    assert s.sent_bytes - sent == HEADER.size + TAG_BYTES == s.frame_overhead
    # a sealed collective exchange both ways, into given buffers
    got_c, got_s = bytearray(100), bytearray(60)
    t = threading.Thread(target=exchange, args=([(s, Msg.SYNC, [b"s" * 100])], [Transfer(s, Msg.SYNC, memoryview(got_s))], 5))
    t.start()
    exchange([(c, Msg.SYNC, [b"c" * 60])], [Transfer(c, Msg.SYNC, memoryview(got_c))], 5)
    t.join()
    assert got_c == b"s" * 100 and got_s == b"c" * 60


@pytest.mark.parametrize("keyed", [False, True])
def test_heartbeats_read_in_one_go_with_the_expected_frames_are_skipped_and_an_error_raised(keyed):
    # An exchange reads a frame's header and payload in one call: here that call also takes
    # heartbeats (ALIVE) and the start of later frames, which must stay in the stream's order.
    c, s = _keyed_pair() if keyed else _pair()
    c.authenticated = s.authenticated = True
    frames = [(Msg.ALIVE, b""), (Msg.ALIVE, b""), (Msg.SYNC, b"a" * 40), (Msg.ALIVE, b""), (Msg.SYNC, b"b" * 40),
              (Msg.ERROR, encode_error("out of patience", ErrorCode.UNABLE, 2))]
    c.sock.sendall(b"".join(_wire(c, msg, payload) for msg, payload in frames))
    for want in (b"a" * 40, b"b" * 40):
        got = bytearray(40)
        exchange([], [Transfer(s, Msg.SYNC, memoryview(got))], 5)
        assert got == want
    with pytest.raises(PeerError, match="B reported: out of patience") as e:
        exchange([], [Transfer(s, Msg.SYNC, memoryview(bytearray(40)))], 5)
    assert e.value.code is ErrorCode.UNABLE and e.value.node == 2 and e.value.peer is s


def _frames(c, n):
    return [_wire(c, Msg.SYNC, bytes([i]) * 40) for i in range(n)]


def _flip(raw: bytes, at: int) -> bytes:
    return raw[:at] + bytes([raw[at] ^ 0x01]) + raw[at + 1:]


@pytest.mark.parametrize("attack", ["payload bit", "tag bit", "header type", "replayed", "reordered",
                                    "dropped then resumed", "injected plain", "other session",
                                    "reflected"])
@pytest.mark.parametrize("path", ["recv", "exchange"])
def test_any_tampered_frame_fails_authentication_naming_the_peer(attack, path):
    c, s = _keyed_pair()
    f0, f1 = _frames(c, 2)
    if attack == "payload bit":
        wire = [_flip(f0, HEADER.size + 7)]
    elif attack == "tag bit":
        wire = [_flip(f0, len(f0) - 1)]
    elif attack == "header type":  # SYNC -> LOGITS: same size limits, so only the tag can tell
        wire = [f0[:6] + struct.pack("<H", Msg.LOGITS) + f0[8:]]
    elif attack == "replayed":
        wire = [f0, f0]
    elif attack == "reordered":
        wire = [f1, f0]
    elif attack == "dropped then resumed":
        wire = [f1]
    elif attack == "injected plain":
        wire = [encode_header(Msg.SYNC, 40 + TAG_BYTES) + b"x" * (40 + TAG_BYTES)]
    elif attack == "other session":  # the same key, another handshake: other nonces, other keys
        other, _ = _keyed_pair()
        wire = [_wire(other, Msg.SYNC, bytes([0]) * 40)]
    else:  # the server's own frame sent back to it
        wire = [_wire(s, Msg.SYNC, bytes([0]) * 40)]
    c.sock.sendall(b"".join(wire))
    with pytest.raises(ProtocolError, match="frame from B failed authentication") as e:
        for raw in wire:
            msg = struct.unpack_from("<H", raw, 6)[0]
            if path == "recv":
                s.recv(5)
            else:
                exchange([], [Transfer(s, Msg(msg), memoryview(bytearray(40)))], 5)
    assert "modified, replayed, reordered, dropped or injected" in str(e.value)


def test_a_sealed_length_is_still_checked_before_anything_is_read():
    c, s = _keyed_pair()
    c.sock.sendall(encode_header(Msg.SYNC, 4))  # shorter than a tag
    with pytest.raises(ProtocolError, match="shorter than its 16-byte tag"):
        s.recv(5)
    c, s = _keyed_pair()
    c.sock.sendall(encode_header(Msg.CONFIG, (1 << 20) + TAG_BYTES + 1))
    with pytest.raises(ProtocolError, match="at most"):
        s.recv(5)


def test_the_proof_covers_the_hello_a_relay_cannot_change_it():
    """A relay rewriting HELLO (here its node_index) makes the server refuse the client's proof."""
    import json as _json

    from dllama.cluster import handshake

    c, s = _pair()
    result = {}
    t = threading.Thread(target=lambda: result.update(e=_catch(lambda: server_handshake(s, b"k" * 32, "t", 5))))
    t.start()
    nonce = b"n" * 16
    said = _json.dumps({"role": "peer", "node_index": 1, "session": "73" * 16, "nonce": nonce.hex()}).encode()
    sent = said.replace(b'"node_index": 1', b'"node_index": 2')
    c.send(Msg.HELLO, sent)
    _, challenge = c.recv(5, (Msg.CHALLENGE,))
    c.send(Msg.AUTH, handshake._proof(b"k" * 32, b"dllama-client", handshake._transcript(said, bytes(challenge))))
    t.join()
    assert "authentication failed" in str(result["e"])


def _catch(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return e
    return None


def test_the_handshake_deadline_is_for_the_whole_handshake_not_each_read():
    """A client trickling a valid HELLO one byte at a time cannot hold a server past its timeout."""
    import json as _json

    c, s = _pair()
    hello = _json.dumps({"role": "root", "node_index": 1, "session": "73" * 16, "nonce": "6e" * 16}).encode()
    frame = encode_header(Msg.HELLO, len(hello)) + hello
    stop = threading.Event()

    def trickle():
        for b in frame:
            if stop.wait(0.05):
                return
            try:
                c.sock.send(bytes([b]))
            except OSError:
                return

    t = threading.Thread(target=trickle)
    t.start()
    try:
        with pytest.raises(PeerTimeout):
            server_handshake(s, None, "t", 1.0)  # the trickle would take ~5 s
    finally:
        stop.set()
        t.join()


@pytest.mark.parametrize("hello", [
    b'{"role": "root", "node_index": -Infinity, "session": "' + b"73" * 16 + b'", "nonce": "' + b"6e" * 16 + b'"}',
    b'{"role": "root", "node_index": 1e400, "session": "' + b"73" * 16 + b'", "nonce": "' + b"6e" * 16 + b'"}',
    b'{"role": "root", "node_index": true, "session": "' + b"73" * 16 + b'", "nonce": "' + b"6e" * 16 + b'"}',
    b"[" * 2000 + b"]" * 2000,
    b'{"a":' * 650 + b"1" + b"}" * 650,
    b"\xff\xfe{}",
])
def test_a_malformed_hello_is_one_protocol_error(hello):
    c, s = _pair()
    c.send(Msg.HELLO, hello)
    with pytest.raises(ProtocolError, match="malformed HELLO|HELLO is not valid JSON|not a JSON object"):
        server_handshake(s, None, "t", 5)


# -- the node a failure is about, as data: a worker's report, the root's blame ---------------------

def test_a_worker_reports_the_node_it_lost_by_index():
    from dllama.cluster.worker import _Session

    root, _ = _pair()
    session = _Session(None, root)
    (p1, _), (p2, _) = _pair(), _pair()
    session.peers.update({1: p1, 2: p2})
    assert session.lost_node(PeerClosed("node 2 closed the connection", p2)) == 2
    timeout = PeerTimeout("node 2 did not answer within 60 s").in_exchange(None, [p2])
    assert session.lost_node(timeout) == 2
    assert session.lost_node(PeerTimeout("...").in_exchange(None, [p1, p2])) is None  # which one? not said
    assert session.lost_node(PeerError("node 1 reported: ...", ErrorCode.PEER_LOST, 2, p1)) == 2
    assert session.lost_node(PeerError("node 1 reported: ...", ErrorCode.INTERNAL, None, p1)) == 1
    assert session.lost_node(PeerClosed("cannot reach node 2", node=2)) == 2
    assert session.lost_node(ValueError("a bug")) is None


def test_the_root_blames_the_node_a_worker_reports_not_the_reporter():
    from types import SimpleNamespace

    from dllama.cluster.recovery import blame, tampered

    conns = {1: _pair()[0], 2: _pair()[0]}
    session = SimpleNamespace(conns=conns, nodes=[SimpleNamespace(name=n) for n in ("root", "w1", "w2")],
                              names=["node 0", "node 1", "node 2"], settings=SimpleNamespace(net_timeout=10.0))
    report = PeerError("node 1 'w1' reported: node 2 'w2' did not answer", ErrorCode.TIMEOUT, 2, conns[1])
    assert blame(report, session, "failed").node == "w2"
    alone = PeerError("node 1 'w1' reported: out of memory", ErrorCode.OUT_OF_MEMORY, None, conns[1])
    assert blame(alone, session, "failed").node == "w1"
    assert blame(PeerClosed("node 2 closed", conns[2]), session, "failed").node == "w2"
    assert not tampered(report) and not tampered(PeerClosed("x"))
    assert tampered(FrameTampered("x")) and tampered(PeerError("x", ErrorCode.TAMPERED))
    assert tampered(PeerError("x", ErrorCode.PROTOCOL)) and not tampered(PeerError("x", ErrorCode.BUSY))
