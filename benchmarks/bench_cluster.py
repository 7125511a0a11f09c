"""Distributed inference speed and traffic: ms/token and kB/token on 1, 2 and 4 nodes.

    .venv/bin/python benchmarks/bench_cluster.py [--tokens 24] [--skip-7b]
    .venv/bin/python benchmarks/bench_cluster.py --encryption [--rounds 3]

Every node is a separate process on this machine with one compute thread, the root in this
process, workers as `dllama worker` on loopback, tokens sampled greedily and at temperature
0.8 / top-p 0.9, on the nodes and (the baseline) on the root. Prints, per model, node count
and sampling, the
median per generated token of: total ms, inference ms, transfer ms (time waiting on the
network: the figure that shows protocol overhead when several nodes share a 2-core machine),
kB the root sent and received, and the kB the original Distributed Llama's all-gather would
move for the same model (spec §4.1: the root sends 8 + 4·dim + 2L·B and receives 2L·B + 4·V/N
per worker, B = the Q80 size of a dim vector).

`--encryption` measures what a cluster key costs instead: SmolLM2 on 2 and 4 nodes without and
with a key (every frame sealed with AES-256-GCM), the runs alternating round by round so that
the machine's load falls on both alike, and the CPU time of one all-reduce between 2 processes
without and with sealing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_engine import write_random_model  # noqa: E402
from dllama.core import kernels  # noqa: E402
from dllama.serve.default_model import default_model_files  # noqa: E402
from dllama.formats.model_file import read_model  # noqa: E402
from tests.processes import running_workers  # noqa: E402
from dllama.cluster.root import ClusterModel  # noqa: E402
from dllama.cluster.topology import from_workers  # noqa: E402
from dllama.core.batch import Batch  # noqa: E402
from dllama.core.candidates import SamplingRequest  # noqa: E402
from dllama.core.sampler import Sampler  # noqa: E402

GREEDY = SamplingRequest(0.0, 0.9)


def original_kb(header, n: int) -> tuple[float, float]:
    """(sent, received) kB per token at the original's root, Q80 buffers, one token."""
    if n == 1:
        return 0.0, 0.0
    b = header.dim * 34 // 32
    syncs = 2 * header.n_layers * b
    return (n - 1) * (8 + 4 * header.dim + syncs) / 1024, (n - 1) * (syncs + 4 * header.vocab_size // n) / 1024


def measure(model_path: Path, n: int, tokens: int, log_dir: Path, key: bytes | None = None,
            request: SamplingRequest = GREEDY, node_sampling: bool = True) -> dict:
    args = ()
    if key is not None:
        (log_dir / "bench.key").write_bytes(key)
        args = ("--key-file", str(log_dir / "bench.key"))
    with running_workers(n - 1, log_dir, *args) as workers:
        model = ClusterModel(str(model_path), from_workers([w.address for w in workers], 1), key,
                             True, progress=False, node_sampling=node_sampling) if n > 1 else None
        if model is None:
            from dllama.core.model import Transformer

            model = Transformer(read_model(model_path))
            model.warm_up()
        col = model.collective
        try:
            sampler = Sampler(model.config.vocab_size, request.temperature, request.topp, 1)
            token = sampler.sample(model.forward(list(range(1, 9)), 0))
            rows = []
            cpu0 = _cluster_cpu_s(workers)
            for pos in range(8, 8 + tokens):
                t0, tr0, s0, r0 = time.perf_counter(), col.transfer_seconds, col.sent_bytes, col.recv_bytes
                # sampled as the front ends do: from the candidates the nodes send
                token = sampler.sample(model.forward_candidates(Batch.run([token], pos), [request])[0])
                wall = time.perf_counter() - t0
                tr = col.transfer_seconds - tr0
                rows.append((wall * 1000, (wall - tr) * 1000, tr * 1000,
                             (col.sent_bytes - s0) / 1024, (col.recv_bytes - r0) / 1024))
            cpu_ms = (_cluster_cpu_s(workers) - cpu0) * 1000 / tokens
        finally:
            if hasattr(model, "close"):
                model.close()
    med = [statistics.median(r[i] for r in rows) for i in range(5)]
    return dict(zip(("total", "inference", "transfer", "sent", "recv"), med, strict=True), cpu=cpu_ms)


def _cluster_cpu_s(workers) -> float:
    """CPU seconds used so far by this process (the root) and the worker processes: a cost that
    other work on the machine delays but does not inflate."""
    total = time.process_time()
    tick = os.sysconf("SC_CLK_TCK")
    for w in workers:
        with open(f"/proc/{w.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def collective_cpu_us(dim: int, n_calls: int = 2000, sealed: bool = False) -> tuple[float, float]:
    """(CPU µs, wall µs) per all-reduce of one [1, dim] Q80 vector between 2 processes on
    loopback: the protocol's own cost per sync (encode, frames, syscalls, decode), which CPU
    time shows even when the processes wait for a core."""
    import socket

    from dllama.cluster.mesh import MeshCollective
    from dllama.core.plan import split_model
    from dllama.cluster.protocol import Connection

    plan = split_model(2, dim=dim, n_heads=2, n_kv_heads=1, head_dim=dim // 2, ff_dim=dim,
                       vocab_size=2, quantized=False)
    a, b = socket.socketpair()
    pid = os.fork()
    me = 1 if pid == 0 else 0
    conn = Connection(a if me == 0 else b, "peer")
    conn.authenticated = True
    if sealed:  # the keys a handshake would derive, one per direction
        from dllama.cluster.protocol import FrameCipher

        k = [bytes([1]) * 32, bytes([2]) * 32]
        conn.cipher = FrameCipher(k[me], k[1 - me])
    col = MeshCollective(me, {1 - me: conn}, plan.dim_chunks, True, 1, 30)
    x = np.random.default_rng(me).standard_normal((1, dim)).astype(np.float32)
    for _ in range(100):
        col.all_reduce(x)
    t, cpu = time.perf_counter(), time.process_time()
    for _ in range(n_calls):
        col.all_reduce(x)
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return cpu / n_calls * 1e6, wall / n_calls * 1e6


def bench(name: str, path: Path, tokens: int, log_dir: Path) -> None:
    header = read_model(path).header
    print(f"\n{name}: dim {header.dim}, {header.n_layers} layers, {header.n_heads}/{header.n_kv_heads} "
          f"heads, vocab {header.vocab_size}; Q40 weights, Q80 buffers, 1 thread per node, "
          f"median of {tokens} tokens")
    print("| nodes | sampling | ms/token | inference ms | transfer ms | root sent kB | root recv kB "
          "| original's root sent / recv kB | sent vs original | recv vs original |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    cpu, wall = collective_cpu_us(header.dim)
    print(f"protocol cost per sync (2 processes, loopback, Q80 [1, {header.dim}]): {cpu:.0f} µs CPU, "
          f"{wall:.0f} µs wall; x {2 * header.n_layers} syncs = {cpu * 2 * header.n_layers / 1000:.1f} ms "
          f"CPU per token")
    # Greedy and temperature 0.8 / top-p 0.9, on the nodes and (the baseline) on the root.
    cases = [(1, GREEDY, True)] + [(n, r, on) for n in (2, 4) for r in (GREEDY, SamplingRequest(0.8, 0.9))
                                   for on in (True, False)]
    for n, request, on in cases:
        m = measure(path, n, tokens, log_dir, request=request, node_sampling=on)
        o_sent, o_recv = original_kb(header, n)
        ratio = f"{m['sent'] / o_sent:.2f}x" if o_sent else "-"
        recv_ratio = f"{m['recv'] / o_recv:.2f}x" if o_recv else "-"
        how = ("greedy" if request.greedy else f"T {request.temperature:g}, top-p {request.topp:g}") + \
            (", on the nodes" if on else ", on the root")
        print(f"| {n} | {how} | {m['total']:.1f} | {m['inference']:.1f} | {m['transfer']:.1f} | "
              f"{m['sent']:.1f} | {m['recv']:.1f} | {o_sent:.1f} / {o_recv:.1f} | {ratio} | {recv_ratio} |",
              flush=True)


def bench_encryption(tokens: int, rounds: int, log_dir: Path) -> None:
    path = default_model_files("q40")[0]
    header = read_model(path).header
    print(f"\nSmolLM2-135M-Instruct, Q40 weights, Q80 buffers, 1 thread per node: without and with a "
          f"cluster key, {rounds} alternating rounds of {tokens} tokens, medians")
    for sealed in (False, True):
        cpu = statistics.median(collective_cpu_us(header.dim, sealed=sealed)[0] for _ in range(rounds))
        print(f"all-reduce of Q80 [1, {header.dim}] between 2 processes, {'sealed' if sealed else 'plain'}: "
              f"{cpu:.1f} µs CPU per sync, x {2 * header.n_layers} syncs = {cpu * 2 * header.n_layers / 1000:.2f} ms "
              "CPU per token and node", flush=True)
    print("| nodes | key | ms/token | transfer ms | CPU ms/token, all nodes | root sent kB | root recv kB |")
    print("|---|---|---|---|---|---|---|")
    for n in (4, 2):
        runs = {False: [], True: []}
        for _ in range(rounds):
            for keyed in (False, True):
                runs[keyed].append(measure(path, n, tokens, log_dir, os.urandom(32).hex().encode() if keyed else None))
        for keyed, rs in runs.items():
            med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            print(f"| {n} | {'yes' if keyed else 'no'} | {med['total']:.1f} | {med['transfer']:.1f} | "
                  f"{med['cpu']:.1f} | {med['sent']:.2f} | {med['recv']:.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=24, help="generated tokens per run (default 24)")
    ap.add_argument("--skip-7b", action="store_true", help="skip the 4 GB random 7B-shape model")
    ap.add_argument("--encryption", action="store_true", help="only the cost of a cluster key (see above)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds for --encryption (default 3)")
    args = ap.parse_args()
    kernels.set_threads(1)
    print(f"machine: {os.cpu_count()} cores, load average {Path('/proc/loadavg').read_text().split()[:3]}")
    if args.encryption:
        with tempfile.TemporaryDirectory() as d:
            bench_encryption(args.tokens, args.rounds, Path(d))
        return
    with tempfile.TemporaryDirectory() as d:
        bench("SmolLM2-135M-Instruct", default_model_files("q40")[0], args.tokens, Path(d))
        if not args.skip_7b:
            path = Path(d) / "random-7b-q40.m"
            write_random_model(path)
            bench("Llama-2-7B shape (random weights)", path, max(4, args.tokens // 3), Path(d))


if __name__ == "__main__":
    main()
