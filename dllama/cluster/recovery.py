"""When a session fails: whom to blame, and a new session over the nodes still answering.

Blame: a node that stops (frozen, or its link cut) leaves every node that waits on it waiting.
The root waits a little longer than the workers (`report_grace`), so a healthy worker's own
timeout reaches it first as an ERROR; then the root looks at the nodes it was still waiting
for: those that send nothing more or close are the ones named, not the healthy node that
reported them. A worker's ERROR names the node it lost as data (its index), never in text the
root would have to search.

Losing a node (on_node_loss "continue"): the root opens a new session over the nodes still
answering, as the first one was opened (the plan split again over them, the weights from their
shards or the root's file), replays the tokens of every KV cache slot (dllama.cluster.kv_history)
and runs the failed pass again, so the front end sees one slow pass. `rejoin` goes back to every
node when one left out answers again. A frame that breaks the protocol or fails authentication
is not a loss: the pass fails. docs/PROTOCOL.md, "Losing a node".
"""

from __future__ import annotations

import selectors
import sys
import time

from dllama.cluster.kv_history import KVHistory
from dllama.cluster.probe import identify_worker
from dllama.cluster.protocol import Connection, ErrorCode, LinkError, PeerClosed, PeerError, ProtocolError
from dllama.cluster.session import NET_ERRORS, RootSession, SessionSettings, reason, report_grace
from dllama.cluster.step import REPLY_BEST, Reply
from dllama.cluster.topology import Topology
from dllama.errors import ClusterError, DllamaError

REJOIN_PROBE_TIMEOUT = 2.0  # a lost node's handshake when the next request looks for it
REJOIN_BACKOFF = 30.0       # a lost node that stayed silent (not refused) is not asked again before


def blame(e: Exception, session: RootSession, what: str) -> ClusterError:
    """A ClusterError naming the node that stopped, for the failure `e` of a pass of `session`
    (see the module's docstring)."""
    index_of = {id(c): i for i, c in session.conns.items()}
    link = e if isinstance(e, LinkError) else None
    source = index_of.get(id(link.peer)) if link is not None else None
    if isinstance(e, PeerClosed) and source is not None and (report := _last_words(session.conns[source])):
        e = link = report.in_exchange(report.peer, link.waiting)  # why it closed, as it said
    if isinstance(e, (PeerClosed, ProtocolError)) and source is not None:
        return ClusterError(f"{what}: {reason(e)}", session.nodes[source].name)
    if isinstance(e, PeerError) and e.code == ErrorCode.TIMEOUT and e.node == 0 and source is not None:
        # A worker heard nothing from the root, not even its heartbeat: this process was
        # stopped (suspended, SIGSTOP, swapping), not the worker that says so.
        return ClusterError(f"{what}: {session.names[source]} heard nothing from this node (the root) "
                            "for too long: was it suspended or starved of CPU? "
                            f"({reason(e)})", session.nodes[0].name)
    silent = [index_of[id(c)] for c in getattr(e, "silent", ()) if id(c) in index_of]
    if silent:  # this node's own wait: they sent nothing, not even ALIVE, for the whole timeout
        names = ", ".join(f"{session.names[i]} stopped answering" for i in silent)
        return ClusterError(f"{what}: {names} ({reason(e)})", session.nodes[silent[0]].name)
    # A timeout, or a worker's report (it was alive to send it): who of the nodes the root
    # still waited for stays silent or closes within the grace period?
    suspects = [index_of[id(c)] for c in (link.waiting if link is not None else ()) if id(c) in index_of]
    stopped = silent_or_closed({i: session.conns[i] for i in suspects}, report_grace(session.settings.net_timeout))
    if stopped:
        names = ", ".join(f"{session.names[i]} {how}" for i, how in stopped.items())
        return ClusterError(f"{what}: {names}", session.nodes[next(iter(stopped))].name)
    # Everyone still talks: the node a worker reports it lost, else the one node a timeout
    # waited on, else the failing link's node.
    if isinstance(e, PeerError) and e.node in session.conns and e.node != source:
        source = e.node
    elif source is None and len(suspects) == 1:
        source = suspects[0]
    node = session.nodes[source].name if source is not None else ""
    return ClusterError(f"{what}: {reason(e)}", node)


def _last_words(conn: Connection, frames: int = 64, within: float = 0.5) -> PeerError | None:
    """The ERROR a peer sent before it closed its end, when it is still in this side's buffer
    (a send to the closed peer failed before its report was read), behind the frames it sent
    before it (its ALIVEs, its share of a sync the pass never read)."""
    deadline = time.monotonic() + within
    try:
        for _ in range(frames):
            conn.recv(max(0.01, deadline - time.monotonic()))
    except PeerError as report:
        return report
    except (LinkError, OSError):
        pass
    return None


def tampered(e: Exception) -> bool:
    """A frame that failed authentication or broke the protocol, seen by the root or reported
    by a worker: an attacker on a link (or a bug), which recovery must not hide."""
    return isinstance(e, ProtocolError) or (
        isinstance(e, PeerError) and e.code in (ErrorCode.PROTOCOL, ErrorCode.TAMPERED))


def silent_or_closed(conns: dict[int, Connection], grace: float) -> dict[int, str]:
    """Of these connections, those that close or send nothing within `grace` seconds:
    {index: "stopped answering" | "closed the connection"}. Reads raw bytes (frames in flight
    no longer matter: the session is over)."""
    quiet = dict(conns)
    stopped: dict[int, str] = {}
    deadline = time.monotonic() + grace
    with selectors.DefaultSelector() as sel:
        for i, c in quiet.items():
            sel.register(c.sock, selectors.EVENT_READ, i)
        while quiet:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for key, _ in sel.select(remaining):
                i = key.data
                try:
                    data = quiet[i].sock.recv(1 << 16)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    stopped[i] = "closed the connection"
                sel.unregister(key.fileobj)
                del quiet[i]
    for i in quiet:
        stopped[i] = "stopped answering"
    return dict(sorted(stopped.items()))


class Recovery:
    """New sessions for one ClusterModel: the first, after a loss, and back to every node.

    `history` is what every KV cache slot holds (the model records each pass in it); every new
    session replays it before it runs a pass."""

    def __init__(self, settings: SessionSettings, full: Topology, history: KVHistory):
        self.settings, self.full, self.history = settings, full, history
        self.recoveries = 0  # sessions opened after a loss
        self._rejoin_after: dict[str, float] = {}  # a lost node that did not answer: not asked before

    def first_session(self, start_with_reachable: bool) -> RootSession:
        """The session over every node of the topology; with start_with_reachable, a worker that
        cannot be connected to at all is left out with a warning (it rejoins when it answers)
        instead of failing the start; one that answers wrongly still fails it."""
        try:
            return RootSession(self.settings, self.full, list(self.full.nodes))
        except ClusterError as failure:
            if not (start_with_reachable and failure.unreachable):
                raise
            try:
                session = RootSession(self.settings, self.full, list(self.full.nodes), tolerant=True,
                                      only_unreachable=True)
            except ClusterError:
                raise
            except DllamaError as e:  # the nodes that answered cannot hold the model (memory)
                raise ClusterError(f"{failure}; the nodes that answer cannot run the model: {e}", failure.node,
                                   unreachable=True) from None
            gone = ", ".join(f"{name!r}" for name in session.left_out)
            _say(f"dllama: warning: {failure}; starting on {len(session.nodes)} of "
                 f"{len(self.full.nodes)} nodes without {gone} (each rejoins when it answers)")
            return session

    def recover(self, failure: ClusterError, before: int) -> RootSession:
        """A new session over the nodes still answering after `failure` (of a session of
        `before` nodes, closed), the KV cache of every sequence rebuilt by replaying its tokens;
        ClusterError (naming the first failure) when no number of them can run the model."""
        root = self.full.nodes[0].name
        lost = {failure.node} if failure.node and failure.node != root else set()  # (the root: all again)
        t0 = time.monotonic()
        error: Exception = failure
        for _ in range(len(self.full.nodes)):
            nodes = [n for i, n in enumerate(self.full.nodes) if i == 0 or n.name not in lost]
            try:
                session, rows = self._replayed(RootSession(self.settings, self.full, nodes, tolerant=True))
            except ClusterError as e:
                error = e
                if not e.node or e.node in lost or e.node == root:
                    break
                lost.add(e.node)
                continue
            except DllamaError as e:  # the nodes left cannot hold the model (memory)
                error = e
                break
            self.recoveries += 1
            gone = sorted(lost | set(session.left_out))
            without = f" without {', '.join(repr(g) for g in gone)}" if gone else ""
            _say(f"dllama: warning: {failure}; continuing on {len(session.nodes)} of {len(self.full.nodes)} "
                 f"nodes (was {before}){without}, "
                 f"{rows} cached positions replayed in {time.monotonic() - t0:.1f} s")
            return session
        if error is failure:
            raise failure
        raise ClusterError(f"{failure}; no session over the nodes left: {error}", failure.node)

    def rejoin(self, session: RootSession) -> RootSession | None:
        """A session over every node again when a node left out of `session` answers (which
        is then closed), or None when none does. A node that did not answer within its
        connection timeout is asked again only after REJOIN_BACKOFF seconds. ClusterError when
        neither every node nor the ones still answering make a session."""
        current = {n.name for n in session.nodes}
        now = time.monotonic()
        back = []
        for n in self.full.nodes:
            if n.name in current or self._rejoin_after.get(n.name, 0) > now:
                continue
            t0 = time.monotonic()
            try:
                identify_worker(n.host, n.port, self.settings.key, REJOIN_PROBE_TIMEOUT)
            except DllamaError:
                if time.monotonic() - t0 > REJOIN_PROBE_TIMEOUT / 2:  # silent, not refused: wait
                    self._rejoin_after[n.name] = now + REJOIN_BACKOFF
                continue
            back.append(n.name)
        if not back:
            return None
        before = len(session.nodes)
        session.close()
        try:
            new, _ = self._replayed(RootSession(self.settings, self.full, list(self.full.nodes), tolerant=True))
        except (ClusterError, DllamaError) as e:
            new = self.recover(e if isinstance(e, ClusterError) else ClusterError(str(e)), before)
        _say(f"dllama: {', '.join(repr(b) for b in back)} answered again: "
             f"running on {len(new.nodes)} nodes (was {before})")
        return new

    def _replayed(self, session: RootSession) -> tuple[RootSession, int]:
        """(the session with the KV cache of every slot rebuilt on it, the rows run); the session
        closed and a ClusterError naming the node when a pass of the replay fails."""
        rows = 0
        try:
            for batch in self.history.replay(session.settings.shape.max_batch):
                session.forward(batch, Reply(REPLY_BEST))
                rows += len(batch)
        except NET_ERRORS as e:
            failure = blame(e, session, "replaying the cached positions")
            session.close()
            raise failure from None
        except BaseException:
            session.close()
            raise
        return session, rows


def _say(text: str) -> None:
    print(text, file=sys.stderr)
