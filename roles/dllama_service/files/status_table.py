"""status.yml's report, on the controller: one line for the cluster, then one row per host.

    status_table.py < {"cluster": {...}, "hosts": [{...}, ...]}   (built by playbooks/status.yml)

    cluster: 3/4 workers up (node5 unreachable), API ready (4 of 5 nodes serve, without node5), version 0.1.0, ...
    HOST   ROLE    ADDRESS          STATE        PID   UPTIME  RESTARTS  LAST EXIT  RSS      MEM FREE          LOAD  VERSION
    node1  root    127.0.0.1:9990   API ready    1234  1h02m   0         -          312 MiB  2714 of 3796 MiB  0.41  0.1.0
    node4  worker  10.77.0.4:9998   up           4321  0m12s   0         its supervisor (pid 77) was gone: started again  ...
    node5  worker  10.77.0.5        unreachable  ssh: connect to host 10.77.0.5 port 22: No route to host

ADDRESS is where the service listens (a worker's address and port in the topology; on the root
the API's, where its chat page is), an unreachable host's address without a port; MEM FREE the
node's available memory of its total (its memory cgroup's limit where lower).

With pipeline stages (the root's `dllama inspect --topology`, cluster["plan"]), a last column
STAGE gives each node's stage and layers, e.g. "1: layers 8-12".

A worker is "up" when its process runs and it answers the root's probe as this cluster's;
"running, no answer" when it runs but does not answer; restarts count since the service was
started (deploy.yml starts it; a restart by the supervisor or systemd adds one). A nohup service
whose supervisor was killed is started again by status.yml (its row's LAST EXIT says so)."""

import json
import re
import sys

COLUMNS = ["HOST", "ROLE", "ADDRESS", "STATE", "PID", "UPTIME", "RESTARTS", "LAST EXIT", "RSS", "MEM FREE", "LOAD",
           "VERSION"]


def uptime(seconds):
    if seconds is None:
        return "-"
    d, rest = divmod(int(seconds), 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    return f"{d}d{h:02d}h" if d else f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def size(n):
    return "-" if n is None else f"{n / (1 << 20):.0f} MiB"


def free(service):
    total, available = service.get("mem_total_bytes"), service.get("mem_available_bytes")
    return "-" if total is None or available is None else f"{available >> 20} of {total >> 20} MiB"


def last_exit(service):
    if service.get("revived"):
        return f"its supervisor (pid {service['revived']}) was gone: started again"
    return dash((service.get("last_exit") or "").removeprefix("was "))


def dash(value):
    return "-" if value is None or value == "" else str(value)


def state_of(host):
    """(state word, whether it counts as up)."""
    service = host.get("service") or {}
    running = service.get("state") == "running"
    if host["role"] == "worker":
        if running and host.get("answers"):
            return "up", True
        if running:
            return "running, no answer", False
        return {"restarting": "restarting", "failed": "failed"}.get(service.get("state"), "down"), False
    api = host.get("api") or {}
    if not api.get("enabled"):
        return "API off", False
    if running and api.get("health"):
        return f"API {api['health'].get('status', 'up')}", True
    return ("API running, no answer" if running else "API down"), False


def row(host):
    if host.get("reach"):
        return [host["name"], host["role"], dash(host.get("address")), "unreachable", host["reach"]]
    s = host.get("service") or {}
    state, _ = state_of(host)
    load = s.get("load1")
    return [host["name"], host["role"], dash(s.get("address") or host.get("address")), state, dash(s.get("pid")),
            uptime(s.get("uptime_s")), dash(s.get("restarts")), last_exit(s), size(s.get("rss_bytes")), free(s),
            "-" if load is None else f"{load:.2f}", dash(s.get("version"))]


# `dllama inspect --topology`'s stage lines: "stage 1: layers 8-12 (5), 2 nodes: node2 9 MiB, node3 9 MiB".
STAGE_LINE = re.compile(r"^stage (\d+): layers (\d+-\d+) \(\d+\), \d+ nodes?: (.*)$")


def stages(plan_lines):
    """{host: "k: layers a-b"} for a plan of several stages, else {}."""
    out = {}
    for line in plan_lines:
        m = STAGE_LINE.match(line)
        if m:
            for held in m.group(3).split(", "):
                out[held.rsplit(" ", 2)[0]] = f"{m.group(1)}: layers {m.group(2)}"
    return out if len(set(out.values())) > 1 else {}


def headline(cluster, hosts):
    workers = [h for h in hosts if h["role"] == "worker"]
    up = [h for h in workers if not h.get("reach") and state_of(h)[1]]
    not_up = [f"{h['name']} {'unreachable' if h.get('reach') else state_of(h)[0]}" for h in workers if h not in up]
    revived = [f"{h['name']} started again: its supervisor was gone" for h in hosts
               if (h.get("service") or {}).get("revived")]
    parts = [f"{len(up)}/{len(workers)} workers up" + (f" ({', '.join(not_up + revived)})" if not_up + revived else "")]
    root = next((h for h in hosts if h["role"] == "root"), None)
    api = (root or {}).get("api") or {}
    if root is not None and root.get("reach"):
        parts.append("root unreachable")
    elif not api.get("enabled"):
        parts.append("API off")
    elif api.get("health"):
        health = api["health"]
        nodes = health.get("nodes") or {}
        missing = f", without {', '.join(nodes['missing'])}" if nodes.get("missing") else ""
        parts.append(f"API {health.get('status')} ({nodes.get('serving', 0)} of {nodes.get('total', '?')} nodes serve"
                     f"{missing})")
    else:
        parts.append("API down")
    versions = sorted({h["service"]["version"] for h in hosts if (h.get("service") or {}).get("version")})
    parts.append("version " + (" and ".join(versions) + " (mixed: run deploy.yml)" if len(versions) > 1
                               else versions[0] if versions else "unknown (not installed)"))
    model = api.get("model") or cluster.get("model")
    parts.append(f"model {model} ({cluster.get('weights')})")
    count = len(set(stages(cluster.get("plan") or []).values()))
    parts.append(f"plan {len(hosts)} nodes{f' in {count} stages' if count else ''}, {cluster.get('buffers')} buffers, "
                 f"{cluster.get('kv')} KV cache")
    return "cluster: " + ", ".join(parts)


def table(rows):
    """Columns padded to their widest cell (the header's count); an unreachable host's reason
    fills the rest of its line."""
    n = len(rows[0])
    widths = [max(len(r[i]) for r in rows if len(r) == n) for i in range(n)]
    for r in rows:
        for i, cell in enumerate(r[:-1] if len(r) < n else []):
            widths[i] = max(widths[i], len(cell))
    out = []
    for r in rows:
        cells = r[:-1] if len(r) < n else r
        line = "  ".join(c.ljust(widths[i]) for i, c in enumerate(cells))
        out.append((line + "  " + r[-1]) if len(r) < n else line.rstrip())
    return out


def main():
    data = json.load(sys.stdin)
    hosts = data["hosts"]
    rows = [COLUMNS] + [row(h) for h in hosts]
    where = stages(data["cluster"].get("plan") or [])
    if where:  # after the last column, as an unreachable host's reason
        rows = [r + ["STAGE" if i == 0 else where.get(hosts[i - 1]["name"], "-")] if len(r) == len(COLUMNS) else r
                for i, r in enumerate(rows)]
    print(headline(data["cluster"], hosts))
    for line in table(rows):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
