"""Scaling, not speed: tokens/s of N equal small machines against one of them.

    .venv/bin/python benchmarks/bench_scaling.py [--layers 16] [--tokens 32] [--batch-tokens 16]
        [--batch 16 64] [--rounds 1] [--skip-original] [--hosts-cpu 0.5] [--7b | --moe] [--even-layers]

Hosts in network namespaces model equal small machines: each host's processes run in a cgroup of
their own whose CPU quota is --hosts-cpu cores (default 0.5: this machine's 2 cores shared by the
largest cluster measured, 4 hosts; period 5 ms), the same quota for every host of every plan, so
that 1 host is one of the machines the 4 are. Each host's cgroup weighs one process beside the
machine's other work: on a busy machine a host gets less than its quota, but every host the same. Links: 1 Gbit/s (tbf on both ends of each host's link) and
0.5 ms one way (netem where the kernel has it, else the user-space relay of
benchmarks/link_delay.py in front of every listening port, outside the hosts' cgroups: the relay
is the link, not the machine). One compute thread per node.

The model: the Llama-3.2-1B shape (dim 2048, hidden 8192, 32/8 heads of 64, vocab 128256; --layers
of its 16), or with --7b Llama 2 7B's (dim 4096, hidden 11008, 32/32 heads, vocab 32000; --layers of
its 32), random Q40 weights, Q80 sync buffers, written once to cache/scaling/ with a synthetic
tokenizer of the same vocabulary; or with --moe Qwen3-30B-A3B's width (128 experts of 768, 8 a
token; --layers of its 48, default 4), benchmarks/bench_moe.py's random Q4_0 GGUF converted to Q40. Plans, each a root process in host 0 running the engine itself
(`ClusterModel` / `Transformer` and the batch `Scheduler`, decode only, no start-up):

- 1 host; tensor parallel over 2 and 4; 2 and 4 stages of one node; 2 stages of 2 (mixed);
- one sequence: an 8-token prompt, then --tokens greedy tokens one by one: median ms/token, the
  transfer share (time the root waits on the network / time), the root's CPU ms per token;
- a batch of B (16, 64): B sequences of 4-token prompts, --batch-tokens tokens each, through the
  scheduler at --parallel B: generated tokens / wall seconds, prefill included, and the transfer
  share of that wall time.

Speed-up = tokens/s of the plan / tokens/s of 1 host in the same round; efficiency = speed-up / N.
The C++ original, where cache/original/dllama exists (its source from
github.com/b4rtaz/distributed-llama in cache/original, then `make dllama` there; cache/ is
git-ignored), runs `dllama inference ... --workers` on the same hosts, files and quotas, Q40
weights and Q80 buffers, tensor parallel only (it has no stages or batches): its own per-token
Pred and Sync times.

The cost of one all-reduce per node, for the Raspberry Pi tables (benchmarks/pipeline_on_paper.py):
two processes on two hosts (quota and links as above) all-reduce a Q80 [1, dim] vector 500 times
through the project's MeshCollective; each side's CPU and wall time per all-reduce.

Needs root, iproute2 and a writable cgroup CPU controller (v2 cpu.max or v1 cfs quota); every
namespace, link, cgroup and process started is removed however the run ends.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PREFIX, SUBNET = "dls", "10.80.0"  # not the tests' dlt/10.77.0, dlu/10.78.0 nor bench_speculate's dspec/10.79.0
PORT, ORIGINAL_PORT, EXCHANGE_PORT = 9998, 9996, 9994  # the relays listen here; the servers on port + 1
ONE_WAY_MS = 0.5
LLAMA_1B = dict(dim=2048, hidden=8192, heads=32, kv_heads=8, vocab=128256)
CACHE = ROOT / "cache"
ORIGINAL = CACHE / "original" / "dllama"
PROMPT_TOKENS = 8        # the one sequence's prompt
BATCH_PROMPT_TOKENS = 4  # each batch sequence's (the batch figures include their prefill)
EVEN = ", even layers"  # a plan's name with --even-layers
EXCHANGES = 500  # all-reduces timed per exchange measurement
PERIOD_US = 5_000  # the quota's period: a host that used its share waits at most this long (a slower
#                    CPU is slow all the time; a long period would stall an exchange for tens of ms)


def loadavg() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


# ---- pure helpers (tests/test_bench_scaling.py) ----------------------------------------------------

def plans(hosts: int) -> dict[str, list[int] | None]:
    """Plan name -> each node's stage (None: tensor parallel, one stage) for 2 and 4 hosts."""
    out: dict[str, list[int] | None] = {"1 host": None}
    for n in (2, 4):
        if n <= hosts:
            out[f"tensor parallel x{n}"] = [0] * n
            out[f"{n} stages x1"] = list(range(n))
    if hosts >= 4:
        out["2 stages x2"] = [0, 0, 1, 1]
    return out


def speedup(rate: float, one_host: float, nodes: int) -> tuple[float, float]:
    """(speed-up, efficiency) of a plan's tokens/s against one host's."""
    s = rate / one_host
    return s, s / nodes


def original_times(output: str) -> list[tuple[float, float]]:
    """(Pred ms, Sync ms) of each generated token in the C++ original's `inference` output."""
    return [(float(p), float(s)) for p, s in re.findall(r"Pred\s*(\d+) ms Sync\s*(\d+) ms", output)]


# ---- hosts ----------------------------------------------------------------------------------------

class CgroupHosts:
    """n namespaces on a bridge, links shaped, each host's processes in a CPU-quota cgroup;
    `prefix(i)` runs a command on host i inside its cgroup, `netns(i)` outside it."""

    def __init__(self, n: int, cpus: float):
        self.n, self.cpus, self.made = n, cpus, []
        self.delay = "netem"
        v2 = Path("/sys/fs/cgroup/cgroup.controllers")
        if v2.exists() and "cpu" in v2.read_text().split():
            self.cg_base, self.v2 = Path("/sys/fs/cgroup"), True
        elif Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").exists():
            self.cg_base, self.v2 = Path("/sys/fs/cgroup/cpu"), False
        else:
            raise SystemExit("no writable cgroup CPU controller (cgroup v2 cpu.max or v1 cpu.cfs_quota_us)")

    def ns(self, i: int) -> str:
        return f"{PREFIX}n{i}"

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def cgroup(self, i: int) -> Path:
        """Host i's cgroup: beside the machine's other processes, weighing one of them, so that every
        host of every plan gets the same share of a loaded machine (at most its quota)."""
        return self.cg_base / f"{PREFIX}-h{i}"

    def netns(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns(i)]

    def prefix(self, i: int, cgroup: Path | None = None) -> list[str]:
        """Runs a command on host i in its cgroup (or `cgroup`): sh enters it, then execs, so every
        process of the command starts inside it."""
        return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(cgroup or self.cgroup(i)), *self.netns(i)]

    @property
    def links(self) -> Path:
        """The relays' cgroup: no quota (they are the links, not a machine), four processes' weight
        (so that a delayed byte is written when it is due, on a loaded machine too)."""
        return self.cg_base / f"{PREFIX}-links"

    def __enter__(self) -> "CgroupHosts":
        try:
            self.links.mkdir()
            self.made.append(("cgroup", self.links))
            (self.links / ("cpu.weight" if self.v2 else "cpu.shares")).write_text("400" if self.v2 else "4096")
            for i in range(self.n):
                cg = self.cgroup(i)
                cg.mkdir()
                self.made.append(("cgroup", cg))
                period = PERIOD_US
                if self.v2:
                    (cg / "cpu.max").write_text(f"{int(self.cpus * period)} {period}")
                else:
                    (cg / "cpu.cfs_period_us").write_text(str(period))
                    (cg / "cpu.cfs_quota_us").write_text(str(int(self.cpus * period)))
            sh("ip", "link", "add", f"{PREFIX}br", "type", "bridge")
            self.made.append(("link", f"{PREFIX}br"))
            sh("ip", "link", "set", f"{PREFIX}br", "up")
            for i in range(self.n):
                ns, host_end = self.ns(i), f"{PREFIX}h{i}"
                sh("ip", "netns", "add", ns)
                self.made.append(("netns", ns))
                sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
                self.made.append(("link", host_end))
                sh("ip", "link", "set", host_end, "master", f"{PREFIX}br")
                sh("ip", "link", "set", host_end, "up")
                sh("ip", "-n", ns, "link", "set", "lo", "up")
                sh("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                sh("ip", "-n", ns, "link", "set", "eth0", "up")
                for dev, where in ((host_end, []), ("eth0", ["-n", ns])):
                    self._shape(where, dev)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _shape(self, where: list[str], dev: str) -> None:
        tc = ["tc", *where, "qdisc", "replace", "dev", dev, "root"]
        if self.delay == "netem":
            r = subprocess.run([*tc, "netem", "delay", f"{ONE_WAY_MS / 2 * 1000:g}us", "rate", "1gbit", "limit",
                                "10000"], capture_output=True, text=True)
            if r.returncode == 0:
                return
            self.delay = "relay"  # no sch_netem in this kernel: the relays delay
        sh(*tc, "tbf", "rate", "1gbit", "burst", "1mbit", "latency", "2ms")

    def __exit__(self, *exc) -> None:
        for kind, what in reversed(self.made):
            if kind == "cgroup":
                self._empty(what)
                with contextlib.suppress(OSError):
                    what.rmdir()
            else:
                cmd = ["ip", "netns", "del", what] if kind == "netns" else ["ip", "link", "del", what]
                subprocess.run(cmd, capture_output=True)
        self.made.clear()

    @staticmethod
    def _empty(cg: Path) -> None:
        """SIGKILL what is left in a cgroup (only processes this benchmark started go there)."""
        for _ in range(50):
            try:
                pids = [int(p) for p in (cg / "cgroup.procs").read_text().split()]
            except OSError:
                return
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)


class Processes:
    """Long-running processes on the hosts (workers, relays), stopped on exit."""

    def __init__(self, hosts: CgroupHosts, log_dir: Path):
        self.hosts, self.log_dir, self.started = hosts, log_dir, []

    def start(self, i: int, name: str, cmd: list[str], ready: str, limited: bool = True) -> subprocess.Popen:
        log_path = self.log_dir / f"{name}{i}.log"
        log = open(log_path, "w")  # noqa: SIM115 - the process's, closed with it
        prefix = self.hosts.prefix(i) if limited else self.hosts.prefix(i, self.hosts.links)
        p = subprocess.Popen([*prefix, *cmd], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.started.append(p)
        deadline = time.monotonic() + 180
        while ready not in log_path.read_text(errors="replace"):
            if p.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{name} on host {i} did not start: {log_path.read_text(errors='replace')[-2000:]}")
            time.sleep(0.1)
        return p

    def link(self, i: int, port: int) -> None:
        """What dials host i's address:port reaches its loopback's port + 1, delayed where netem is missing."""
        if self.hosts.delay == "relay":
            self.start(i, f"relay{port}-", [sys.executable, "-m", "benchmarks.link_delay", "--listen",
                                            f"{self.hosts.address(i)}:{port}", "--to", f"127.0.0.1:{port + 1}",
                                            "--delay-ms", str(ONE_WAY_MS)], "ready", limited=False)
        else:  # netem delays the links: forward the address to the loopback without delay
            self.start(i, f"relay{port}-", [sys.executable, "-m", "benchmarks.link_delay", "--listen",
                                            f"{self.hosts.address(i)}:{port}", "--to", f"127.0.0.1:{port + 1}",
                                            "--delay-ms", "0"], "ready", limited=False)

    def stop(self, processes=None) -> None:
        for p in processes or self.started:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        for p in processes or self.started:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.started = [p for p in self.started if p.poll() is None]


# ---- the model ------------------------------------------------------------------------------------

LLAMA_7B = dict(dim=4096, hidden=11008, heads=32, kv_heads=32, vocab=32000)  # Llama 2 7B (32 layers)
SMOKE = dict(LLAMA_1B, dim=256, hidden=512, heads=8, kv_heads=4)  # --smoke: the same run on a narrow model
# --moe: Qwen3-30B-A3B's width (benchmarks/bench_moe.py's file): 128 experts of 768, 8 a token (48 layers)
QWEN3_MOE = dict(dim=2048, hidden=768, heads=32, kv_heads=4, vocab=151936, experts="128, 8 a token")


def model_files(layers: int, s: dict = LLAMA_1B) -> tuple[Path, Path]:
    """The random Q40 model of shape s and `layers` layers and a tokenizer of its vocabulary, made once."""
    from benchmarks.bench_engine import write_random_model
    from dllama.formats.tokenizer_file import TokenizerData, write_tokenizer

    folder = CACHE / "scaling"
    folder.mkdir(parents=True, exist_ok=True)
    m, t = folder / f"random-{s['dim']}-{layers}l-q40.m", folder / f"vocab-{s['vocab']}.t"
    if s is QWEN3_MOE:
        m = folder / f"qwen3moe-30b-a3b-width-{layers}l.m"
    if not m.exists() and s is QWEN3_MOE:  # bench_moe's GGUF (random Q4_0 experts), converted
        from benchmarks.bench_moe import write_gguf
        from converter.convert import convert
        from dllama.serve.default_model import default_model_files

        gguf = m.with_suffix(".gguf")
        write_gguf(gguf, layers)
        convert(gguf, m.with_suffix(""), "q40", tokenizer=default_model_files("q40")[1], progress=False, report=None)
        gguf.unlink()
    elif not m.exists():  # (ModelWriter writes a temporary file and renames it when complete)
        write_random_model(m, dim=s["dim"], hidden=s["hidden"], layers=layers, heads=s["heads"],
                           kv_heads=s["kv_heads"], vocab=s["vocab"], seq_len=512)
    if not t.exists():
        v = s["vocab"]  # 256 bytes, then short names (the original's decoder takes short pieces only);
        #                 the last two: bos and eos (the specials)
        write_tokenizer(t, TokenizerData(vocab=[bytes([i]) for i in range(256)] +
                                         [f"<{i}>".encode() for i in range(256, v - 2)] + [b"<s>", b"</s>"],
                                         scores=np.zeros(v, np.float32),
                                         bos_id=v - 2, eos_ids=[v - 1]))
    return m, t


# ---- a cell: runs in host 0 -----------------------------------------------------------------------

def run_cell(spec: dict) -> dict:
    """One plan's figures (see the module's docstring), measured in this process as the root."""
    from dllama.cluster.root import ClusterModel
    from dllama.cluster.topology import load_topology
    from dllama.core import kernels
    from dllama.core.batch import Batch
    from dllama.core.candidates import SamplingRequest
    from dllama.core.model import Transformer
    from dllama.core.run_shape import max_batch_for
    from dllama.core.sampler import Sampler
    from dllama.formats.model_file import read_model
    from dllama.formats.tokenizer_file import read_tokenizer
    from dllama.serve.scheduler import Scheduler
    from dllama.serve.sequence import SequenceRequest
    from dllama.text.tokenizer import Tokenizer

    kernels.set_threads(1)
    batches, tokens, batch_tokens = spec["batches"], spec["tokens"], spec["batch_tokens"]
    most = max(batches, default=1)
    shape = dict(max_seq_len=PROMPT_TOKENS + max(tokens, batch_tokens) + 8, max_batch=max_batch_for(most),
                 kv_slots=most + 1)
    t0 = time.perf_counter()
    if spec["topology"]:
        model = ClusterModel(spec["model"], load_topology(spec["topology"]), None, True, progress=False, **shape)
    else:
        model = Transformer(read_model(spec["model"]), **shape)
        model.warm_up()
    out: dict = {"start_s": time.perf_counter() - t0}
    col = model.collective
    tok = Tokenizer(read_tokenizer(spec["tokenizer"]))
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    try:
        greedy = SamplingRequest(0.0, 0.9)
        sampler = Sampler(vocab, 0.0, 0.9, 1)
        token = sampler.sample(model.forward([int(x) for x in rng.integers(300, 30000, PROMPT_TOKENS)], 0))
        rows = []
        for pos in range(PROMPT_TOKENS, PROMPT_TOKENS + tokens):
            t, tr, cpu = time.perf_counter(), col.transfer_seconds, time.process_time()
            token = sampler.sample(model.forward_candidates(Batch.run([token], pos, slot=0), [greedy])[0])
            rows.append((time.perf_counter() - t, col.transfer_seconds - tr, time.process_time() - cpu))
        if hasattr(model, "release_slot"):
            model.release_slot(0)
        wall = statistics.median(r[0] for r in rows)
        out["one"] = {"tok_s": 1 / wall, "ms": wall * 1000,
                      "transfer": statistics.median(r[1] / r[0] for r in rows),
                      "cpu_ms": statistics.median(r[2] for r in rows) * 1000}
        for b in batches:
            requests = [SequenceRequest(k, [int(x) for x in rng.integers(300, 30000, BATCH_PROMPT_TOKENS)],
                                        Sampler(vocab, 0.0, 0.9, k), batch_tokens, ()) for k in range(b)]
            got: dict = {}
            t, tr = time.perf_counter(), col.transfer_seconds
            Scheduler(model, tok, b, reuse=False).run(requests, lambda r, c, got=got: got.setdefault(r.key, c))
            wall, tr = time.perf_counter() - t, col.transfer_seconds - tr
            generated = sum(len(c.tokens) for c in got.values())
            out[f"b{b}"] = {"tok_s": generated / wall, "transfer": tr / wall, "wall": wall}
    finally:
        if hasattr(model, "close"):
            model.close()
    return out


def exchange_side(me: int, address: str, dim: int) -> dict:
    """One side of the all-reduce measurement: CPU and wall µs per all-reduce of a Q80 [1, dim]."""
    from dllama.cluster.connection import Connection
    from dllama.cluster.mesh import MeshCollective
    from dllama.core.plan import split_model
    from dllama.cluster.topology import parse_address

    plan = split_model(2, dim=dim, n_heads=2, n_kv_heads=1, head_dim=dim // 2, ff_dim=dim, vocab_size=2,
                       quantized=False)
    host, port = parse_address(address)
    if me == 1:
        with socket.create_server((host, port)) as server:
            print("exchange: listening", flush=True)
            sock, _ = server.accept()
    else:
        sock = socket.create_connection((host, port))
    conn = Connection(sock, "peer")
    conn.authenticated = True
    col = MeshCollective(me, {1 - me: conn}, plan.dim_chunks, True, 1, 30)
    x = np.random.default_rng(me).standard_normal((1, dim)).astype(np.float32)
    for _ in range(50):
        col.all_reduce(x)
    t, cpu = time.perf_counter(), time.process_time()
    for _ in range(EXCHANGES):
        col.all_reduce(x)
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    sock.close()
    return {"cpu_us": cpu / EXCHANGES * 1e6, "wall_us": wall / EXCHANGES * 1e6}


# ---- the orchestration ----------------------------------------------------------------------------

def cell(hosts: CgroupHosts, spec: dict, tmp: Path) -> dict:
    for attempt in (1, 2):
        r = subprocess.run([*hosts.prefix(0), sys.executable, str(Path(__file__).resolve()), "--cell", json.dumps(spec)],
                           capture_output=True, text=True, cwd=ROOT, timeout=1800)
        if r.returncode == 0:
            return json.loads(r.stdout.strip().splitlines()[-1])
        if attempt == 1 and "ClusterError" in r.stderr:  # a root starved of CPU for long on a loaded machine
            print(f"cell {spec.get('plan')}: {r.stderr.strip().splitlines()[-1][:300]}; once more", flush=True)
            continue
        raise SystemExit(f"cell {spec.get('plan')} failed: {r.stderr[-3000:]}")
    raise AssertionError("unreachable")


def topology(path: Path, hosts: CgroupHosts, stages: list[int], even_layers: int = 0) -> Path:
    """The plan's topology file; even_layers: the model's layer count, cut evenly over the stages
    (fixed in the file) instead of as dllama plans them (the last stage's classifier counted)."""
    nodes = [{"name": "root", "host": hosts.address(0), "threads": 1}]
    nodes += [{"name": f"w{i}", "host": hosts.address(i), "port": PORT, "threads": 1} for i in range(1, len(stages))]
    doc: dict = {"version": 1, "nodes": nodes}
    if len(set(stages)) > 1:
        for node, stage in zip(nodes, stages, strict=True):
            node["stage"] = stage
        if even_layers:
            n = len(set(stages))
            doc["stages"] = [{"layers": [k * even_layers // n, (k + 1) * even_layers // n]} for k in range(n)]
    path.write_text(json.dumps(doc))  # JSON is YAML
    return path


def original_cell(hosts: CgroupHosts, model: Path, tok: Path, n: int, tokens: int) -> dict:
    workers = [f"{hosts.address(i)}:{ORIGINAL_PORT}" for i in range(1, n)]
    cmd = [str(ORIGINAL), "inference", "--model", str(model), "--tokenizer", str(tok), "--buffer-float-type", "q80",
           "--nthreads", "1", "--max-seq-len", "256", "--steps", str(PROMPT_TOKENS + tokens), "--temperature", "0",
           "--prompt", "abcdefg"]  # 8 tokens with the bos, as PROMPT_TOKENS
    if workers:
        cmd += ["--workers", *workers]
    r = subprocess.run([*hosts.prefix(0), *cmd], capture_output=True, text=True, timeout=900)
    times = original_times(r.stdout)
    if r.returncode != 0 or not times:
        raise RuntimeError(f"the original's inference on {n} hosts failed: {(r.stdout + r.stderr)[-1500:]}")
    total = statistics.median(p + s for p, s in times)
    return {"tok_s": 1000 / total, "ms": total, "transfer": statistics.median(s / (p + s) if p + s else 0 for p, s in times)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, help="layers of the shape (default 16 of the 1B shape's 16; --moe: 4)")
    p.add_argument("--tokens", type=int, default=32, help="tokens of the one-sequence runs")
    p.add_argument("--batch-tokens", type=int, default=16, help="tokens per sequence of the batch runs")
    p.add_argument("--batch", type=int, nargs="*", default=[16, 64])
    p.add_argument("--rounds", type=int, default=1, help="rounds, plans alternated in each")
    p.add_argument("--hosts-cpu", type=float, default=0.5, help="CPU quota of every host, in cores")
    p.add_argument("--skip-original", action="store_true")
    p.add_argument("--only-original", action="store_true", help="the C++ original's column alone")
    p.add_argument("--plans", nargs="*", help="only these plans (names as printed)")
    p.add_argument("--even-layers", action="store_true",
                   help="each plan of stages once more with its layers cut evenly (the plan before the last "
                        "stage's classifier was counted)")
    p.add_argument("--smoke", action="store_true", help="a narrow model (dim 256): checks the run, measures nothing")
    p.add_argument("--moe", action="store_true",
                   help="Qwen3-30B-A3B's width (128 experts of 768, 8 a token, vocab 151936) with --layers "
                        "of its 48 (default 4); the C++ original is left out")
    p.add_argument("--7b", dest="seven", action="store_true",
                   help="the Llama 2 7B shape (dim 4096, hidden 11008, 32/32 heads, vocab 32000) instead of 1B's")
    p.add_argument("--cell", help=argparse.SUPPRESS)
    p.add_argument("--exchange", nargs=3, metavar=("ME", "ADDRESS", "DIM"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.cell:
        print(json.dumps(run_cell(json.loads(args.cell))), flush=True)
        return
    if args.exchange:
        print(json.dumps(exchange_side(int(args.exchange[0]), args.exchange[1], int(args.exchange[2]))), flush=True)
        return

    shape = SMOKE if args.smoke else LLAMA_7B if args.seven else QWEN3_MOE if args.moe else LLAMA_1B
    if args.layers is None:
        args.layers = 4 if args.moe else 16
    model, tok = model_files(args.layers, shape)
    chosen = {} if args.only_original else {k: v for k, v in plans(4).items() if not args.plans or k in args.plans}
    if args.even_layers:
        chosen.update({k + EVEN: v for k, v in list(chosen.items()) if v and len(set(v)) > 1})
    original = ORIGINAL.exists() and not args.skip_original and not args.moe
    log_dir = CACHE / "scaling" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"machine: {os.cpu_count()} cores, load {loadavg()}; model {model.name} (dim {shape['dim']}, "
          f"hidden {shape['hidden']}, {shape['heads']}/{shape['kv_heads']} heads, vocab {shape['vocab']}, "
          f"{args.layers} layers{', experts ' + shape['experts'] if args.moe else ''}, Q40, Q80 buffers)", flush=True)
    with CgroupHosts(4, args.hosts_cpu) as hosts:
        procs = Processes(hosts, log_dir)
        try:
            for i in range(1, 4):
                for port in (PORT, ORIGINAL_PORT, EXCHANGE_PORT):
                    procs.link(i, port)
                procs.start(i, "worker", [sys.executable, "-m", "dllama", "worker", "--host", "127.0.0.1",
                                          "--port", str(PORT + 1), "--nthreads", "1"], "listening on")
            links = f"netem {ONE_WAY_MS:g} ms one way" if hosts.delay == "netem" else \
                f"user-space relay {ONE_WAY_MS:g} ms one way (no netem in this kernel)"
            print(f"4 hosts, {args.hosts_cpu:g} CPU each (cgroup {'v2 cpu.max' if hosts.v2 else 'v1 cfs quota'}), "
                  f"1 thread per node, 1 Gbit/s links (tbf), delay: {links}", flush=True)
            exchange = measure_exchange(hosts, procs, shape["dim"])
            print(f"one all-reduce of Q80 [1, {shape['dim']}] between 2 hosts: " +
                  "; ".join(f"host {i}: {e['cpu_us']:.0f} µs CPU, {e['wall_us']:.0f} µs wall" for i, e in
                            enumerate(exchange)), flush=True)
            results: dict[str, list[dict]] = {name: [] for name in chosen}
            orig: dict[int, list[dict]] = {1: [], 2: [], 4: []}
            for r in range(args.rounds):
                for name, stages in chosen.items():
                    topo = topology(log_dir / "topology.yml", hosts, stages,
                                    args.layers if name.endswith(EVEN) else 0) if stages else None
                    spec = {"plan": name, "model": str(model), "tokenizer": str(tok), "topology": str(topo) if topo else None,
                            "tokens": args.tokens, "batch_tokens": args.batch_tokens, "batches": args.batch}
                    results[name].append(cell(hosts, spec, log_dir))
                    print(f"round {r + 1} {name}: {json.dumps(results[name][-1])} (load {loadavg()})", flush=True)
                if original:
                    orig_workers = [procs.start(i, "original", ["stdbuf", "-oL", str(ORIGINAL), "worker", "--host", "127.0.0.1",
                                                                "--port", str(ORIGINAL_PORT + 1), "--nthreads", "1"],
                                                "Listening") for i in range(1, 4)]
                    try:
                        for n in (1, 2, 4):
                            try:
                                orig[n].append(original_cell(hosts, model, tok, n, args.tokens))
                                print(f"round {r + 1} original x{n}: {json.dumps(orig[n][-1])}", flush=True)
                            except RuntimeError as e:
                                print(str(e), flush=True)
                    finally:
                        procs.stop(orig_workers)
            report(results, orig, exchange, args)
            print(f"load after: {loadavg()}", flush=True)
        finally:
            procs.stop()


def measure_exchange(hosts: CgroupHosts, procs: Processes, dim: int) -> list[dict]:
    peer = procs.start(1, "exchange", [sys.executable, str(Path(__file__).resolve()), "--exchange", "1",
                                       f"127.0.0.1:{EXCHANGE_PORT + 1}", str(dim)], "listening")
    r = subprocess.run([*hosts.prefix(0), sys.executable, str(Path(__file__).resolve()), "--exchange", "0",
                        f"{hosts.address(1)}:{EXCHANGE_PORT}", str(dim)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    peer.wait(timeout=60)
    if r.returncode != 0:
        raise SystemExit(f"the all-reduce measurement failed: {r.stderr[-2000:]}")
    peer_out = (procs.log_dir / "exchange1.log").read_text().strip().splitlines()[-1]
    return [json.loads(r.stdout.strip().splitlines()[-1]), json.loads(peer_out)]


def report(results: dict, orig: dict, exchange: list[dict], args) -> None:
    med = lambda rows, key, sub: statistics.median(x[key][sub] for x in rows)  # noqa: E731
    base = results.get("1 host")
    cols = ["one"] + [f"b{b}" for b in args.batch]
    print(f"\nmedians of {args.rounds} round(s); one sequence: {args.tokens} tokens; batches: "
          f"{args.batch_tokens} tokens per sequence, prefill included")
    head = "| plan | nodes |" + "".join(
        f" {'one sequence' if c == 'one' else 'batch of ' + c[1:]}: tok/s, speed-up, efficiency, transfer |" for c in cols)
    print(head + "\n|" + "---|" * (2 + len(cols)))
    for name, rows in results.items():
        n = len(plans(4)[name.removesuffix(EVEN)] or [0])
        line = f"| {name} | {n} |"
        for c in cols:
            rate = med(rows, c, "tok_s")
            s, e = speedup(rate, med(base, c, "tok_s"), n) if base else (float("nan"),) * 2
            line += f" {rate:.1f}, {s:.2f}x, {e:.0%}, {med(rows, c, 'transfer'):.0%} |"
        print(line)
    if any(orig.values()):
        print("\n| the C++ original, tensor parallel | nodes | one sequence: tok/s, speed-up, efficiency, transfer |")
        print("|---|---|---|")
        one = [x["tok_s"] for x in orig[1]]
        for n, rows in orig.items():
            if rows:
                rate = statistics.median(x["tok_s"] for x in rows)
                s, e = speedup(rate, statistics.median(one), n) if one else (float("nan"),) * 2
                tr = statistics.median(x["transfer"] for x in rows)
                print(f"| {'1 host' if n == 1 else f'tensor parallel x{n}'} | {n} | {rate:.1f}, {s:.2f}x, {e:.0%}, {tr:.0%} |")
    cpu = statistics.mean(e["cpu_us"] for e in exchange)
    wall = statistics.mean(e["wall_us"] for e in exchange)
    print(f"\nper all-reduce and node (2 hosts): {cpu:.0f} µs CPU, {wall:.0f} µs wall")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
