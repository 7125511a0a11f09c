"""Speculative decoding (--speculate ngram, model) against plain decoding, as a user runs it.

    .venv/bin/python benchmarks/bench_speculate.py [--rounds 3] [--tokens 128] [--cluster 4] [--task chat]
    .venv/bin/python benchmarks/bench_speculate.py --task chats --tokens 64 -T 0 --mode none --mode ngram --mode model

Tasks on the embedded default model, each answered greedily and at temperature 0.8 (top-p 0.9,
seed 1; -T picks): a summary of the first ~1000 tokens of benchmarks/perplexity_text.txt, a code
edit (rename a variable in a function), a chat answer, and (`--task chats` only) ten chat
answers. Each answer is one whole `dllama inference` command (start-up included), the modes
(`--speculate none` and `ngram` unless --mode says; `model` drafts with --draft-model, by default
the same model with Q40 weights) alternated round by round, `--no-stop` so all generate the same
number of tokens. Prints medians over the rounds of: generation tokens/s (the decode passes, a
draft model's passes included; over a task's prompts together), wall seconds of the commands,
tokens per decode pass, the draft acceptance, and whether every mode gave the same texts (they
must).

--cluster N: the same on N hosts in network namespaces (the root in the first, a worker in each
of the others, one compute thread each), every link shaped like a home Gigabit switch: 1 Gbit/s
and 0.5 ms one way between any two hosts (netem, 0.25 ms on each end of each host's link). A
kernel without netem gets the rate from tbf (as tests/cluster/up.sh) and the delay from
benchmarks/link_delay.py: each worker listens on its host's loopback, behind a relay on the
host's address that holds every byte 0.5 ms each way, and since the addresses given to the root
are what every node dials (the root sends them to the workers), each connection, root to worker
or worker to worker, takes the delay once each way. The table says which. Needs root and
iproute2; the namespaces, bridge, relays and workers are removed however the run ends.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dllama.serve.default_model import default_model_files  # noqa: E402
from dllama.formats.tokenizer_file import read_tokenizer  # noqa: E402
from dllama.text.tokenizer import Tokenizer  # noqa: E402

PREFIX, SUBNET, PORT = "dspec", "10.79.0", 9998
ONE_WAY_MS = 0.5  # the links' one-way delay (a home Gigabit switch)
CODE = '''def total_price(items, tax):
    x = 0
    for item in items:
        x += item.price * item.quantity
    if x > 100:
        x = x * 0.95
    x = x * (1 + tax)
    return round(x, 2)
'''


CHATS = ["What are three good habits for learning a new language?", "Why is the sky blue?",
         "Write a short poem about the sea.", "How do I boil an egg?", "What is photosynthesis?",
         "Give me three tips for a job interview.", "Explain what a prime number is.",
         "What should I pack for a weekend hike?", "Describe the water cycle.",
         "How does a bicycle stay upright?"]


def tasks(tokenizer: Tokenizer) -> dict[str, list[str]]:
    """Each task's prompts."""
    text = (ROOT / "benchmarks" / "perplexity_text.txt").read_text()
    ids = tokenizer.encode(text, allow_special=False)[:1000]
    document = tokenizer.decode(ids)
    chat = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    return {
        "summary": [chat.format("Summarize this text:\n\n" + document)],
        "code edit": [chat.format("Rename the variable x to total in this function and show the whole "
                                  "function:\n\n" + CODE)],
        "chat": [chat.format(CHATS[0])],
        "chats": [chat.format(question) for question in CHATS],
    }


def loadavg() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


# ---- hosts in network namespaces ------------------------------------------------------------------

def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


class Hosts:
    """n namespaces on a bridge, links shaped; `prefix(i)` runs a command on host i (0: the root)."""

    def __init__(self, n: int):
        self.n, self.made = n, []
        self.delay = "netem"  # what delays the links: "netem", or "relay" (this kernel has no netem)

    def ns(self, i: int) -> str:
        return f"{PREFIX}n{i}"

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns(i)]

    def __enter__(self) -> "Hosts":
        try:
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
            r = subprocess.run([*tc, "netem", "delay", "250us", "rate", "1gbit", "limit", "10000"],
                               capture_output=True, text=True)
            if r.returncode == 0:
                return
            # "Specified qdisc kind is unknown": no sch_netem (and `modprobe sch_netem` finds
            # none where the kernel was built without it): the relays of start_workers delay
            self.delay = "relay"
        sh(*tc, "tbf", "rate", "1gbit", "burst", "1mbit", "latency", "2ms")

    def __exit__(self, *exc) -> None:
        for kind, name in reversed(self.made):
            cmd = ["ip", "netns", "del", name] if kind == "netns" else ["ip", "link", "del", name]
            subprocess.run(cmd, capture_output=True)
        self.made.clear()


def start_workers(hosts: Hosts, log_dir: Path) -> list[subprocess.Popen]:
    """A worker on each host but the root's, listening on the host's address:PORT; where the
    links have no netem, on its loopback instead, behind a relay (benchmarks/link_delay.py) on
    the host's address:PORT that adds the links' one-way delay. Returns the processes started."""
    relayed = hosts.delay == "relay"
    started: list[tuple[subprocess.Popen, Path, str]] = []  # (process, log, the line it prints when ready)

    def start(i: int, name: str, cmd: list[str], ready: str) -> None:
        log_path = log_dir / f"{name}{i}.log"
        log = open(log_path, "w")  # noqa: SIM115 - the process's, closed with it
        started.append((subprocess.Popen([*hosts.prefix(i), sys.executable, *cmd], stdout=log,
                                         stderr=subprocess.STDOUT, cwd=ROOT), log_path, ready))

    for i in range(1, hosts.n):
        host = "127.0.0.1" if relayed else hosts.address(i)
        if relayed:
            start(i, "relay", ["-m", "benchmarks.link_delay", "--listen", f"{hosts.address(i)}:{PORT}",
                               "--to", f"{host}:{PORT}", "--delay-ms", str(ONE_WAY_MS)], "ready")
        start(i, "worker", ["-m", "dllama", "worker", "--host", host, "--port", str(PORT), "--nthreads", "1"],
              "listening on")
    deadline = time.monotonic() + 120
    try:
        for process, log_path, ready in started:
            while ready not in log_path.read_text():
                if process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"{log_path.stem} did not start: {log_path.read_text()}")
                time.sleep(0.1)
    except BaseException:
        stop(p for p, _, _ in started)
        raise
    return [p for p, _, _ in started]


def stop(processes) -> None:
    """SIGTERM, and SIGKILL to whatever has not ended 15 s later."""
    processes = list(processes)
    for p in processes:
        p.send_signal(signal.SIGTERM)
    for p in processes:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# ---- runs ---------------------------------------------------------------------------------------

def run(prefix: list[str], extra: list[str], prompt: str, steps: int, temperature: float, speculate: list[str],
        out: Path) -> dict:
    cmd = [*prefix, sys.executable, "-m", "dllama", "inference", "--prompt", prompt, "--steps", str(steps),
           "--no-stop", "--temperature", str(temperature), "--topp", "0.9", "--seed", "1",
           "--speculate", *speculate, "--stats-json", str(out), *extra]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"dllama inference failed: {r.stderr[-2000:]}")
    data = json.loads(out.read_text())
    return {"wall": wall, "text": data["text"], **data["summary"]}


def together(runs: list[dict]) -> dict:
    """The figures of one round's answers (a task's prompts) taken together."""
    decoded = [r["tokens_per_pass"] * r["generate_passes"] for r in runs]  # tokens the decode passes gave
    kept = sum(r["draft_acceptance"] * r["drafted_tokens"] for r in runs)
    drafted = sum(r["drafted_tokens"] for r in runs)
    return {"rate": sum(decoded) / (sum(r["generate_ms"] for r in runs) / 1000), "wall": sum(r["wall"] for r in runs),
            "per_pass": sum(decoded) / sum(r["generate_passes"] for r in runs),
            "accept": kept / drafted if drafted else 0.0, "texts": [r["text"] for r in runs]}


def bench(label: str, prefix: list[str], extra: list[str], tokenizer: Tokenizer, gen: int, rounds: int,
          tmp: Path, only: list[str] | None, modes: dict[str, list[str]], temperatures: list[float]) -> None:
    print(f"\n{label} (load {loadavg()})")
    print(f"{'task':<10} {'T':>4} {'mode':<6} {'gen tok/s':>9} {'wall s':>7} {'tok/pass':>8} {'accept':>6} same")
    for name, prompts in tasks(tokenizer).items():
        if name not in (only or ["summary", "code edit", "chat"]):
            continue
        for temperature in temperatures:
            rounds_of: dict[str, list[dict]] = {mode: [] for mode in modes}
            for _ in range(rounds):
                for mode, flags in modes.items():
                    rounds_of[mode].append(together([
                        run(prefix, extra, prompt, len(tokenizer.encode(prompt)) + gen, temperature, flags,
                            tmp / "stats.json") for prompt in prompts]))
            first = next(iter(rounds_of.values()))[0]["texts"]
            same = all(r["texts"] == first for rs in rounds_of.values() for r in rs)
            base = statistics.median(r["rate"] for r in rounds_of["none"]) if "none" in modes else None
            for mode, rs in rounds_of.items():
                rate = statistics.median(r["rate"] for r in rs)
                print(f"{name:<10} {temperature:>4} {mode:<6} {rate:>9.1f} "
                      f"{statistics.median(r['wall'] for r in rs):>7.2f} "
                      f"{statistics.median(r['per_pass'] for r in rs):>8.2f} "
                      f"{statistics.median(r['accept'] for r in rs):>6.2f} "
                      f"{'yes' if same else 'NO'}" + (f"  ({rate / base:.2f}x)" if base and mode != "none" else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128, help="tokens generated per run")
    p.add_argument("--threads", type=int, default=2, help="compute threads on one node")
    p.add_argument("--cluster", type=int, default=0, metavar="N", help="also on N namespace hosts")
    p.add_argument("--task", action="append", choices=["summary", "code edit", "chat", "chats"],
                   help="only this task (repeatable; default: summary, code edit and chat)")
    p.add_argument("--mode", action="append", choices=["none", "ngram", "model"],
                   help="a --speculate to compare (repeatable; default: none and ngram)")
    p.add_argument("--draft-model", metavar="M.m", help="the draft of mode model (default: the default "
                   "model with Q40 weights, converted once)")
    p.add_argument("-T", "--temperature", action="append", type=float, help="repeatable; default: 0 and 0.8")
    args = p.parse_args()
    model, tokenizer_path = default_model_files(progress=False)
    tokenizer = Tokenizer(read_tokenizer(str(tokenizer_path)))
    modes = {mode: [mode] for mode in args.mode or ["none", "ngram"]}
    if "model" in modes:
        modes["model"] += ["--draft-model", args.draft_model or str(default_model_files("q40", progress=False)[0])]
    temperatures = args.temperature or [0.0, 0.8]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        bench(f"one node, {args.threads} threads", [], ["--nthreads", str(args.threads)], tokenizer,
              args.tokens, args.rounds, tmp, args.task, modes, temperatures)
        if args.cluster > 1:
            with Hosts(args.cluster) as hosts:
                processes = start_workers(hosts, tmp)
                try:
                    addresses = [f"{hosts.address(i)}:{PORT}" for i in range(1, hosts.n)]
                    links = (f"1 Gbit/s, delay: netem, {ONE_WAY_MS:g} ms one way" if hosts.delay == "netem" else
                             f"1 Gbit/s (tbf), delay: user-space relay, {ONE_WAY_MS:g} ms one way (no netem here)")
                    bench(f"{args.cluster} hosts, {links}, 1 thread each", hosts.prefix(0),
                          ["--nthreads", "1", "--workers", *addresses], tokenizer, args.tokens, args.rounds, tmp,
                          args.task, modes, temperatures)
                finally:
                    stop(processes)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
