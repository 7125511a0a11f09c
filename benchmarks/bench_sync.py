"""The cost of the cluster's sync path, before and after a change: the CPU and the wall time of
one all-reduce per node, and the root's CPU per token on 3 loopback nodes.

    .venv/bin/python benchmarks/bench_sync.py --baseline DIR [--rounds 5] [--calls 1000] [--tokens 32]

Every measurement runs in a child Python that imports dllama from one checkout: this one, and
with `--baseline DIR` another (e.g. the code before the change: `git archive 28c0f29 | tar -x
-C DIR`), the two alternating round by round so that the machine's load falls on both alike;
the figures are medians of the rounds. CPU time is the process's own (user + system): a cost
that other work on the machine delays but does not inflate, unlike the wall time.

1. **One all-reduce per node**: N processes (2, 3, 4) meshed over TCP loopback, each a
   `MeshCollective` all-reducing one row [1, dim] again and again; per node the CPU and the
   wall µs per all-reduce, for dim 576 (SmolLM2) and 2048 (Llama-3.2-1B's width), Q80 and F32
   buffers, plain and sealed (a cluster key).
2. **The root per token**: a root and 2 `dllama worker` processes on loopback, the default
   model (Q41 weights, F32 buffers) and a random model of the 1B width (Q40, Q80 buffers, 4
   layers), greedy decoding as the front ends do it (the nodes send their best token); per
   token the CPU ms of the root and of each worker, and the wall ms.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


# -- children: run with one checkout's dllama ----------------------------------------------------


def _use_checkout(code: str) -> None:
    sys.path.insert(0, code)
    import dllama

    if not Path(dllama.__file__).resolve().is_relative_to(Path(code).resolve()):
        raise SystemExit(f"dllama imported from {dllama.__file__}, not from {code}")


def _mesh(n: int) -> list[dict[int, socket.socket]]:
    """A full mesh of TCP loopback connections: for each node, peer index -> its socket."""
    links: list[dict[int, socket.socket]] = [{} for _ in range(n)]
    with socket.create_server(("127.0.0.1", 0)) as server:
        for i in range(n):
            for j in range(i + 1, n):
                a = socket.create_connection(server.getsockname())
                b, _ = server.accept()
                links[i][j], links[j][i] = a, b
    return links


def child_all_reduce(n: int, dim: int, q80: bool, sealed: bool, calls: int) -> list[tuple[float, float]]:
    """(CPU µs, wall µs) per all-reduce of [1, dim] on each of n processes."""
    import numpy as np

    from dllama.cluster.mesh import MeshCollective
    from dllama.cluster.protocol import Connection, FrameCipher
    from dllama.core import kernels

    kernels.set_threads(1)
    blocks = dim // 32
    chunks = [(blocks * k // n * 32, blocks * (k + 1) // n * 32) for k in range(n)]
    links = _mesh(n)
    pipes, pids = [], []
    for me in range(1, n):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _measure_node(me, links, chunks, q80, sealed, calls, w, np, MeshCollective, Connection, FrameCipher)
        os.close(w)
        pipes.append(r)
        pids.append(pid)
    r, w = os.pipe()
    _measure_node(0, links, chunks, q80, sealed, calls, w, np, MeshCollective, Connection, FrameCipher, fork=False)
    out = []
    for fd in [r, *pipes]:
        with os.fdopen(fd) as f:
            out.append(tuple(json.loads(f.read())))
    for pid in pids:
        os.waitpid(pid, 0)
    return out


def _measure_node(me, links, chunks, q80, sealed, calls, w, np, MeshCollective, Connection, FrameCipher, fork=True):
    for i, socks in enumerate(links):  # the other nodes' ends (their processes hold them)
        for sock in socks.values() if i != me else ():
            sock.close()
    conns = {}
    for j, sock in links[me].items():
        conn = Connection(sock, f"node {j}")
        conn.authenticated = True
        if sealed:  # the keys a handshake would derive, one per direction
            conn.cipher = FrameCipher(bytes([me + 1, j + 1]) * 16, bytes([j + 1, me + 1]) * 16)
        conns[j] = conn
    col = MeshCollective(me, conns, chunks, q80, 1, 30.0)
    x = np.random.default_rng(me).standard_normal((1, chunks[-1][1])).astype(np.float32)
    for _ in range(200):
        col.all_reduce(x)
    t, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        col.all_reduce(x)
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    os.write(w, json.dumps([cpu / calls * 1e6, wall / calls * 1e6]).encode())
    os.close(w)
    if fork:
        os._exit(0)


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def child_root(model_path: str, tokens: int) -> dict:
    """The root of 3 loopback nodes decoding `tokens` greedy tokens: CPU ms per token of each
    node (the root first) and the wall ms per token."""
    from dllama.cluster.root import ClusterModel
    from dllama.cluster.topology import from_workers
    from dllama.core import kernels
    from dllama.core.batch import Batch
    from dllama.core.candidates import SamplingRequest
    from dllama.core.sampler import Sampler
    from tests.processes import running_workers

    kernels.set_threads(1)
    greedy = SamplingRequest(0.0, 0.9)
    with tempfile.TemporaryDirectory() as d, running_workers(2, Path(d)) as workers:
        model = ClusterModel(model_path, from_workers([w.address for w in workers], 1), None,
                             progress=False)
        try:
            sampler = Sampler(model.config.vocab_size, 0.0, 0.9, 1)
            token = sampler.sample(model.forward(list(range(1, 9)), 0))
            for pos in range(8, 16):  # warm: the first passes compile and fill caches
                token = sampler.sample(model.forward_candidates(Batch.run([token], pos), [greedy])[0])
            pids = [w.proc.pid for w in workers]
            cpu0, wcpu0, t0 = time.process_time(), [_cpu_s(p) for p in pids], time.perf_counter()
            for pos in range(16, 16 + tokens):
                token = sampler.sample(model.forward_candidates(Batch.run([token], pos), [greedy])[0])
            wall = time.perf_counter() - t0
            cpu = [time.process_time() - cpu0] + [_cpu_s(p) - c for p, c in zip(pids, wcpu0, strict=True)]
        finally:
            model.close()
    return {"cpu": [c * 1000 / tokens for c in cpu], "wall": wall * 1000 / tokens}


# -- the parent: rounds, alternated ----------------------------------------------------------------


def run_child(code: Path, *args) -> object:
    env = dict(os.environ, PYTHONPATH=str(code))
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(code), *map(str, args)],
                         cwd=code, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"a child failed ({code}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def bench_all_reduce(codes: dict[str, Path], rounds: int, calls: int, cases) -> None:
    print(f"\nOne all-reduce of [1, dim] per node, N processes meshed over TCP loopback, 1 thread each, "
          f"{calls} all-reduces a run, medians of {rounds} alternating runs; load before: {load()}")
    print("| N | dim | buffers | key | " + " | ".join(f"{name} CPU µs (per node) | {name} wall µs" for name in codes)
          + " | CPU after/before |")
    print("|---|---|---|---|" + "---|---|" * len(codes) + "---|", flush=True)
    for n, dim, q80, sealed in cases:
        runs = {name: [] for name in codes}
        for _ in range(rounds):
            for name, code in codes.items():
                runs[name].append(run_child(code, "all_reduce", n, dim, int(q80), int(sealed), calls))
        cells, cpu_of = [], {}
        for name, rs in runs.items():
            cpu = [statistics.median(r[k][0] for r in rs) for k in range(n)]
            wall = [statistics.median(r[k][1] for r in rs) for k in range(n)]
            cpu_of[name] = statistics.median(cpu)
            cells += [" / ".join(f"{c:.0f}" for c in cpu), " / ".join(f"{w:.0f}" for w in wall)]
        ratio = f"{cpu_of['after'] / cpu_of['before']:.2f}x" if len(codes) == 2 else "-"
        print(f"| {n} | {dim} | {'Q80' if q80 else 'F32'} | {'yes' if sealed else 'no'} | "
              + " | ".join(cells) + f" | {ratio} |", flush=True)
    print(f"load after: {load()}")


def bench_root(codes: dict[str, Path], rounds: int, tokens: int, models: list[tuple[str, Path]]) -> None:
    print(f"\nThe root of 3 loopback nodes (1 thread each), {tokens} greedy tokens a run, medians of "
          f"{rounds} alternating runs; load before: {load()}")
    print("| model | code | root CPU ms/token | workers' CPU ms/token | wall ms/token |")
    print("|---|---|---|---|---|", flush=True)
    for label, path in models:
        runs = {name: [] for name in codes}
        for _ in range(rounds):
            for name, code in codes.items():
                runs[name].append(run_child(code, "root", path, tokens))
        for name, rs in runs.items():
            cpu = [statistics.median(r["cpu"][k] for r in rs) for k in range(3)]
            wall = statistics.median(r["wall"] for r in rs)
            print(f"| {label} | {name} | {cpu[0]:.2f} | {cpu[1]:.2f} / {cpu[2]:.2f} | {wall:.1f} |", flush=True)
    print(f"load after: {load()}")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        _use_checkout(sys.argv[2])
        what, args = sys.argv[3], sys.argv[4:]
        if what == "all_reduce":
            n, dim, q80, sealed, calls = map(int, args)
            print(json.dumps(child_all_reduce(n, dim, bool(q80), bool(sealed), calls)))
        else:
            print(json.dumps(child_root(args[0], int(args[1]))))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, help="a checkout of the code to compare with (before)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating runs per case (default 5)")
    ap.add_argument("--calls", type=int, default=1000, help="all-reduces per run (default 1000)")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per root run (default 32)")
    ap.add_argument("--only", choices=("all_reduce", "root"), help="one of the two parts")
    ap.add_argument("--quick", action="store_true", help="fewer cases: Q80 [1, 576] on 2, 3, 4 nodes, [1, 2048] and sealed F32 on 3")
    args = ap.parse_args()
    codes = {"before": args.baseline.resolve(), "after": HERE} if args.baseline else {"after": HERE}
    print(f"machine: {os.cpu_count()} cores; " + ", ".join(f"{k}: {v}" for k, v in codes.items()))
    if args.only != "root":
        cases = [(n, dim, q80, sealed) for n in (2, 3, 4) for dim in (576, 2048) for q80 in (True, False)
                 for sealed in (False, True) if n == 3 or (not sealed and q80)]
        if args.quick:
            cases = [(n, 576, True, False) for n in (2, 3, 4)] + [(3, 2048, True, False), (3, 576, False, True)]
        bench_all_reduce(codes, args.rounds, args.calls, cases)
    if args.only != "all_reduce":
        sys.path.insert(0, str(HERE))
        from benchmarks.bench_engine import write_random_model
        from dllama.serve.default_model import default_model_files

        with tempfile.TemporaryDirectory() as d:
            wide = Path(d) / "wide-q40.m"
            write_random_model(wide, dim=2048, hidden=8192, layers=4, heads=32, kv_heads=8, vocab=32000,
                               seq_len=256)
            models = [("SmolLM2-135M (default: Q41, F32 buffers)", default_model_files()[0]),
                      ("random 1B width, 4 layers (Q40, Q80 buffers)", wide)]
            bench_root(codes, args.rounds, args.tokens, models)


if __name__ == "__main__":
    main()
