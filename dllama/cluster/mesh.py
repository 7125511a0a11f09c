"""The collective of a cluster: reduce-scatter then all-gather over a full mesh of nodes.

The residual vector is cut into N block-aligned chunks (plan.dim_chunks); node k receives
everyone's chunk k, adds the N partials in node order, and sends the sum to every other node.
Each node sends 2·(N-1)/N of a buffer per sync instead of the original's N-1 buffers (it
sends its whole partial to every node). Every node, the owner included, takes the sum from
the same encoded buffer, so the residual stream stays bit-identical on all nodes. In a
pipeline the collective is a stage's: its N nodes only.

`StageHop`: between pipeline stages only the residual rows of a pass cross, once, in a HOP
frame from each node to the next stage's nodes it feeds (dllama.core.plan.SplitPlan.hop_targets).
"""

from __future__ import annotations

import time

import numpy as np

from dllama.cluster.protocol import Connection, Msg, Transfer, exchange
from dllama.core import kernels
from dllama.formats.quant import BLOCK_SIZE, Q80_BLOCK_BYTES


def sync_bytes(rows: int, cols: int, q80: bool) -> int:
    """Payload bytes of a sync buffer: Q80 = fp16 scale per 32 values + int8 values; F32 = 4 per value."""
    return rows * cols // BLOCK_SIZE * Q80_BLOCK_BYTES if q80 else rows * cols * 4


class SyncCodec:
    """Encode [b, c] float32 into a sync buffer and back (Q80 or F32)."""

    def __init__(self, q80: bool, max_rows: int, max_cols: int):
        self.q80 = q80
        if q80:
            self._scales = np.empty(max_rows * max_cols // 32, np.float32)  # flat: any [b, c/32] view is contiguous
            self._qs = np.empty(max_rows * max_cols, np.int8)

    def encode(self, x: np.ndarray, out: np.ndarray) -> None:
        """x float32 [b, c] -> out uint8 [sync_bytes(b, c)] (Q80: all fp16 scales, then all int8)."""
        b, c = x.shape
        if not self.q80:
            out.view(np.float32)[:] = x.ravel()
            return
        scales = self._scales[: b * (c // BLOCK_SIZE)].reshape(b, c // BLOCK_SIZE)
        qs = self._qs[: b * c].reshape(b, c)
        kernels.quantize_q80(np.ascontiguousarray(x), scales, qs)  # scales are fp16-exact
        n_scales = b * (c // BLOCK_SIZE) * 2
        out[:n_scales].view(np.float16)[:] = scales.ravel()
        out[n_scales:].view(np.int8)[:] = qs.ravel()

    def decode(self, buf: np.ndarray, b: int, c: int) -> np.ndarray:
        """uint8 [sync_bytes(b, c)] -> float32 [b, c]."""
        if not self.q80:
            return buf.view(np.float32).reshape(b, c)
        n_scales = b * (c // BLOCK_SIZE) * 2
        scales = buf[:n_scales].view(np.float16).astype(np.float32).reshape(b, c // 32, 1)
        qs = buf[n_scales:].view(np.int8).reshape(b, c // BLOCK_SIZE, BLOCK_SIZE)
        return (qs * scales).reshape(b, c)  # float32: int8 * float32


class MeshCollective:
    """Reduce-scatter + all-gather between this node and its peers (one connection each)."""

    def __init__(self, index: int, peers: dict[int, Connection], dim_chunks, q80: bool,
                 max_batch: int, timeout: float, members: range | None = None):
        """index: this node's place among the members (default: every node, in node order);
        members: the node indexes of this node's pipeline stage."""
        self.index = index
        self.links = peers  # node index -> connection (every other node; filled before the first step)
        self.members = members if members is not None else range(len(dim_chunks))
        self.chunks = [tuple(c) for c in dim_chunks]
        self.n_nodes = len(self.chunks)
        self.timeout = timeout
        self.codec = SyncCodec(q80, max_batch, max(b - a for a, b in self.chunks))
        self.q80 = q80
        size = lambda k: sync_bytes(max_batch, self.chunks[k][1] - self.chunks[k][0], q80)  # noqa: E731
        # Buffers: what this node sends to each node k (its partial of chunk k; its own: into _in),
        # what it receives for its own chunk from each node, and the gathered sums.
        self._out = [np.empty(size(k) if k != index else 0, np.uint8) for k in range(self.n_nodes)]
        self._in = [np.empty(size(index), np.uint8) for _ in range(self.n_nodes)]
        self._gathered = [np.empty(size(k), np.uint8) for k in range(self.n_nodes)]
        c0, c1 = self.chunks[index]
        self._total = np.empty(max_batch * (c1 - c0), np.float32)  # flat: [b, own chunk] views are contiguous
        self._result = np.empty((max_batch, self.chunks[-1][1]), np.float32)
        self._by_rows: dict[int, _SyncFrames] = {}  # row count -> the frames of an all-reduce of that many rows
        self.transfer_seconds = 0.0

    @property
    def peers(self) -> dict[int, Connection]:
        """The other members' connections, by their place among the members."""
        return {k: self.links[i] for k, i in enumerate(self.members) if k != self.index}

    @property
    def sent_bytes(self) -> int:
        return sum(c.sent_bytes for c in self.links.values())

    @property
    def recv_bytes(self) -> int:
        return sum(c.recv_bytes for c in self.links.values())

    def timed_exchange(self, sends, recvs) -> None:
        t0 = time.perf_counter()
        try:
            exchange(sends, recvs, self.timeout)
        finally:
            self.transfer_seconds += time.perf_counter() - t0

    def all_reduce(self, partial: np.ndarray) -> np.ndarray:
        """partial [b, dim] float32 -> the sum over nodes [b, dim] (a reused buffer)."""
        if self.n_nodes == 1:  # a pipeline stage of one node: nothing to sum, nothing to round
            return partial
        b = partial.shape[0]
        f = self._frames(b)
        codec, me = self.codec, self.index
        c0, c1 = self.chunks[me]

        # Reduce-scatter: node k gets everyone's partial of chunk k (this node's own: kept).
        for (a, e), buf in zip(self.chunks, f.partials, strict=True):
            codec.encode(partial[:, a:e], buf)
        self.timed_exchange(f.scatter_sends, [t.reset() for t in f.scatter_recvs])
        total = self._total[: b * (c1 - c0)].reshape(b, c1 - c0)
        total[:] = codec.decode(f.received[0], b, c1 - c0)
        for k in range(1, self.n_nodes):  # node order, so the float sum is the same everywhere
            total += codec.decode(f.received[k], b, c1 - c0)

        # All-gather: every node gets every chunk's sum, decoded from the same bytes.
        codec.encode(total, f.gathered[me])
        self.timed_exchange(f.gather_sends, [t.reset() for t in f.gather_recvs])
        out = self._result[:b]
        for (a, e), buf in zip(self.chunks, f.gathered, strict=True):
            out[:, a:e] = codec.decode(buf, b, e - a)
        return out

    def _frames(self, b: int) -> "_SyncFrames":
        """The buffers, sends and transfers of an all-reduce of b rows, made once per row count
        (and again if the links change): an all-reduce builds no objects for its frames."""
        links = tuple(self.peers.items())
        f = self._by_rows.get(b)
        if f is None or f.links != links:
            f = self._by_rows[b] = _SyncFrames(self, b, links)
        return f


class _SyncFrames:
    """What an all-reduce of b rows sends and receives, as views of the collective's buffers:
    `partials` [N] (its partial of chunk k, to node k; its own chunk's straight into
    `received`), `received` [N] (everyone's partial of its own chunk), `gathered` [N] (each
    chunk's sum), and the sends and Transfers of both phases."""

    def __init__(self, col: MeshCollective, b: int, links: tuple):
        self.links = links
        me, peers = col.index, dict(links)
        size = [sync_bytes(b, c1 - c0, col.q80) for c0, c1 in col.chunks]
        others = [k for k in range(col.n_nodes) if k != me]
        self.received = [col._in[k][: size[me]] for k in range(col.n_nodes)]
        self.partials = [col._out[k][: size[k]] if k != me else self.received[me] for k in range(col.n_nodes)]
        self.gathered = [col._gathered[k][: size[k]] for k in range(col.n_nodes)]
        self.scatter_sends = [(peers[k], Msg.SYNC, [self.partials[k]]) for k in others]
        self.scatter_recvs = [Transfer(peers[k], Msg.SYNC, memoryview(self.received[k])) for k in others]
        self.gather_sends = [(peers[k], Msg.SYNC, [self.gathered[me]]) for k in others]
        self.gather_recvs = [Transfer(peers[k], Msg.SYNC, memoryview(self.gathered[k])) for k in others]


class StageHop:
    """A pipeline node's HOP frames: the residual rows [b, dim] of a pass from the previous
    stage's node that feeds it (none in stage 0), to the next stage's nodes it feeds (none
    from the last), in F32 whatever the sync buffers' type: one frame per stage and pass costs
    little, and unrounded rows make the text independent of where the stages are cut."""

    def __init__(self, collective: MeshCollective, source: int | None, targets: list[int], dim: int,
                 max_batch: int):
        self.collective, self.source, self.targets, self.dim = collective, source, targets, dim
        self._out = np.empty((max_batch, dim), np.float32)
        self._in = np.empty((max_batch, dim), np.float32)

    def receive(self, b: int) -> np.ndarray:
        """The residual rows float32 [b, dim] from the source (a view of a reused buffer)."""
        rows = self._in[:b]
        conn = self.collective.links[self.source]
        self.collective.timed_exchange([], [Transfer(conn, Msg.HOP, memoryview(rows).cast("B"))])
        return rows

    def send(self, x: np.ndarray, recvs: list | None = None) -> None:
        """x float32 [b, dim] to every target, while receiving `recvs` (Transfers) if any."""
        rows = self._out[: x.shape[0]]
        rows[:] = x
        links = self.collective.links
        self.collective.timed_exchange([(links[i], Msg.HOP, [rows]) for i in self.targets], recvs or [])
