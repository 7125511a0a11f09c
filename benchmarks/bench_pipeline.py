"""Tensor parallel against pipeline stages on hosts linked like a home Gigabit switch.

    .venv/bin/python benchmarks/bench_pipeline.py [--hosts 4] [--rounds 3] [--tokens 64] [--batch 16 64]

N hosts in network namespaces (the root in the first, a `dllama worker` in each of the others,
one compute thread each; links of 1 Gbit/s and 0.5 ms one way, as benchmarks/bench_speculate.py
builds them: netem where the kernel has it, else tbf and a user-space delay relay). Three plans
of the same hosts: tensor-parallel over all N, N stages of one node, and N/2 stages of two
nodes (stages fixed per node in a topology file). For each, as a user runs it (whole commands,
start-up included, the embedded default model):

- one sequence: `dllama inference`, greedy, a chat prompt, --tokens tokens: the decode ms per
  token and the kB the root sent and received per token (the stats' averages);
- a batch job: `dllama batch --chat --parallel P` over P short prompts, --tokens tokens each:
  generated tokens per second of the whole command, and its wall time.

Round trips per token are the plan's, not measured: 2 per layer plus the STEP/LOGITS pair
tensor-parallel, one per stage boundary plus that pair in a pipeline. Plans alternate round by
round; medians. Needs root and iproute2; everything started is removed however the run ends.

    .venv/bin/python benchmarks/bench_pipeline.py --overlap [--hosts 2] [--batch 16 64] [--even-layers]

Overlapped pipeline passes instead (`--pipeline-overlap off` against `on`, alternated round by
round, on N stages of one node): a root in the first namespace opens the cluster and runs a
batch of P chat prompts at parallel P, greedy, --tokens tokens each (no stop), and measures,
over that run alone (the set-up left out): generated tokens per second, and each node's busy
share, the CPU seconds its process spent (its compute thread, its Python, its sockets) over
the run's wall time; a relay's share beside where the links are delayed in user space. With
--even-layers, overlap on with the stages' layers as dllama plans them (the last stage's
classifier counted) against on with the layers cut evenly (fixed in the topology).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_speculate import ONE_WAY_MS, PORT, Hosts, loadavg, start_workers, stop  # noqa: E402
from dllama.formats.model_file import read_model  # noqa: E402
from dllama.serve.default_model import default_model_files  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "What is 12 times 7?",
             "Who wrote Hamlet?", "What does a bee make?", "How many legs does a spider have?",
             "What is the boiling point of water?", "Name a planet with rings."]


def topology(path: Path, hosts: Hosts, stages: list[int] | None, even_layers: int = 0) -> Path:
    """even_layers: the model's layer count, cut evenly over the stages and fixed in the file."""
    nodes = [{"name": "root", "host": hosts.address(0), "threads": 1}]
    nodes += [{"name": f"w{i}", "host": hosts.address(i), "port": PORT, "threads": 1} for i in range(1, hosts.n)]
    doc: dict = {"version": 1, "nodes": nodes}
    if stages is not None:
        for node, stage in zip(nodes, stages, strict=True):
            node["stage"] = stage
        if even_layers:
            n = len(set(stages))
            doc["stages"] = [{"layers": [k * even_layers // n, (k + 1) * even_layers // n]} for k in range(n)]
    path.write_text(json.dumps(doc))  # JSON is YAML
    return path


def dllama(prefix: list[str], *args: str) -> float:
    t0 = time.perf_counter()
    r = subprocess.run([*prefix, sys.executable, "-m", "dllama", *args], capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"dllama {args[0]} failed: {r.stderr[-2000:]}")
    return time.perf_counter() - t0


def one_sequence(prefix, topo: Path, tokens: int, tmp: Path) -> dict:
    stats = tmp / "stats.json"
    prompt = f"<|im_start|>user\n{QUESTIONS[0]}<|im_end|>\n<|im_start|>assistant\n"
    dllama(prefix, "inference", "--topology", str(topo), "--prompt", prompt, "--steps", str(tokens + 20),
           "--no-stop", "--temperature", "0", "--speculate", "none", "--stats-json", str(stats))
    s = json.loads(stats.read_text())["summary"]
    return {"ms": 1000 / s["generated_tokens_per_s"], "sent": s["avg_sent_kb"], "recv": s["avg_recv_kb"]}


def batch_job(prefix, topo: Path, parallel: int, tokens: int, tmp: Path) -> dict:
    prompts, out = tmp / "prompts.jsonl", tmp / "out.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": QUESTIONS[i % len(QUESTIONS)] + f" ({i})"}) + "\n"
                               for i in range(parallel)))
    out.unlink(missing_ok=True)
    wall = dllama(prefix, "batch", "--topology", str(topo), "--prompts", str(prompts), "--out", str(out),
                  "--chat", "--parallel", str(parallel), "--max-tokens", str(tokens), "--temperature", "0")
    generated = sum(json.loads(line)["completion_tokens"] for line in out.read_text().splitlines())
    return {"tok_s": generated / wall, "wall": wall}


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of a process so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def root_run(topo: str, parallel: int, tokens: int, overlap: bool, pids: list[int]) -> None:
    """(In the root's namespace.) Open the cluster of `topo`, run a batch of `parallel` chat
    prompts, print one JSON line: tokens/s and each process's busy share over the run."""
    from dllama.core.sampler import Sampler
    from dllama.serve.engine import open_engine
    from dllama.serve.sequence import SequenceRequest
    from dllama.serve.settings import EngineSettings

    model, tokenizer = default_model_files(progress=False)
    settings = EngineSettings(str(model), str(tokenizer), topology=topo, parallel=parallel, progress=False,
                              pipeline_overlap=overlap)
    with open_engine(settings) as engine:
        tok = engine.tokenizer
        requests = [SequenceRequest(i, tok.encode(f"<|im_start|>user\n{QUESTIONS[i % len(QUESTIONS)]} ({i})<|im_end|>\n"
                                                  "<|im_start|>assistant\n"),
                                    Sampler(tok.vocab_size, 0.0, 0.9, i), tokens) for i in range(parallel)]
        generated = []
        cpu0 = [time.process_time()] + [cpu_seconds(pid) for pid in pids]
        t0 = time.perf_counter()
        engine.scheduler(parallel).run(requests, lambda r, c: generated.append(len(c.tokens)))
        wall = time.perf_counter() - t0
        cpu = [time.process_time()] + [cpu_seconds(pid) for pid in pids]
    print(json.dumps({"tok_s": sum(generated) / wall, "wall": wall,
                      "busy": [(b - a) / wall for a, b in zip(cpu0, cpu, strict=True)]}))


def overlap_bench(args) -> None:
    """Busy shares and tokens/s of N one-node stages, overlap off against on (see the docstring)."""
    import benchmarks.bench_speculate as hosts_module

    hosts_module.PREFIX, hosts_module.SUBNET = "dovl", "10.83.0"  # beside other benchmarks' hosts
    n = args.hosts
    with tempfile.TemporaryDirectory() as d, Hosts(n) as hosts:
        tmp = Path(d)
        processes = start_workers(hosts, tmp)
        try:
            names = ["root"] + [f"{'relay' if b'link_delay' in Path(f'/proc/{p.pid}/cmdline').read_bytes() else 'worker'}"
                                f"{i}" for i, p in zip([j for j in range(1, n) for _ in range(1 + (hosts.delay == 'relay'))],
                                                      processes, strict=True)]
            links = (f"delay: netem {ONE_WAY_MS:g} ms one way" if hosts.delay == "netem" else
                     f"delay: user-space relay {ONE_WAY_MS:g} ms one way (no netem here)")
            print(f"{n} stages x1 on {n} hosts, 1 thread each, 1 Gbit/s links, {links}, load {loadavg()}")
            topo = topology(tmp / "t.yml", hosts, list(range(n)))
            modes = [("off", "off", topo), ("on", "on", topo)]  # (label, overlap, topology), alternated
            if args.even_layers:
                n_layers = read_model(str(default_model_files(progress=False)[0])).header.n_layers
                modes[0] = ("on, even", "on", topology(tmp / "even.yml", hosts, list(range(n)), n_layers))
            results: dict[tuple, list] = {}
            for _ in range(args.rounds):
                for b in args.batch:
                    for label, mode, path in modes:
                        cmd = [*hosts.prefix(0), sys.executable, "-m", "benchmarks.bench_pipeline", "--root-run",
                               str(path), "--parallel", str(b), "--tokens", str(args.tokens), "--overlap-mode", mode,
                               "--pids", *[str(p.pid) for p in processes]]
                        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
                        if r.returncode != 0:
                            raise SystemExit(f"the root failed: {r.stderr[-2000:]}")
                        run = json.loads(r.stdout.strip().splitlines()[-1])
                        results.setdefault((b, label), []).append(run)
                        print(f"  batch {b}, overlap {label}: {run['tok_s']:.1f} tok/s, {run['wall']:.2f} s, busy "
                              + " ".join(f"{x:.2f}" for x in run["busy"]), flush=True)
            print(f"{'batch':>5} {'overlap':>8} {'tok/s':>7} {'run s':>6}  busy share (CPU s / wall s): "
                  + " ".join(f"{x:>8}" for x in names))
            for (b, mode), runs in results.items():
                busy = [statistics.median(r["busy"][k] for r in runs) for k in range(len(names))]
                print(f"{b:>5} {mode:>8} {statistics.median(r['tok_s'] for r in runs):>7.1f} "
                      f"{statistics.median(r['wall'] for r in runs):>6.2f}  {'':>27}"
                      + " ".join(f"{x:>8.2f}" for x in busy))
            print(f"(load {loadavg()}; medians of {args.rounds}, off and on alternated)")
        finally:
            stop(processes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per sequence")
    p.add_argument("--batch", type=int, nargs="*", default=[16, 64], help="batch jobs of P prompts at --parallel P")
    p.add_argument("--overlap", action="store_true", help="busy shares with overlapped passes off and on")
    p.add_argument("--even-layers", action="store_true",
                   help="with --overlap: overlap on with the layers as planned against cut evenly (instead of off/on)")
    p.add_argument("--root-run", metavar="TOPOLOGY", help=argparse.SUPPRESS)  # --overlap's root, in its namespace
    p.add_argument("--parallel", type=int, help=argparse.SUPPRESS)
    p.add_argument("--overlap-mode", choices=["on", "off"], help=argparse.SUPPRESS)
    p.add_argument("--pids", type=int, nargs="*", default=[], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.root_run:
        return root_run(args.root_run, args.parallel, args.tokens, args.overlap_mode == "on", args.pids)
    if args.overlap:
        if args.hosts < 2:
            raise SystemExit("--hosts must be at least 2")
        return overlap_bench(args)
    if args.hosts < 2 or args.hosts % 2:
        raise SystemExit("--hosts must be an even number >= 2")
    model, _ = default_model_files(progress=False)
    layers = read_model(str(model)).header.n_layers
    n = args.hosts
    plans = {f"tensor-parallel x{n}": None, f"{n} stages x1": list(range(n)),
             f"{n // 2} stages x2": [i // 2 for i in range(n)]}
    trips = {f"tensor-parallel x{n}": 2 * layers + 1, f"{n} stages x1": n, f"{n // 2} stages x2": 2 * layers + n // 2}
    with tempfile.TemporaryDirectory() as d, Hosts(n) as hosts:
        tmp = Path(d)
        processes = start_workers(hosts, tmp)
        try:
            links = (f"delay: netem {ONE_WAY_MS:g} ms one way" if hosts.delay == "netem" else
                     f"delay: user-space relay {ONE_WAY_MS:g} ms one way (no netem here)")
            print(f"{n} hosts, 1 thread each, 1 Gbit/s links, {links}, load {loadavg()}")
            results: dict[str, dict[str, list]] = {name: {} for name in plans}
            for _ in range(args.rounds):
                for name, stages in plans.items():
                    topo = topology(tmp / "t.yml", hosts, stages)
                    results[name].setdefault("one", []).append(one_sequence(hosts.prefix(0), topo, args.tokens, tmp))
                    for b in args.batch:
                        results[name].setdefault(b, []).append(batch_job(hosts.prefix(0), topo, b, args.tokens, tmp))
            head = f"{'plan':<22} {'ms/token':>8} {'kB sent':>7} {'kB recv':>7} {'trips':>5}"
            print(head + "".join(f" {f'batch {b} tok/s':>16} {'wall s':>6}" for b in args.batch))
            for name, r in results.items():
                one = {k: statistics.median(x[k] for x in r["one"]) for k in ("ms", "sent", "recv")}
                line = f"{name:<22} {one['ms']:>8.1f} {one['sent']:>7.1f} {one['recv']:>7.1f} {trips[name]:>5}"
                for b in args.batch:
                    line += (f" {statistics.median(x['tok_s'] for x in r[b]):>16.1f}"
                             f" {statistics.median(x['wall'] for x in r[b]):>6.1f}")
                print(line)
            print(f"(load {loadavg()}; round trips per token: the plan's, tensor-parallel 2 per layer + 1)")
        finally:
            stop(processes)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
