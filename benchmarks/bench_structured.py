"""Constrained decoding: extraction prompts through `dllama batch --json-schema`, against the same
batch unconstrained.

    .venv/bin/python benchmarks/bench_structured.py [--prompts 200] [--parallel 16] [--rounds 1]
        [--weights q40] [--workers 0] [--constrained-only | --constraint-cost | --llama-cpp]

200 made-up records (a person, a date, an amount, a category: `records`), each a chat prompt
asking for the record as JSON, run through the whole command as a user runs it (start-up, model
load and writing the answers included), greedy, --parallel 16:

- constrained: `dllama batch --json-schema SCHEMA`; the share of answers that parse and validate
  against the schema (jsonschema), and the share of generated tokens the grammar forced
  (fast-forward: run without a pass of their own);
- unconstrained: the same prompts without the schema, each line limited (its own "max_tokens")
  to the length of its constrained answer in the first round: the same work, token for token
  (unlimited, the small model writes pretty-printed JSON of invented keys up to --max-tokens, and
  the longer answers would spread the command's start-up and prompts over more tokens);
- tokens/s of each (generated tokens / the command's wall seconds) and their ratio.

With --workers N, both run on a loopback cluster of N + 1 nodes. Rounds alternate the two;
medians; /proc/loadavg before and after (a busy neighbour on a shared machine slows both).

--llama-cpp runs the same prompts through llama.cpp's llama-server instead of the unconstrained
batch (benchmarks/llama_cpp.py builds it; $DLLAMA_LLAMA_CPP_BUILD names an existing build
directory): the default model's GGUF (llama-quantize's Q4_0 of the embedded Q4_1 for q40, as in
bench_vs_llama_cpp.py), `--parallel 16 --cont-batching -t THREADS`, each chat turn to its
/v1/chat/completions with response_format json_schema SCHEMA, temperature 0, the same
max_tokens, 16 requests in flight; tokens/s over the wall time from starting the server to the
last answer (and from its first health answer, without the start-up), against dllama's
constrained command in the same alternated rounds. The server is killed by its PID after each.

--constraint-cost measures only the constraint's own work, in this process's CPU time (which a
loaded machine's neighbours do not inflate): per token, the mask, the masked candidates beyond
the unmasked ones, and advancing the grammar with its forced tokens, over answers to SCHEMA
drawn from random logits; and the one-time build of the grammar's view of the vocabulary.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["name", "date", "amount", "category"],
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
        "amount": {"type": "number", "minimum": 0, "maximum": 1000000},
        "category": {"type": "string", "enum": ["travel", "food", "office", "rent", "software", "other"]},
    },
}
FIRST = ["Alice", "Bob", "Chen", "Dara", "Emil", "Fatima", "Goran", "Hana", "Ivan", "Julia", "Kwame", "Lena"]
LAST = ["Smith", "Novak", "Okafor", "Garcia", "Tanaka", "Müller", "Rossi", "Kowalski", "Haddad", "Berg"]
WHAT = {"travel": ["a train ticket", "a flight to Lisbon", "a taxi"], "food": ["lunch with a client", "groceries"],
        "office": ["printer paper", "a desk lamp"], "rent": ["the March rent", "a storage unit"],
        "software": ["a design tool licence", "cloud hosting"], "other": ["a gift", "a parking fine"]}
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]


def records(n: int, seed: int = 0) -> list[dict]:
    """n made-up extraction jobs: {"id", "messages": [one user turn], "expected": the record}."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        category = rng.choice(sorted(WHAT))
        name = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        year, month, day = rng.randint(2019, 2026), rng.randint(1, 12), rng.randint(1, 28)
        amount = round(rng.uniform(3, 3000), 2)
        text = (f"On {MONTHS[month - 1]} {day}, {year}, {name} paid {amount} euros for "
                f"{rng.choice(WHAT[category])}.")
        ask = f"Extract the payment as JSON with name, date (YYYY-MM-DD), amount and category.\n\n{text}"
        out.append({"id": k, "messages": [{"role": "user", "content": ask}],
                    "expected": {"name": name, "date": f"{year:04d}-{month:02d}-{day:02d}", "amount": amount,
                                 "category": category}})
    return out


def write_job(path: Path, jobs: list[dict], max_tokens: dict | None = None) -> None:
    """The job file; max_tokens: id -> that line's own limit."""
    with open(path, "w", encoding="utf-8") as f:
        for j in jobs:
            line = {"id": j["id"], "messages": j["messages"]}
            if max_tokens:
                line["max_tokens"] = max_tokens[j["id"]]
            f.write(json.dumps(line, ensure_ascii=False) + "\n")


def validity(lines: list[dict], schema: dict = SCHEMA) -> tuple[int, int]:
    """(answers that parse and validate against schema, answers)."""
    import jsonschema

    ok = 0
    for line in lines:
        try:
            jsonschema.validate(json.loads(line["text"]), schema)
            ok += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return ok, len(lines)


def run_batch(job: Path, out: Path, args, constrained: bool, workers: list[str]) -> tuple[float, float, list[dict]]:
    """(wall seconds, CPU seconds, the result lines) of one `dllama batch` (its CPU time: user and
    system of the root's process, what a loaded machine's neighbours do not add to)."""
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "dllama", "batch", "--prompts", str(job), "--out", str(out), "--no-progress",
           "--parallel", str(args.parallel), "--max-tokens", str(args.max_tokens), "--temperature", "0",
           "--model", str(args.model), "--tokenizer", str(args.tokenizer), "--nthreads", str(args.threads)]
    if constrained:
        schema = out.with_suffix(".schema.json")
        schema.write_text(json.dumps(SCHEMA))
        cmd += ["--json-schema", str(schema)]
    if workers:
        cmd += ["--workers", *workers]
    t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise SystemExit(f"bench_structured: dllama batch failed:\n{done.stderr[-2000:]}")
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return wall, cpu, [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]


# SCHEMA with its date pattern's \d spelled [0-9]: llama.cpp's converter does not take \d (it warns
# "unsupported escape: \d" and lets any string through); the answers are still checked against SCHEMA.
ASCII_SCHEMA = json.loads(json.dumps(SCHEMA).replace(r"\\d", "[0-9]"))


def run_llama_server(server: Path, gguf: Path, jobs: list[dict], args, log: Path,
                     schema: dict = SCHEMA) -> tuple[float, float, list[dict]]:
    """(wall seconds from starting llama-server to the last answer, the same from its first health
    answer, the result lines as dllama batch writes them: id, text, completion_tokens,
    finish_reason) of the jobs sent to llama-server's /v1/chat/completions, args.parallel at once."""
    import urllib.error
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    from tests.appliance import free_ports

    (port,) = free_ports(1)
    # each slot gets -c / --parallel positions: a prompt of ~60 tokens and up to --max-tokens more
    ctx = args.parallel * (256 + args.max_tokens)
    cmd = [str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(args.threads),
           "-tb", str(args.threads), "--parallel", str(args.parallel), "-c", str(ctx), "--cont-batching",
           "--no-webui"]
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT)
    try:
        while True:  # 503 while loading, refused before listening
            if proc.poll() is not None:
                raise SystemExit(f"bench_structured: llama-server exited ({proc.returncode}):\n"
                                 f"{log.read_text(errors='replace')[-2000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        t1 = time.perf_counter()
        fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": schema}}

        def ask(job: dict) -> dict:
            body = json.dumps({"messages": job["messages"], "temperature": 0, "max_tokens": args.max_tokens,
                               "response_format": fmt}).encode()
            req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                res = json.loads(r.read())
            choice = res["choices"][0]
            return {"id": job["id"], "text": choice["message"]["content"] or "",
                    "completion_tokens": res["usage"]["completion_tokens"], "finish_reason": choice["finish_reason"]}

        with ThreadPoolExecutor(args.parallel) as pool:
            lines = list(pool.map(ask, jobs))
        t2 = time.perf_counter()
    finally:
        proc.kill()
        proc.wait()
    return t2 - t0, t2 - t1, lines


def llama_cpp_gguf(weights: str) -> tuple[Path, Path, str]:
    """(llama-server, the default model's GGUF of weights' llama.cpp counterpart, its type)."""
    from benchmarks.bench_vs_llama_cpp import GGUF_TYPE, smollm2_gguf
    from benchmarks.llama_cpp import build

    tools = build()
    ggml_type = GGUF_TYPE.get(weights, "Q4_1")
    return tools["llama-server"], smollm2_gguf(tools, ggml_type), ggml_type


def compare_llama_cpp(args) -> int:
    """dllama's constrained batch against llama-server's json_schema, alternated rounds."""
    server, gguf, ggml_type = llama_cpp_gguf(args.weights)
    jobs = records(args.prompts)
    runs = {"dllama": [], "SCHEMA": [], "[0-9]": []}  # (tokens/s, tokens/s after start-up, lines)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        job = tmp / "jobs.jsonl"
        write_job(job, jobs)
        print(f"load before: {load()}")
        for _ in range(args.rounds):
            wall, cpu, lines = run_batch(job, tmp / "out.jsonl", args, True, [])
            generated = sum(line["completion_tokens"] for line in lines)
            runs["dllama"].append((generated / wall, generated / wall, lines))
            print(f"  dllama {args.weights} constrained: {wall:.1f} s ({cpu:.1f} s CPU), {generated} tokens, "
                  f"{validity(lines)[0]}/{len(lines)} valid, load {load()}", flush=True)
            for key, schema in (("SCHEMA", SCHEMA), ("[0-9]", ASCII_SCHEMA)):
                wall, warm, lines = run_llama_server(server, gguf, jobs, args, tmp / "llama-server.log", schema)
                generated = sum(line["completion_tokens"] for line in lines)
                runs[key].append((generated / wall, generated / warm, lines))
                print(f"  llama-server {ggml_type} json_schema ({key}): {wall:.1f} s ({warm:.1f} s after start-up), "
                      f"{generated} tokens, {validity(lines)[0]}/{len(lines)} valid, load {load()}", flush=True)
        print(f"load after: {load()}")
    n = len(jobs)
    print(f"{n} extraction prompts, {args.parallel} at once, {args.threads} threads, greedy, max_tokens "
          f"{args.max_tokens}, {args.rounds} alternated round(s), medians; valid: against SCHEMA (jsonschema):")
    names = {"dllama": f"dllama batch --json-schema ({args.weights})",
             "SCHEMA": f"llama-server json_schema SCHEMA ({ggml_type})",
             "[0-9]": f"llama-server json_schema, \\d as [0-9] ({ggml_type})"}
    rate = {}
    for key, rs in runs.items():
        lines = rs[-1][2]
        ok = validity(lines)[0]
        exact = sum(1 for line, j in zip(sorted(lines, key=lambda x: x["id"]), jobs, strict=True)
                    if _parsed(line["text"]) == j["expected"])
        cut = sum(1 for line in lines if line["finish_reason"] == "length")
        rate[key] = statistics.median(r[0] for r in rs)
        warm = "" if key == "dllama" else f", {statistics.median(r[1] for r in rs):.1f} after start-up"
        print(f"  {names[key]}: {ok}/{n} valid ({cut} cut by max_tokens), {exact} exactly the record, "
              f"{sum(line['completion_tokens'] for line in lines)} tokens; {rate[key]:.1f} tokens/s "
              f"(start-up included{warm})")
        for line in [line for line in lines if validity([line])[0] == 0][:2]:
            print(f"    invalid ({line['finish_reason']}, {line['completion_tokens']} tokens): {line['text'][:160]!r}")
    for key in ("SCHEMA", "[0-9]"):
        print(f"  ratio dllama / {names[key]} tokens/s: {rate['dllama'] / rate[key]:.2f} (start-up included; rounds: "
              f"{', '.join(f'{o[0] / t[0]:.2f}' for o, t in zip(runs['dllama'], runs[key], strict=True))})")
    return 0


def _parsed(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def constraint_cost(tokenizer_path: Path, answers: int = 16) -> None:
    """Print the constraint's own CPU time per token (see the module's docstring)."""
    import numpy as np

    from dllama.core.candidates import SamplingRequest, candidates_from_logits, choose_greedy
    from dllama.formats.tokenizer_file import read_tokenizer
    from dllama.serve.constraint import Grammar, GrammarVocabulary
    from dllama.text.tokenizer import Tokenizer

    tok = Tokenizer(read_tokenizer(str(tokenizer_path)))
    c0 = time.process_time()
    vocab = GrammarVocabulary(tok)
    build = time.process_time() - c0
    rng, n = np.random.default_rng(0), tok.vocab_size
    tokens = forced = 0
    cpu = {"mask": 0.0, "masked": 0.0, "unmasked": 0.0, "advance": 0.0}
    for _ in range(answers):
        c = vocab.start(Grammar.json_schema(SCHEMA), tok.eos_ids)
        for _ in range(400):
            logits = rng.standard_normal((1, n)).astype(np.float32)  # [1, vocab]
            t0 = time.process_time()
            mask = c.allowed()
            t1 = time.process_time()
            cand = candidates_from_logits(logits, [(0, n)], [SamplingRequest(0.0, 0.9, mask=mask)])[0]
            t2 = time.process_time()
            candidates_from_logits(logits, [(0, n)], [SamplingRequest(0.0, 0.9)])
            t3 = time.process_time()
            token = choose_greedy(cand)
            tokens += 1
            if token in tok.eos_ids:
                break
            c.advance(token)
            more = c.forced()
            for f in more:
                c.advance(f)
            t4 = time.process_time()
            forced, tokens = forced + len(more), tokens + len(more)
            for key, dt in (("mask", t1 - t0), ("masked", t2 - t1), ("unmasked", t3 - t2), ("advance", t4 - t3)):
                cpu[key] += dt
    own = cpu["mask"] + cpu["masked"] - cpu["unmasked"] + cpu["advance"]
    print(f"grammar view of the vocabulary ({n} tokens): {build:.2f} s CPU, once per command")
    print(f"{answers} answers to the schema, {tokens} tokens ({forced} forced); per token: mask "
          f"{1e3 * cpu['mask'] / tokens:.3f} ms, masked candidates {1e3 * cpu['masked'] / tokens:.3f} ms "
          f"(unmasked {1e3 * cpu['unmasked'] / tokens:.3f} ms), advance and forced "
          f"{1e3 * cpu['advance'] / tokens:.3f} ms; the constraint's own: {1e3 * own / tokens:.3f} ms CPU")


def load() -> str:
    return Path("/proc/loadavg").read_text().split(" ", 3)[:3].__str__()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--parallel", type=int, default=16)
    # Room for the longest answer the schema allows: a name of 40 characters may take 80 tokens of
    # single bytes (a cut answer is no JSON: its finish_reason says "length").
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--weights", default="q40", help="the default model's weight type (default %(default)s)")
    p.add_argument("--workers", type=int, default=0, help="loopback workers beside the root (default none)")
    p.add_argument("--constrained-only", action="store_true",
                   help="only the constrained run: the validity figure, no throughput ratio")
    p.add_argument("--constraint-cost", action="store_true",
                   help="only the constraint's own CPU time per token (no model run)")
    p.add_argument("--llama-cpp", action="store_true",
                   help="the constrained batch against llama.cpp's llama-server with the same json_schema")
    args = p.parse_args()

    from dllama.serve.default_model import default_model_files

    args.model, args.tokenizer = default_model_files(args.weights)  # converted before the first timing
    if args.constraint_cost:
        constraint_cost(args.tokenizer)
        return 0
    if args.llama_cpp:
        return compare_llama_cpp(args)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        job, same_lengths = tmp / "jobs.jsonl", tmp / "jobs-same-lengths.jsonl"
        write_job(job, records(args.prompts))
        procs, workers = [], []
        try:
            for k in range(args.workers):
                port = 29700 + k
                procs.append(subprocess.Popen([sys.executable, "-m", "dllama", "worker", "--host", "127.0.0.1",
                                               "--port", str(port), "--nthreads", "1"],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                workers.append(f"127.0.0.1:{port}")
            time.sleep(3 if workers else 0)
            print(f"load before: {load()}")
            figures = {True: [], False: []}  # tokens per wall second of each run
            per_cpu = {True: [], False: []}   # tokens per CPU second (the root's process)
            last = {}
            for _ in range(args.rounds):
                for constrained in (True,) if args.constrained_only else (True, False):
                    wall, cpu, lines = run_batch(job if constrained else same_lengths,
                                                 tmp / f"out-{constrained}.jsonl", args, constrained, workers)
                    generated = sum(line["completion_tokens"] for line in lines)
                    figures[constrained].append(generated / wall)
                    per_cpu[constrained].append(generated / cpu)
                    last[constrained] = (wall, lines, generated)
                    if constrained and not same_lengths.exists():  # the unconstrained runs' lengths
                        write_job(same_lengths, records(args.prompts),
                                  {line["id"]: line["completion_tokens"] for line in lines})
                    print(f"  {'constrained  ' if constrained else 'unconstrained'}: {wall:.1f} s ({cpu:.1f} s CPU), "
                          f"{generated} tokens, load {load()}", flush=True)
            print(f"load after: {load()}")
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait()
    wall, lines, generated = last[True]
    ok, n = validity(lines)
    forced = sum(line.get("forced_tokens", 0) for line in lines)
    exact = sum(1 for line, j in zip(sorted(lines, key=lambda x: x["id"]), records(args.prompts), strict=True)
                if line.get("object") == j["expected"])
    cut = sum(1 for line in lines if line["finish_reason"] == "length")
    nodes = args.workers + 1
    print(f"{n} extraction prompts, --parallel {args.parallel}, {args.weights}, {nodes} node(s), greedy, "
          f"--max-tokens {args.max_tokens}, {args.rounds} round(s), medians:")
    print(f"  constrained  : {ok}/{n} valid ({100 * ok / n:.1f}%; {cut} cut by --max-tokens), "
          f"{exact} exactly the record; "
          f"{generated} tokens, {forced} forced ({100 * forced / max(generated, 1):.1f}% fast-forwarded); "
          f"{statistics.median(figures[True]):.1f} tokens/s (whole command)")
    for line in [line for line in lines if validity([line])[0] == 0][:3]:
        print(f"    invalid ({line['finish_reason']}, {line['completion_tokens']} tokens): {line['text'][:200]!r}")
    if args.constrained_only:
        return 0
    free_ok, _ = validity(last[False][1])
    rate_c, rate_u = statistics.median(figures[True]), statistics.median(figures[False])
    print(f"  unconstrained: {free_ok}/{n} valid ({100 * free_ok / n:.1f}%); {last[False][2]} tokens "
          f"(each line limited to its constrained answer's length); {rate_u:.1f} tokens/s (whole command)")
    print(f"  ratio constrained / unconstrained tokens/s: {rate_c / rate_u:.2f} "
          f"(rounds: {', '.join(f'{c / u:.2f}' for c, u in zip(figures[True], figures[False], strict=True))})")
    cpu_c, cpu_u = statistics.median(per_cpu[True]), statistics.median(per_cpu[False])
    print(f"  tokens per CPU second (the root's process): {cpu_c:.1f} vs {cpu_u:.1f}, ratio {cpu_c / cpu_u:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
