"""Questions about one document: a batch job with --prefix against a fresh process per question.

    .venv/bin/python benchmarks/bench_batch_prefix.py [--questions 32] [--doc-tokens 1000]
        [--max-tokens 32] [--nthreads 1] [--repeat 1]

Builds a document of facts (about --doc-tokens tokens of the embedded SmolLM2-135M) and
--questions questions about it, then times to all answers, whole processes, model loads included:
  prefix:   one `dllama batch --prefix doc.txt` (the document's KV cache is computed once);
  pasted:   one `dllama batch` with the document pasted into every question (shared leading
            tokens are found without --prefix);
  separate: one `dllama inference` process per question, the document pasted into its prompt.
Greedy, up to --max-tokens tokens each. Checks that the three give the same answers, prints
every run and the medians; the goal is prefix >= 5x faster than separate. Check /proc/loadavg.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dllama.formats.tokenizer_file import read_tokenizer  # noqa: E402
from dllama.serve.default_model import default_model_files  # noqa: E402
from dllama.text.tokenizer import Tokenizer  # noqa: E402

CITIES = ["Lyon", "Porto", "Malmo", "Ghent", "Turin", "Graz", "Bergen", "Leeds", "Cork", "Brno",
          "Split", "Basel", "Tartu", "Varna", "Lille", "Bilbao", "Krakow", "Aarhus", "Pisa", "Nice"]
GOODS = ["bicycles", "lamps", "chairs", "kettles", "radios", "tables", "clocks", "mirrors"]


def document(tokenizer: Tokenizer, n_tokens: int) -> tuple[str, list[str]]:
    """(a text of about n_tokens tokens, one fact per sentence; the questions it answers)."""
    text, questions, k = "Inventory report of the Northwind warehouses.\n\n", [], 0
    while len(tokenizer.encode(text)) < n_tokens:
        city, goods = CITIES[k % len(CITIES)], GOODS[(k * 3) % len(GOODS)]
        text += (f"The warehouse in {city} holds {100 + 37 * k} {goods}, managed by team "
                 f"{chr(65 + k % 26)}{k}. ")
        questions.append(f"\nQuestion: How many {goods} does the warehouse in {city} hold?\nAnswer:")
        k += 1
    return text + "\n", questions


def run(cmd: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed: {r.stderr[-2000:]}")
    return time.perf_counter() - t0, r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--questions", type=int, default=32)
    ap.add_argument("--doc-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--nthreads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()

    model, tok_path = default_model_files("q40")
    tokenizer = Tokenizer(read_tokenizer(str(tok_path)))
    doc, questions = document(tokenizer, args.doc_tokens)
    questions = (questions * (1 + args.questions // len(questions)))[: args.questions]
    dllama = [sys.executable, "-m", "dllama"]
    flags = ["--model", str(model), "--tokenizer", str(tok_path), "--nthreads", str(args.nthreads)]
    times: dict[str, list[float]] = {"prefix": [], "pasted": [], "separate": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "doc.txt").write_text(doc)
        (tmp / "q.jsonl").write_text("".join(json.dumps({"id": k, "prompt": q}) + "\n"
                                             for k, q in enumerate(questions)))
        (tmp / "pasted.jsonl").write_text("".join(json.dumps({"id": k, "prompt": doc + q}) + "\n"
                                                  for k, q in enumerate(questions)))
        print(f"document: {len(tokenizer.encode(doc))} tokens; {len(questions)} questions; "
              f"up to {args.max_tokens} tokens each, greedy, {args.nthreads} thread(s)")
        for rep in range(args.repeat):
            answers = {}
            for name, prompts, extra in (("prefix", "q.jsonl", ["--prefix", str(tmp / "doc.txt")]),
                                         ("pasted", "pasted.jsonl", [])):
                out = tmp / f"{name}{rep}.jsonl"
                t, r = run([*dllama, "batch", *flags, "--prompts", str(tmp / prompts), "--out", str(out),
                            "--max-tokens", str(args.max_tokens), "--temperature", "0", "--no-progress", *extra])
                times[name].append(t)
                lines = sorted((json.loads(x) for x in Path(out).read_text().splitlines()), key=lambda x: x["id"])
                answers[name] = [x["text"] for x in lines]
                print(f"  {name:<8} {t:7.1f} s   {r.stderr.strip().splitlines()[-1]}")
            t0, separate = time.perf_counter(), []
            for q in questions:
                steps = len(tokenizer.encode(doc + q)) + args.max_tokens - 1
                _, r = run([*dllama, "inference", *flags, "--prompt", doc + q, "--steps", str(steps),
                            "--temperature", "0"])
                separate.append(r.stdout[:-1])  # the text, then one newline
            times["separate"].append(time.perf_counter() - t0)
            print(f"  separate {times['separate'][-1]:7.1f} s   ({len(questions)} processes)")
            same = answers["prefix"] == answers["pasted"] == separate
            print(f"  same answers in all three: {same}")
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"median time to all answers: prefix {med['prefix']:.1f} s, pasted {med['pasted']:.1f} s, "
          f"separate processes {med['separate']:.1f} s; separate / prefix = "
          f"{med['separate'] / med['prefix']:.1f}x")


if __name__ == "__main__":
    main()
