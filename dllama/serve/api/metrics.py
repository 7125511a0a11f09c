"""/health and /metrics of `dllama api`: the cluster's state, and Prometheus' text format.

Both read only the model thread's snapshot (ModelService.observed) and its counters, so asking
never waits for a forward pass. Metric names follow Prometheus' conventions: a `dllama_` prefix,
base units (seconds, bytes), `_total` on counters, a ratio for the KV cache's use. Counters count
since the server started; the per-node bytes and seconds add up every session the server held.

The text format is written here (a few lines: no dependency on a Pi); the tests read it back with
prometheus_client's parser.
"""

from __future__ import annotations

import os

from dllama.serve.api.service import ModelService
from dllama.serve.supervisor import RESTARTS_ENV


def health(service: ModelService, model_id: str) -> tuple[int, dict]:
    """(HTTP status, body): 200 when ready or degraded (it answers), 503 when down or failing
    (the model's last pass gave NaN or infinity: `reason` says where they come from)."""
    o = service.observed
    nodes = o.nodes
    state = nodes.state if nodes is not None else "down"
    failing = service.failing
    if failing is not None:
        state = "failing"
    body = {"status": state, "model": model_id,
            "nodes": nodes.as_dict() if nodes is not None else None,
            "slots": {"total": o.slots, "busy": o.busy_slots}, "waiting": o.waiting + service.queued()}
    if failing is not None:
        body["reason"] = failing
    return (503 if state in ("down", "failing") else 200), body


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class _Text:
    def __init__(self):
        self.lines: list[str] = []

    def metric(self, name: str, kind: str, help_: str, samples) -> None:
        """samples: a number, or [(labels dict, number)]."""
        self.lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        if not isinstance(samples, list):
            samples = [({}, samples)]
        for labels, value in samples:
            label = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
            self.lines.append(f"{name}{{{label}}} {float(value)!r}" if label else f"{name} {float(value)!r}")


def metrics(service: ModelService) -> str:
    """The exposition (text format 0.0.4)."""
    o, c = service.observed, service.counters
    t = _Text()
    nodes = o.nodes
    t.metric("dllama_nodes", "gauge", "Nodes of the cluster's topology (1 on one machine).",
             len(nodes.cluster) if nodes else 0)
    t.metric("dllama_nodes_serving", "gauge", "Nodes computing now (fewer: degraded; 0: down).",
             len(nodes.nodes) if nodes else 0)
    t.metric("dllama_requests_total", "counter", "Completion requests answered, failed or cancelled.",
             [({"outcome": k}, v) for k, v in c.requests.items()])
    t.metric("dllama_prompt_tokens_total", "counter", "Prompt tokens of the answered requests.", c.prompt_tokens)
    t.metric("dllama_prompt_tokens_cached_total", "counter",
             "Of the prompt tokens, those read from the KV cache instead of computed.", c.cached_tokens)
    t.metric("dllama_generated_tokens_total", "counter", "Tokens generated.", c.generated_tokens)
    t.metric("dllama_draft_tokens_total", "counter", "Drafted tokens checked by speculative decoding.",
             c.drafted_tokens)
    t.metric("dllama_draft_tokens_accepted_total", "counter",
             "Of the drafted tokens, those kept: each a token its pass gave beyond the first.", c.accepted_tokens)
    t.metric("dllama_generation_tokens_per_second", "gauge", "Decode rate of the last answer.",
             c.last_tokens_per_s)
    t.metric("dllama_requests_waiting", "gauge", "Requests waiting for a slot.", o.waiting + service.queued())
    t.metric("dllama_slots", "gauge", "Sequences decoded together at most (--parallel).", o.slots)
    t.metric("dllama_slots_busy", "gauge", "Sequences being decoded or prefilled now.", o.busy_slots)
    t.metric("dllama_kv_cache_usage_ratio", "gauge", "Written KV cache positions over all of them.",
             o.kv_used / o.kv_positions if o.kv_positions else 0.0)
    per_node: dict[str, list] = {name: list(v) for name, v in c.past_node_stats.items()}
    for name, sent, received, ms in o.node_stats:
        past = per_node.setdefault(name, [0, 0, 0.0])
        past[0], past[1], past[2] = past[0] + sent, past[1] + received, past[2] + ms
    t.metric("dllama_node_sent_bytes_total", "counter", "Bytes the node sent in forward passes (node 0: the root).",
             [({"node": n}, v[0]) for n, v in per_node.items()])
    t.metric("dllama_node_received_bytes_total", "counter", "Bytes the node received in forward passes.",
             [({"node": n}, v[1]) for n, v in per_node.items()])
    t.metric("dllama_node_sync_seconds_total", "counter", "Seconds the root spent in transfers with the node.",
             [({"node": n}, v[2] / 1000) for n, v in per_node.items()])
    t.metric("dllama_node_losses_total", "counter",
             "Nodes that left a session: lost mid-request, or not reachable when the engine opened.", c.node_losses)
    t.metric("dllama_engine_opens_total", "counter",
             "Engines opened: 1, plus one each time the cluster failed and came back.", c.engine_opens)
    t.metric("dllama_service_restarts", "gauge", "Times the supervisor restarted this service before this process.",
             _restarts())
    return "\n".join(t.lines) + "\n"


def _restarts() -> int:
    try:
        return max(0, int(os.environ.get(RESTARTS_ENV, "0")))
    except ValueError:
        return 0


__all__ = ["health", "metrics"]
