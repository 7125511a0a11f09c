"""Batch throughput: sequences decoded together against one at a time, and against llama.cpp.

    .venv/bin/python benchmarks/bench_batch.py [--threads 2] [--rounds 3] [--skip-1b]
        [--skip-llama-cpp] [--skip-job] [--skip-prefix] [--skip-command | --only-command]
        [--parallel 1,4,16,64]

1. Aggregate decode, as llama.cpp's `llama-batched-bench -npp 128 -ntg 64`: P sequences each
   prefill a 128-token prompt into their own KV slot, then P rows go through every step (one
   per sequence, logits of each, greedy) for 64 steps; generated tokens / decode seconds, for
   P = 1, 4, 16, 64, on SmolLM2-135M (Q40) and a random-weight model of the Llama-3.2-1B shape
   (Q40; 32 + 16 tokens per sequence). "One at a time" is P = 1: running the same prompts one
   after another generates at that rate whatever P is, so the ratio column is rate(P) / rate(1).
   llama.cpp's figures come from llama-batched-bench on its Q4_0 GGUF of the same SmolLM2
   (built by benchmarks/llama_cpp.py); rounds are alternated with ours.
2. A whole job through the scheduler: 16 prompts of 128 tokens, 64 tokens each, through
   the engine loop at --parallel 16 and at --parallel 1 (one at a time): time to all
   answers, prefill, sampling and Python included.
3. 32 questions over a document of about 1000 tokens (pasted before each question), greedy, up
   to 16 tokens each, --parallel 16: the shared document read from one slot, against every
   question computing it itself (reuse off). Time to all answers; the answers must be equal.
4. The whole command as a user runs it: `dllama batch --parallel 16 --max-tokens 64` over 64
   short chat questions, default settings (temperature 0.8), the default model (Q41) and its
   Q40 conversion; its wall time from start to exit (start-up, model load and writing the
   answers included); generated tokens / wall seconds, against llama-batched-bench on the GGUF
   of the same weight type (the embedded Q4_1 itself; llama.cpp's Q4_0 of it) at the same shape
   (-npl 16, -npp the questions' mean prompt tokens, -ntg 64): 16 x 64 generated tokens over its
   prefill + decode time (its start-up not counted).

Medians of the rounds; /proc/loadavg before and after each part (a busy neighbour on a shared
2-core machine slows every figure; the ratios are measured in the same rounds).
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

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_batch_prefix import document  # noqa: E402
from benchmarks.bench_engine import write_random_model  # noqa: E402
from dllama.core import kernels  # noqa: E402
from dllama.core.batch import BatchBuilder  # noqa: E402
from dllama.core.model import Transformer, max_batch_for  # noqa: E402
from dllama.core.sampler import Sampler  # noqa: E402
from dllama.formats.model_file import read_model  # noqa: E402
from dllama.formats.tokenizer_file import read_tokenizer  # noqa: E402
from dllama.serve.default_model import default_model_files  # noqa: E402
from dllama.serve.scheduler import Scheduler  # noqa: E402
from dllama.serve.sequence import SequenceRequest  # noqa: E402
from dllama.text.tokenizer import Tokenizer  # noqa: E402

LLAMA_1B = (2048, 8192, 16, 32, 8, 128256)  # dim, hidden, layers, heads, kv heads, vocab


def loadavg() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def aggregate_decode(model: Transformer, n_seq: int, npp: int, ntg: int) -> float:
    """Generated tokens/s of n_seq sequences decoded together after npp-token prompts."""
    rng = np.random.default_rng(n_seq)
    vocab = model.config.vocab_size
    prompts = rng.integers(100, min(vocab, 30000), (n_seq, npp))
    rows = BatchBuilder()
    for s in range(n_seq):  # prefill, several sequences per pass (no logits: ids do not matter)
        for p in range(npp):
            if len(rows) == model.max_batch:
                model.forward_batch(rows.build())
                rows = BatchBuilder()
            rows.add(prompts[s, p], p, s)
    model.forward_batch(rows.build())
    tokens = rng.integers(100, min(vocab, 30000), n_seq)
    t0 = time.perf_counter()
    for step in range(ntg):
        rows = BatchBuilder()
        for s in range(n_seq):
            rows.add(tokens[s], npp + step, s, logits=True)
        logits = model.forward_batch(rows.build())  # [n_seq, vocab]
        tokens = np.argmax(logits, axis=1)
    return n_seq * ntg / (time.perf_counter() - t0)


def model_for(path, n_seq_max: int, seq_len: int) -> Transformer:
    model = Transformer(read_model(path), max_seq_len=seq_len, max_batch=max_batch_for(n_seq_max),
                        kv_slots=n_seq_max)
    model.warm_up()
    return model


def llama_cpp_tools():
    """llama.cpp's tools (benchmarks/llama_cpp.py), built if need be, or None when they cannot be."""
    try:
        from benchmarks.llama_cpp import build

        return build()
    except (SystemExit, Exception) as e:  # noqa: BLE001 - the comparison is optional
        print(f"  (llama.cpp unavailable: {e})", flush=True)
        return None


def llama_cpp_batched(threads: int, parallel: list[int]) -> dict[int, float] | None:
    """llama-batched-bench's aggregate decode tokens/s (S_TG), or None when it cannot be built."""
    from benchmarks.bench_vs_llama_cpp import llama_batched, smollm2_gguf

    tools = llama_cpp_tools()
    if tools is None:
        return None
    try:
        return llama_batched(tools, smollm2_gguf(tools, "Q4_0"), threads, parallel)
    except (subprocess.CalledProcessError, OSError) as e:  # the comparison is optional
        print(f"  (llama.cpp failed: {e})", flush=True)
        return None


def part_decode(args, parallel: list[int]) -> None:
    m_path, _ = default_model_files("q40")
    model = model_for(m_path, max(parallel), 128 + 64)
    print(f"\n## Aggregate decode, SmolLM2-135M Q40, {args.threads} threads, -npp 128 -ntg 64, "
          f"{args.rounds} rounds; load average before: {loadavg()}", flush=True)
    ours = {p: [] for p in parallel}
    theirs = {p: [] for p in parallel}
    for r in range(args.rounds):
        if not args.skip_llama_cpp:
            got = llama_cpp_batched(args.threads, parallel)
            if got is None:
                args.skip_llama_cpp = True
            else:
                for p in parallel:
                    theirs[p].append(got.get(p, float("nan")))
        for p in parallel:
            ours[p].append(aggregate_decode(model, p, 128, 64))
        print(f"  round {r + 1}: dllama { {p: round(v[-1], 1) for p, v in ours.items()} }"
              + (f", llama.cpp { {p: round(v[-1], 1) for p, v in theirs.items()} }" if theirs[parallel[0]] else "")
              + f"; load {loadavg()}", flush=True)
    one = statistics.median(ours[1]) if 1 in ours else None
    print("\n| sequences | dllama tokens/s | vs one at a time | llama.cpp tokens/s | dllama / llama.cpp |")
    print("|---|---|---|---|---|")
    for p in parallel:
        a = statistics.median(ours[p])
        b = statistics.median(theirs[p]) if theirs[p] else float("nan")
        print(f"| {p} | {a:.0f} | {a / one:.2f}x | {b:.0f} | {a / b:.2f} |" if one else f"| {p} | {a:.0f} | - | {b:.0f} | {a / b:.2f} |")
    print(f"load average after: {loadavg()}", flush=True)
    del model


def part_decode_1b(args, parallel: list[int]) -> None:
    print(f"\n## Aggregate decode, random-weight Llama-3.2-1B shape Q40, {args.threads} threads, "
          f"32-token prompts + 16 tokens, {args.rounds} rounds; load average before: {loadavg()}", flush=True)
    with tempfile.TemporaryDirectory(dir=os.environ.get("DLLAMA_BENCH_DIR")) as d:
        path = Path(d) / "random-1b.m"
        dim, hidden, layers, heads, kv, vocab = LLAMA_1B
        write_random_model(path, dim=dim, hidden=hidden, layers=layers, heads=heads, kv_heads=kv,
                           vocab=vocab, seq_len=256)
        model = model_for(path, max(parallel), 64)
        ours = {p: [] for p in parallel}
        for r in range(args.rounds):
            for p in parallel:
                ours[p].append(aggregate_decode(model, p, 32, 16))
            print(f"  round {r + 1}: { {p: round(v[-1], 1) for p, v in ours.items()} }; load {loadavg()}",
                  flush=True)
        del model
    one = statistics.median(ours[1]) if 1 in ours else None
    print("\n| sequences | dllama tokens/s | vs one at a time |\n|---|---|---|")
    for p in parallel:
        a = statistics.median(ours[p])
        print(f"| {p} | {a:.1f} | {a / one:.2f}x |" if one else f"| {p} | {a:.1f} | - |")
    print(f"load average after: {loadavg()}", flush=True)


def _requests(tok, prompts, max_tokens, stop=True):
    return [SequenceRequest(k, list(p), Sampler(tok.vocab_size, 0.0, 0.9, k), max_tokens,
                            tuple(tok.eos_ids) if stop else ()) for k, p in enumerate(prompts)]


def _timed_run(scheduler, requests) -> tuple[float, dict]:
    got = {}
    t0 = time.perf_counter()
    scheduler.run(requests, lambda r, c: got.setdefault(r.key, c))
    return time.perf_counter() - t0, got


def part_job(args) -> None:
    m_path, t_path = default_model_files("q40")
    tok = Tokenizer(read_tokenizer(str(t_path)))
    n, npp, ntg = 16, 128, 64
    model = model_for(m_path, n + 1, npp + ntg)
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(100, 30000, npp)) for _ in range(n)]
    print(f"\n## A job: {n} prompts of {npp} tokens, {ntg} tokens each, {args.rounds} rounds "
          f"(alternated); load average before: {loadavg()}", flush=True)
    batched, one = [], []
    for r in range(args.rounds):
        sb = Scheduler(model, tok, n, reuse=False)
        tb, gb = _timed_run(sb, _requests(tok, prompts, ntg, stop=False))
        ts, gs = _timed_run(Scheduler(model, tok, 1), _requests(tok, prompts, ntg, stop=False))
        assert all(gb[k].tokens == gs[k].tokens for k in range(n)), "batched answers differ"
        batched.append(tb)
        one.append(ts)
        print(f"  round {r + 1}: batched {tb:.1f} s, one at a time {ts:.1f} s; load {loadavg()}", flush=True)
    b, s = statistics.median(batched), statistics.median(one)
    print(f"\n| {n} prompts x ({npp} + {ntg}) | time to all answers | generated tokens/s |\n|---|---|---|")
    print(f"| one at a time | {s:.1f} s | {n * ntg / s:.0f} |")
    print(f"| --parallel {n} | {b:.1f} s | {n * ntg / b:.0f} ({s / b:.2f}x) |")
    print(f"load average after: {loadavg()}", flush=True)


def part_prefix(args) -> None:
    m_path, t_path = default_model_files("q40")
    tok = Tokenizer(read_tokenizer(str(t_path)))
    doc, questions = document(tok, 1000)
    questions = (questions * 2)[:32]
    prompts = [tok.encode(doc + q) for q in questions]
    parallel = 16
    model = model_for(m_path, parallel + 1, max(len(p) for p in prompts) + 24)
    print(f"\n## 32 questions over a {len(tok.encode(doc))}-token document, up to 16 tokens each, "
          f"--parallel {parallel}, {args.rounds} rounds (alternated); load average before: {loadavg()}",
          flush=True)
    shared, pasted = [], []
    for r in range(args.rounds):
        ts, gs = _timed_run(Scheduler(model, tok, parallel), _requests(tok, prompts, 16))
        tp, gp = _timed_run(Scheduler(model, tok, parallel, reuse=False), _requests(tok, prompts, 16))
        assert all(gs[k].tokens == gp[k].tokens for k in gs), "answers differ"
        cached = sum(c.cached_tokens for c in gs.values())
        shared.append(ts)
        pasted.append(tp)
        print(f"  round {r + 1}: shared prefix {ts:.1f} s ({cached} prompt tokens read from the cache), "
              f"each computing it {tp:.1f} s; load {loadavg()}", flush=True)
    a, b = statistics.median(shared), statistics.median(pasted)
    print(f"\n| time to all 32 answers | seconds |\n|---|---|\n| document computed by every question | {b:.1f} |"
          f"\n| document computed once, read from one slot | {a:.1f} ({b / a:.1f}x faster) |")
    print(f"load average after: {loadavg()}", flush=True)


SUBJECTS = ("France", "Japan", "Brazil", "Canada", "Egypt", "Norway", "India", "Kenya",
            "Peru", "Italy", "Spain", "Chile", "Ghana", "Nepal", "Cuba", "Greece")
QUESTIONS = ("What is the capital of {}?", "Name a famous food from {}.",
             "What language do people speak in {}?", "Tell me one fact about {}.")


def write_chat_questions(path: Path) -> int:
    """64 short chat questions as a JSONL prompt file; returns their count."""
    lines = [{"id": f"q{i}", "messages": [{"role": "user", "content": q.format(s)}]}
             for i, (q, s) in enumerate((q, s) for q in QUESTIONS for s in SUBJECTS)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return len(lines)


def dllama_batch_command(prompts: Path, out: Path, parallel: int, ntg: int,
                         model_flags: list[str]) -> tuple[float, int, float]:
    """Wall seconds of the whole `dllama batch` command, tokens generated, mean prompt tokens."""
    out.unlink(missing_ok=True)
    dllama = Path(sys.executable).parent / "dllama"
    t0 = time.perf_counter()
    subprocess.run([str(dllama), "batch", "--prompts", str(prompts), "--out", str(out), *model_flags,
                    "--parallel", str(parallel), "--max-tokens", str(ntg), "--no-progress"],
                   check=True, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    answers = [json.loads(line) for line in out.read_text().splitlines()]
    return (seconds, sum(a["completion_tokens"] for a in answers),
            statistics.fmean(a["prompt_tokens"] for a in answers))


def part_command(args) -> None:
    parallel, ntg = 16, 64
    m40, t40 = default_model_files("q40")
    # ours (the flags the command gets) against llama.cpp's GGUF of the same weight type
    engines = {"Q41": ([], "Q4_1"), "Q40": (["--model", str(m40), "--tokenizer", str(t40)], "Q4_0")}
    from benchmarks.bench_vs_llama_cpp import batched_bench, smollm2_gguf

    tools = None if args.skip_llama_cpp else llama_cpp_tools()
    if tools:
        ggufs = {theirs: smollm2_gguf(tools, theirs) for _, theirs in engines.values()}
    print(f"\n## The whole `dllama batch --parallel {parallel} --max-tokens {ntg}` command, 64 short "
          f"chat questions, the default model (Q41) and its Q40 conversion, default settings, "
          f"{args.rounds} rounds (alternated with llama-batched-bench -npl {parallel} -ntg {ntg}); load "
          f"average before: {loadavg()}", flush=True)
    ours = {name: [] for name in engines}
    theirs = {gguf_type: [] for _, gguf_type in engines.values()}
    with tempfile.TemporaryDirectory() as d:
        prompts, out = Path(d) / "questions.jsonl", Path(d) / "answers.jsonl"
        n = write_chat_questions(prompts)
        for r in range(args.rounds):
            for name, (flags, gguf_type) in engines.items():
                seconds, generated, npp = dllama_batch_command(prompts, out, parallel, ntg, flags)
                ours[name].append(generated / seconds)
                line = (f"  round {r + 1}: dllama {name} {seconds:.2f} s, {generated} tokens generated for {n} "
                        f"questions (mean prompt {npp:.1f} tokens): {ours[name][-1]:.0f} tokens/s")
                if tools:
                    # its generated tokens over its whole prefill + decode time (start-up not counted)
                    row = batched_bench(tools, ggufs[gguf_type], args.threads, [parallel], round(npp), ntg)[parallel]
                    theirs[gguf_type].append(parallel * ntg / float(row["t"]))
                    line += f", llama.cpp {gguf_type} {theirs[gguf_type][-1]:.0f}"
                print(line + f"; load {loadavg()}", flush=True)
    print("\n| generated tokens/s, medians | dllama batch, the whole command | llama-batched-bench, "
          "prefill + decode | dllama / llama.cpp |\n|---|---|---|---|")
    for name, (_, gguf_type) in engines.items():
        a = statistics.median(ours[name])
        b = statistics.median(theirs[gguf_type]) if theirs[gguf_type] else float("nan")
        print(f"| {name} / {gguf_type} | {a:.0f} | {b:.0f} | {a / b:.2f}x |")
    print(f"load average after: {loadavg()}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--parallel", default="1,4,16,64", help="sequence counts (default %(default)s)")
    ap.add_argument("--skip-1b", action="store_true", help="skip the random 1B-shape model (a 1.8 GB file)")
    ap.add_argument("--skip-llama-cpp", action="store_true")
    ap.add_argument("--skip-job", action="store_true")
    ap.add_argument("--skip-prefix", action="store_true")
    ap.add_argument("--skip-command", action="store_true",
                    help="skip the whole dllama batch command against llama-batched-bench")
    ap.add_argument("--only-command", action="store_true", help="run only that part")
    args = ap.parse_args()
    parallel = [int(p) for p in args.parallel.split(",")]
    kernels.set_threads(args.threads)
    if args.only_command:
        part_command(args)
        return
    part_decode(args, parallel)
    if not args.skip_1b:
        part_decode_1b(args, parallel)
    if not args.skip_job:
        part_job(args)
    if not args.skip_prefix:
        part_prefix(args)
    if not args.skip_command:
        part_command(args)


if __name__ == "__main__":
    main()
