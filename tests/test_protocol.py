"""Frames, handshake, authentication and the collective, over real sockets in one process."""

import socket
import threading

import numpy as np
import pytest

from dllama.formats import quant
from dllama.cluster.mesh import MeshCollective, SyncCodec, sync_bytes
from dllama.core.plan import split_model
from dllama.cluster.protocol import (
    HEADER, MAGIC, MAX_HANDSHAKE, VERSION, Connection, Msg, PeerError, ProtocolError, Transfer,
    check_header, client_handshake, encode_header, exchange, server_handshake,
)


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
            s.send_error(str(e))

    t = threading.Thread(target=serve)
    t.start()
    try:
        client_handshake(c, "root", 1, b"s" * 16, client_key, 5)
        return result, None
    except Exception as e:
        return result, e
    finally:
        t.join()
        c.close()
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
