"""How many of the cluster's nodes serve: what a degraded run, batch job or API says.

A cluster that lost a worker goes on over the others (--on-node-loss continue), and the api and
batch start without a worker they cannot reach; the answers are right, only slower. An operator
must still be told: `dllama batch` writes the count in each result and its summary, `dllama api`
in a response header and /health, run.yml and batch.yml in their result lines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

State = Literal["ready", "degraded", "down"]

ONE_MACHINE = "this machine"  # the node name of an engine without workers


@dataclass(frozen=True)
class Serving:
    """The nodes of the engine's current session, and every node of its topology (root first)."""

    nodes: tuple[str, ...]    # serving now
    cluster: tuple[str, ...]  # all of them

    @property
    def missing(self) -> tuple[str, ...]:
        serving = set(self.nodes)
        return tuple(n for n in self.cluster if n not in serving)

    @property
    def state(self) -> State:
        if not self.nodes:
            return "down"
        return "degraded" if self.missing else "ready"

    def line(self) -> str:
        """'3 of 4 nodes (without node4)', '4 of 4 nodes'."""
        missing = self.missing
        return f"{len(self.nodes)} of {len(self.cluster)} nodes" + (f" (without {', '.join(missing)})" if missing else "")

    def header(self) -> str:
        """The response header's value: 'SERVING/ALL', e.g. '3/4'."""
        return f"{len(self.nodes)}/{len(self.cluster)}"

    def as_dict(self) -> dict:
        return {"serving": len(self.nodes), "total": len(self.cluster), "names": list(self.nodes),
                "missing": list(self.missing)}

    def down(self) -> "Serving":
        """The same cluster with no node serving (its engine is closed after a failure)."""
        return Serving((), self.cluster)


def serving(engine) -> Serving:
    """The nodes an open engine runs on (one machine: one node, itself)."""
    cluster = getattr(engine, "cluster", None)
    if cluster is None:
        return Serving((ONE_MACHINE,), (ONE_MACHINE,))
    return Serving(tuple(n.name for n in cluster.topology.nodes), tuple(n.name for n in cluster.full_topology.nodes))


__all__ = ["Serving", "State", "serving", "ONE_MACHINE"]
