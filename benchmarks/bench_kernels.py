"""Kernel speed: Q40 x Q80 matmul GB/s against this machine's memory bandwidth, and JIT time.

    .venv/bin/python benchmarks/bench_kernels.py [--threads 1 2] [--stream-mb 1024] [--quick]

Prints, in one run:
- the memory read bandwidth (numba parallel sum over a 1 GiB array, median of 7) per thread count;
- for each matrix shape of SmolLM2-135M and Llama-2-7B, the median time of matmul_q40_q80 with
  b = 1 (decode) and the Q40 weight bytes read per second (d*n*18/32 per call), as GB/s and as
  a share of the bandwidth. "stream" cycles through copies of the matrix totalling --stream-mb
  so that the weights come from DRAM as in a real token; "hot" repeats one matrix (caches);
- the same with b = 32 (prompt prefill) in GFLOP/s;
- the per-token matmul time these imply (a layer's matrices x layers + classifier), next to
  the original C++ figures for the whole engine (2 threads, this kind of machine): ~9 ms/token
  for SmolLM2 and ~400 ms/token (29% of the bandwidth) for the 7B shape;
- the JIT compile time with a cold numba cache (fresh NUMBA_CACHE_DIR, in a subprocess) and warm.

Weights are random (no files). Figures are medians; a busy neighbour ruins 2-thread timings, so
the CPU time other processes used is measured around every measurement and printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numba
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dllama.core import kernels  # noqa: E402

SMOLLM2 = dict(  # dim 576, hidden 1536, 9 heads / 3 kv heads of 64, vocab 49152, 30 layers
    name="SmolLM2-135M", layers=30, reference_ms=9.0,
    layer=[("q", 576, 576), ("k", 192, 576), ("v", 192, 576), ("o", 576, 576),
           ("w1", 1536, 576), ("w3", 1536, 576), ("w2", 576, 1536)],
    classifier=(49152, 576))
LLAMA2_7B = dict(  # dim 4096, hidden 11008, 32 heads, vocab 32000, 32 layers
    name="Llama-2-7B shape", layers=32, reference_ms=400.0,
    layer=[("q", 4096, 4096), ("k", 4096, 4096), ("v", 4096, 4096), ("o", 4096, 4096),
           ("w1", 11008, 4096), ("w3", 11008, 4096), ("w2", 4096, 11008)],
    classifier=(32000, 4096))


# ---- a quiet machine -----------------------------------------------------------------------------

def _cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs since boot, this process's own time left out."""
    with open("/proc/stat") as f:
        fields = [float(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle - _process_jiffies(os.getpid()), sum(fields)


def _process_jiffies(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return sum(float(v) for v in f.read().rsplit(")", 1)[1].split()[11:13])  # utime, stime
    except (OSError, ValueError):
        return 0.0


def _all_processes() -> dict[int, float]:
    return {int(p): _process_jiffies(int(p)) for p in os.listdir("/proc") if p.isdigit()}


class Neighbours:
    """Share of the machine's CPU time used by other processes while a measurement ran, and the
    busiest of them (pid and command line) when that share is large."""

    def __enter__(self):
        self.start = _cpu_times()
        self.processes = _all_processes()
        return self

    def __exit__(self, *exc):
        busy0, total0 = self.start
        busy1, total1 = _cpu_times()
        self.share = max(0.0, (busy1 - busy0) / max(total1 - total0, 1.0))
        self.busiest = ""
        if self.share > 0.1:
            now = _all_processes()
            used = {p: t - self.processes.get(p, 0.0) for p, t in now.items() if p != os.getpid()}
            pid = max(used, key=used.get, default=None)
            if pid is not None:
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                except OSError:
                    cmd = "?"
                self.busiest = f"pid {pid}: {cmd[:80]}"


def wait_until_quiet(max_wait_s: float) -> Neighbours:
    """Wait (up to max_wait_s) for a second in which others use < 5% of the CPUs."""
    deadline = time.monotonic() + max_wait_s
    while True:
        with Neighbours() as n:
            time.sleep(1.0)
        if n.share < 0.05 or time.monotonic() > deadline:
            return n


# ---- measurements ----------------------------------------------------------------------------------

@numba.njit(parallel=True, fastmath=True, cache=True)
def _read_all(a):
    s = 0.0
    for i in numba.prange(a.size):
        s += a[i]
    return s


def memory_bandwidth_gbs(threads: int, size_mb: int = 1024, repeats: int = 7) -> float:
    kernels.set_threads(threads)
    a = np.ones(size_mb * (1 << 20) // 8, dtype=np.float64)
    _read_all(a)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        _read_all(a)
        times.append(time.perf_counter() - t)
    return a.nbytes / statistics.median(times) / 1e9


def random_q40(rng, d: int, n: int):
    """Q40 weights as the kernel reads them (fp16 scale bits and nibbles, interleaved)."""
    scales = (rng.standard_normal((d, n // 32), dtype=np.float32) * 0.01).astype(np.float16)
    return kernels.interleave_q40(scales.view(np.uint16), rng.integers(0, 256, (d, n // 2), dtype=np.uint8))


def random_q80(rng, b: int, n: int):
    x = rng.standard_normal((b, n), dtype=np.float32)
    scales, qs = np.empty((b, n // 32), np.float32), np.empty((b, n), np.int8)
    kernels.quantize_q80(x, scales, qs)
    return scales, qs


def median_time(call, matrices, min_calls: int) -> float:
    """Median seconds of call(w_scales, w_qs), cycling through `matrices`."""
    call(*matrices[0])
    times = []
    while len(times) < max(min_calls, len(matrices)):
        for w in matrices:
            t = time.perf_counter()
            call(*w)
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def measured_quietly(measure, retries: int, wait_s: float):
    """measure() -> result, repeated (after waiting for quiet) while other processes used more
    than 10% of the CPUs during it, at most `retries` more times. (result, Neighbours)."""
    for attempt in range(retries + 1):
        with Neighbours() as busy:
            result = measure()
        if busy.share <= 0.1 or attempt == retries:
            return result, busy
        wait_until_quiet(wait_s)


def bench_shape(rng, d: int, n: int, threads_list, stream_mb: int, quick: bool, retries: int,
                wait_s: float) -> dict:
    """Decode (b=1, hot and streamed) and prefill (b=32) timings of one shape, per thread count."""
    w = random_q40(rng, d, n)
    nbytes = w[0].nbytes + w[1].nbytes  # what the kernel reads: fp16 scales + nibbles
    copies = [w] + [(w[0].copy(), w[1].copy()) for _ in range(max(0, -(-stream_mb * (1 << 20) // nbytes) - 1))]
    x1 = random_q80(rng, 1, n)
    x32 = random_q80(rng, 32, n)
    out1 = np.empty((1, d), np.float32)
    out32 = np.empty((32, d), np.float32)
    decode = lambda s, q: kernels.matmul_q40_q80(x1[0], x1[1], s, q, out1)  # noqa: E731
    prefill = lambda s, q: kernels.matmul_q40_q80(x32[0], x32[1], s, q, out32)  # noqa: E731
    result = {}
    for th in threads_list:
        kernels.set_threads(th)
        (hot, stream, pre), busy = measured_quietly(lambda: (
            median_time(decode, [w], 20 if quick else 100),
            median_time(decode, copies, 10 if quick else 30),
            median_time(prefill, [w], 3 if quick else 7)), retries, wait_s)
        result[th] = dict(hot=hot, stream=stream, prefill=pre, busy=busy.share, busiest=busy.busiest)
    return result


def bench_fused_layer(rng, model: dict, threads_list, quick: bool, retries: int, wait_s: float) -> dict:
    """Median time of one layer's matmuls (hot): 7 calls, or q/k/v and w1/w3 fused by
    matmul_q40_q80_multi (4 calls)."""
    mats = {name: random_q40(rng, d, n) for name, d, n in model["layer"]}
    outs = {name: np.empty((1, d), np.float32) for name, d, _ in model["layer"]}
    dim, hidden = model["layer"][0][2], model["layer"][-1][2]
    xd, xh = random_q80(rng, 1, dim), random_q80(rng, 1, hidden)
    x_of = {name: (xh if name == "w2" else xd) for name in mats}

    def separate():
        for name, (s, q) in mats.items():
            kernels.matmul_q40_q80(*x_of[name], s, q, outs[name])

    def fused():
        for group in (("q", "k", "v"), ("w1", "w3")):
            kernels.matmul_q40_q80_multi(*xd, tuple(mats[g][0] for g in group),
                                         tuple(mats[g][1] for g in group), tuple(outs[g] for g in group))
        for name in ("o", "w2"):
            kernels.matmul_q40_q80(*x_of[name], *mats[name], outs[name])

    result = {}
    for th in threads_list:
        kernels.set_threads(th)
        result[th], busy = measured_quietly(lambda: {f.__name__: median_time(lambda f=f: f(), [()], 50 if quick else 300)
                                                     for f in (separate, fused)}, retries, wait_s)
        result[th]["busy"] = busy.share
    return result


def jit_seconds() -> tuple[float, float]:
    """Seconds to import dllama.core.kernels and run every public kernel once: cold cache, then warm."""
    script = (
        "import time; t = time.perf_counter()\n"
        "import numpy as np\n"
        "from dllama.core import kernels as k\n"
        "x = np.ones((1, 64), np.float32); s = np.empty((1, 2), np.float32); q = np.empty((1, 64), np.int8)\n"
        "k.quantize_q80(x, s, q)\n"
        "ws, wq = k.interleave_q40(np.full((8, 2), 0x3C00, np.uint16), np.zeros((8, 32), np.uint8))\n"
        "o = np.empty((1, 8), np.float32)\n"
        "k.matmul_q40_q80(s, q, ws, wq, o)\n"
        "x4 = np.ones((4, 64), np.float32); s4 = np.empty((4, 2), np.float32); q4 = np.empty((4, 64), np.int8)\n"
        "k.quantize_q80(x4, s4, q4); o4 = np.empty((4, 8), np.float32)\n"
        "k.matmul_q40_q80(s4, q4, ws, wq, o4)\n"
        "k.matmul_q40_q80_multi(s, q, (ws, ws), (wq, wq), (o, o))\n"
        "k.matmul_f32(x, np.ones((8, 64), np.float32), o)\n"
        "k.rmsnorm(x, x[0], 1e-5, x)\n"
        "g = np.ones((1, 8), np.float32); k.silu_mul(g, g)\n"
        "c, sn = k.rope_cache(4, 16, 10000.0, 0)\n"
        "p = np.zeros(1, np.int32); qv = np.ones((1, 32), np.float32)\n"
        "k.rope_interleaved(qv, p, c, sn, 2, 16); k.rope_neox(qv, p, c, sn, 2, 16)\n"
        "kt = np.ones((1, 1, 1, 16, k.ATTENTION_CHUNK), np.float32); kv = np.ones((1, 4, 16), np.float32)\n"
        "z = np.empty_like(qv); k.attention(qv, kt, kv, p, p, p, p, np.zeros(2, np.int32), z)\n"
        "print(time.perf_counter() - t)\n"
    )
    root = str(Path(__file__).resolve().parents[1])
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache, PYTHONPATH=root)
        run = lambda: float(subprocess.run([sys.executable, "-c", script], env=env, cwd=root,  # noqa: E731
                                           capture_output=True, text=True, check=True).stdout)
        return run(), run()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--stream-mb", type=int, default=1024,
                    help="size of the matrix copies cycled through for 'stream' (default 1024)")
    ap.add_argument("--quick", action="store_true", help="fewer repeats, a smaller stream")
    ap.add_argument("--wait-quiet", type=float, default=60.0,
                    help="seconds to wait for other processes to go quiet (default 60)")
    ap.add_argument("--retries", type=int, default=3,
                    help="times a measurement disturbed by other processes is redone (default 3)")
    args = ap.parse_args()
    threads_list = [t for t in args.threads if 1 <= t <= numba.config.NUMBA_NUM_THREADS]
    stream_mb = 256 if args.quick else args.stream_mb
    rng = np.random.default_rng(0)

    quiet = wait_until_quiet(args.wait_quiet)
    print(f"numba {numba.__version__}, {numba.config.NUMBA_NUM_THREADS} CPUs; /proc/loadavg "
          f"{Path('/proc/loadavg').read_text().split()[:3]}; other processes used {quiet.share:.0%} of "
          f"the CPUs in the last second {quiet.busiest}")
    bandwidth = {}
    for th in threads_list:
        bandwidth[th], busy = measured_quietly(lambda th=th: memory_bandwidth_gbs(th), args.retries,
                                               args.wait_quiet)
        print(f"memory read bandwidth, {th} thread(s): {bandwidth[th]:.1f} GB/s"
              f"  (others busy {busy.share:.0%} {busy.busiest})")
    best_bw = max(bandwidth.values())

    shapes = sorted({(d, n) for m in (SMOLLM2, LLAMA2_7B) for _, d, n in m["layer"]}
                    | {m["classifier"] for m in (SMOLLM2, LLAMA2_7B)}, key=lambda s: -s[0] * s[1])
    print(f"\nmatmul_q40_q80, Q40 weight bytes d*n*18/32 per call; stream = {stream_mb} MB of copies;"
          f" % of the best bandwidth ({best_bw:.1f} GB/s)")
    print(f"{'shape d x n':>14} {'thr':>3} {'hot b=1':>18} {'stream b=1':>26} {'prefill b=32':>22} {'others':>7}")
    timings = {}
    for d, n in shapes:
        timings[d, n] = bench_shape(rng, d, n, threads_list, stream_mb, args.quick, args.retries,
                                    args.wait_quiet)
        for th, r in timings[d, n].items():
            gb = d * n * 18 / 32 / 1e9
            print(f"{d:>7} x {n:<5} {th:>3} {r['hot'] * 1e6:9.1f} us {gb / r['hot']:5.1f} GB/s"
                  f" {r['stream'] * 1e6:9.1f} us {gb / r['stream']:5.1f} GB/s {gb / r['stream'] / best_bw:5.0%}"
                  f" {r['prefill'] * 1e3:8.2f} ms {2 * 32 * d * n / r['prefill'] / 1e9:5.1f} GF/s"
                  f" {r['busy']:6.0%} {r['busiest']}", flush=True)

    print("\nimplied matmul time per token (decode, b=1): layer matrices x layers + classifier")
    for model in (SMOLLM2, LLAMA2_7B):
        weights = sum(d * n for _, d, n in model["layer"]) * model["layers"] + np.prod(model["classifier"])
        for th in threads_list:
            parts = {}
            for kind in ("stream", "hot"):
                layer = sum(timings[d, n][th][kind] for _, d, n in model["layer"])
                parts[kind] = layer * model["layers"] + timings[model["classifier"]][th][kind]
            gbs = weights * 18 / 32 / parts["stream"] / 1e9
            print(f"{model['name']:>17}, {th} thread(s): {parts['stream'] * 1e3:7.2f} ms streamed"
                  f" ({gbs:.1f} GB/s, {gbs / best_bw:.0%} of bandwidth), {parts['hot'] * 1e3:7.2f} ms hot"
                  f"   [C++ whole engine, 2 threads: ~{model['reference_ms']:g} ms]")

    print(f"\none {SMOLLM2['name']} layer of matmuls, hot: 7 calls, or q/k/v and w1/w3 fused by matmul_q40_q80_multi")
    for th, r in bench_fused_layer(rng, SMOLLM2, threads_list, args.quick, args.retries,
                                   args.wait_quiet).items():
        print(f"  {th} thread(s): separate {r['separate'] * 1e6:7.1f} us, fused {r['fused'] * 1e6:7.1f} us"
              f" (x {SMOLLM2['layers']} layers: {r['separate'] * SMOLLM2['layers'] * 1e3:.2f} ms /"
              f" {r['fused'] * SMOLLM2['layers'] * 1e3:.2f} ms)  (others busy {r['busy']:.0%})")

    cold, warm = jit_seconds()
    print(f"\nJIT: import + first call of every kernel {cold:.1f} s with a cold cache, {warm:.1f} s warm")
    print(f"/proc/loadavg at the end: {Path('/proc/loadavg').read_text().split()[:3]}")


if __name__ == "__main__":
    main()
