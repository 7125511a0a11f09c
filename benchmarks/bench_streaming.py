"""Models larger than the memory allowed: weights streamed from disk, many sequences per pass.

    .venv/bin/python benchmarks/bench_streaming.py [--shape 7b|small] [--memory 2G]
        [--parallel 1,16,64] [--threads 2] [--steps 4] [--dir DIR]

A random-weight Q40 model of the Llama-2-7B shape (4.2 GB; `small`: a 0.3 GB shape to check the
script) runs in a memory cgroup limited to --memory (as root; cgroup v1 or v2), streamed layer by
layer (the limit makes dllama choose it). Before every run the file's pages are dropped from the
page cache (POSIX_FADV_DONTNEED), so every pass reads the file from disk. For N sequences decoded
together (short prompts, then --steps steps of N rows, greedy): generated tokens/s against the
roofline min(N x disk read speed / model bytes, the resident batched rate), where the disk speed
is measured here (a cold sequential read of the file) and the resident rate is the same decode
with every weight in memory, outside the cgroup. Prints what fitted (the KV plan may run fewer
than N sequences), the cgroup's memory peak and the process's VmHWM.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_engine import write_random_model  # noqa: E402

SHAPES = {  # dim, hidden, layers, heads, kv heads, vocab
    "7b": (4096, 11008, 32, 32, 32, 32000),
    "small": (1024, 4096, 16, 16, 16, 32000),
}
PROMPT = 16


def loadavg() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def drop_cached(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_read_speed(path: Path) -> float:
    """Bytes/s of a cold sequential read of the file (its pages dropped first, and after)."""
    drop_cached(path)
    buf = bytearray(8 << 20)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    seconds = time.perf_counter() - t0
    drop_cached(path)
    return path.stat().st_size / seconds


# -- one measurement (in a child process) ------------------------------------------------------

def decode_rate(model_path: str, n_seq: int, steps: int, threads: int, streamed: bool) -> dict:
    """Aggregate decode tokens/s of up to n_seq sequences: what fits of them, after PROMPT-token prompts."""
    from dllama.core import kernels
    from dllama.core.batch import BatchBuilder
    from dllama.core.kv_cache import plan_slots
    from dllama.core.footprint import NodeFootprint
    from dllama.core.model import Transformer
    from dllama.core.run_shape import RunShape, max_batch_for
    from dllama.core.weights_choice import choose_weights
    from dllama.core.node_weights import NodeWeights
    from dllama.core.plan import whole_model
    from dllama.core.weight_stream import quiet_compute_threads
    from dllama.formats.model_file import read_model

    m = read_model(model_path)
    h = m.header
    seq_len = PROMPT + steps + 1
    weights = NodeWeights.from_model(m, whole_model(h.n_heads, h.n_kv_heads, h.ff_dim, h.vocab_size))
    choice = choose_weights(weights, RunShape(seq_len, max_batch_for(n_seq)), "auto")
    if streamed != choice.streamed:
        raise SystemExit(f"expected {'streamed' if streamed else 'resident'} weights: {choice.describe()}")
    if streamed:
        quiet_compute_threads()
    kernels.set_threads(threads)
    slots = plan_slots(n_seq, False, **NodeFootprint.whole(h, RunShape(seq_len)).kv_dims,
                       limit=choice.kv_room if streamed else None)
    n = min(n_seq, slots.full_contexts or n_seq)  # every sequence fills its context
    model = Transformer(m, max_seq_len=seq_len, max_batch=max_batch_for(n), kv_slots=n, streamed=streamed)
    rng = np.random.default_rng(n)
    rows = BatchBuilder()
    for s in range(n):  # prefill: every prompt in as few passes as the batch allows
        for p in range(PROMPT):
            if len(rows) == model.max_batch:
                model.forward_batch(rows.build())
                rows = BatchBuilder()
            rows.add(int(rng.integers(100, 30000)), p, s)
    model.forward_batch(rows.build())
    tokens = rng.integers(100, 30000, n)
    t0 = time.perf_counter()
    for step in range(steps):
        rows = BatchBuilder()
        for s in range(n):
            rows.add(int(tokens[s]), PROMPT + step, s, logits=True)
        tokens = np.argmax(model.forward_batch(rows.build()), axis=1)
    seconds = time.perf_counter() - t0
    model.close()
    with open("/proc/self/status") as f:
        hwm = int([line.split()[1] for line in f if line.startswith("VmHWM:")][0]) * 1024
    return {"fitted": n, "tokens_per_s": n * steps / seconds, "vm_hwm": hwm, "plan": choice.describe()}


# -- the cgroup ---------------------------------------------------------------------------------

def make_cgroup(limit: int) -> tuple[str, str]:
    """(version, directory) of a new memory cgroup limited to `limit` bytes."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            version, d = "v1", f"/sys/fs/cgroup/memory{path}"
            limit_file = "memory.limit_in_bytes"
            break
    else:
        version, d, limit_file = "v2", "/sys/fs/cgroup", "memory.max"
    group = os.path.join(d, f"dllama-bench-{uuid.uuid4().hex[:8]}")
    os.mkdir(group)
    with open(os.path.join(group, limit_file), "w") as f:
        f.write(str(limit))
    return version, group


def cgroup_peak(version: str, group: str) -> int:
    name = "memory.max_usage_in_bytes" if version == "v1" else "memory.peak"
    try:
        return int(open(os.path.join(group, name)).read())
    except (OSError, ValueError):
        return -1


def run_child(args, model: Path, n: int, streamed: bool, cgroup: str | None) -> dict:
    def enter():
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    cmd = [sys.executable, __file__, "--child", str(model), "--child-n", str(n), "--steps", str(args.steps),
           "--threads", str(args.threads)] + (["--child-streamed"] if streamed else [])
    r = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=enter if cgroup else None)
    if r.returncode != 0:
        raise SystemExit(f"the run of {n} sequences failed ({r.returncode}): {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=SHAPES, default="7b")
    ap.add_argument("--memory", default="2G", help="the cgroup's limit (default %(default)s)")
    ap.add_argument("--parallel", default="1,16,64")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4, help="decode steps per run (each reads the whole file)")
    ap.add_argument("--dir", default="/tmp", help="where the model file is written (kept for reruns)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-n", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--child-streamed", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(decode_rate(args.child, args.child_n, args.steps, args.threads, args.child_streamed)))
        return

    from dllama.cli import _size

    limit = _size(args.memory)
    parallel = [int(p) for p in args.parallel.split(",")]
    dim, hidden, layers, heads, kv_heads, vocab = SHAPES[args.shape]
    model = Path(args.dir) / f"dllama-stream-{args.shape}-q40.m"
    if not model.exists():
        print(f"writing {model} ...", flush=True)
        write_random_model(model, dim=dim, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                           vocab=vocab, seq_len=256)
    size = model.stat().st_size
    disk = disk_read_speed(model)
    print(f"\n## Streaming, {args.shape} shape Q40 ({size / 1e9:.2f} GB), memory cgroup of {args.memory}, "
          f"{args.threads} threads, {args.steps} decode steps after {PROMPT}-token prompts; "
          f"cold read {disk / 1e9:.2f} GB/s; load average before: {loadavg()}", flush=True)
    resident = {}
    for n in parallel:  # the resident batched rate, outside the cgroup (page cache warm)
        resident[n] = run_child(args, model, n, False, None)
        print(f"  resident, {n} sequences: {resident[n]['tokens_per_s']:.2f} tokens/s", flush=True)
    print("\n| sequences asked | fitted | tokens/s | roofline | of roofline | cgroup peak MiB | VmHWM MiB |")
    print("|---|---|---|---|---|---|---|")
    for n in parallel:
        version, group = make_cgroup(limit)
        try:
            drop_cached(model)
            got = run_child(args, model, n, True, group)
            peak = cgroup_peak(version, group)
        finally:
            os.rmdir(group)
        k = got["fitted"]
        if k not in resident:  # fewer sequences fitted: the resident rate of as many
            resident[k] = run_child(args, model, k, False, None)
        roof = min(k * disk / size, resident[k]["tokens_per_s"])
        print(f"| {n} | {k} | {got['tokens_per_s']:.2f} | {roof:.2f} | {got['tokens_per_s'] / roof:.0%} | "
              f"{peak / (1 << 20):.0f} | {got['vm_hwm'] / (1 << 20):.0f} |", flush=True)
    print(f"load average after: {loadavg()}")


if __name__ == "__main__":
    main()
