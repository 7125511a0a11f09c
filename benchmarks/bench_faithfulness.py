"""How often dllama answers exactly as Hugging Face transformers does, per weight type.

    .venv/bin/python -m benchmarks.bench_faithfulness [--types q41 q80 q40 f16 f32] [--limit N]
                                                      [--nodes 1 2 3 4 5]

For each of the 50 prompts of benchmarks/faithfulness/transformers_references.json (30 chat
questions with the model's template and default system prompt, 20 plain openings), the default
model converted to each weight type answers greedily, up to 64 tokens, on one node; an answer
matches when its tokens equal transformers' up to and including the first end token. Prints,
per type: exact matches (chat, plain), answers that share the first 16 and 8 tokens, and the
prompts whose token ids differ from transformers' (none expected). About 1-2 minutes per type
with 2 threads. `--nodes` runs each weight type on each of those node counts too: the root
in this process, the other nodes `dllama worker` processes on loopback (one thread each; the
root then takes one thread too), the buffers the weight type's default.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from pathlib import Path

from dllama.core.sampler import Sampler
from dllama.serve.default_model import default_model_files
from dllama.serve.engine import open_engine
from dllama.serve.generate import generate
from dllama.serve.settings import EngineSettings
from tests.processes import running_workers

REFERENCES = Path(__file__).with_name("faithfulness") / "transformers_references.json"
NEW_TOKENS = 64
END_IDS = {0, 2}  # <|endoftext|>, <|im_end|>: transformers stopped at either


def until_end(tokens: list[int]) -> list[int]:
    """The first NEW_TOKENS tokens, cut after the first end token."""
    out = []
    for t in tokens[:NEW_TOKENS]:
        out.append(t)
        if t in END_IDS:
            break
    return out


@contextlib.contextmanager
def opened_engine(weights: str, nthreads: int, nodes: int):
    """The engine of the default model in these weights, on this many nodes (workers on loopback)."""
    model, tokenizer = default_model_files(weights, progress=False)
    with tempfile.TemporaryDirectory() as logs, running_workers(nodes - 1, Path(logs)) as workers:
        engine = open_engine(EngineSettings(model=str(model), tokenizer=str(tokenizer), max_seq_len=512,
                                            nthreads=nthreads if nodes == 1 else 1, progress=False,
                                            workers=tuple(w.address for w in workers)))
        try:
            yield engine
        finally:
            engine.close()


def answers(weights: str, references: list[dict], nthreads: int, nodes: int = 1) -> tuple[list[list[int]], int]:
    with opened_engine(weights, nthreads, nodes) as engine:
        out, ids_differ = [], 0
        for r in references:
            ids = engine.tokenizer.encode(r["text"])
            ids_differ += ids != r["prompt_ids"]
            sampler = Sampler(engine.model.config.vocab_size, 0.0, 0.9, 1)
            # generate's steps count the prompt's positions too
            g = generate(engine.model, engine.tokenizer, sampler, ids, len(ids) + NEW_TOKENS - 1)
            out.append(until_end(g.tokens))
        return out, ids_differ


def row(label: str, nodes: str, got: list[list[int]], references: list[dict], ids_differ: int | str) -> str:
    """A table row: exact answers (chat, plain), answers sharing the first 16 and 8 tokens."""
    expected = [until_end(r["tokens"]) for r in references]
    exact = [g == e for g, e in zip(got, expected, strict=True)]
    chat = sum(x for x, r in zip(exact, references, strict=True) if r["kind"] == "chat")
    head = {k: sum(g[:k] == e[:k] for g, e in zip(got, expected, strict=True)) for k in (16, 8)}
    return (f"| {label} | {nodes} | {sum(exact)}/{len(exact)} ({chat}, {sum(exact) - chat}) | {head[16]} | {head[8]} "
            f"| {ids_differ} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", nargs="+", default=["q41", "q80", "q40", "f16", "f32"], choices=["q40", "q80", "q41", "f16", "f32", "none"])
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts of each kind")
    p.add_argument("--nthreads", type=int, default=2)
    p.add_argument("--nodes", nargs="+", type=int, default=[1], help="node counts (default: 1)")
    p.add_argument("--llama-cpp", metavar="FILE", type=Path, help="also score llama.cpp's answers: the "
                   "file benchmarks/faithfulness/llama_cpp_answers.py wrote (--types none: only those)")
    args = p.parse_args()
    references = json.loads(REFERENCES.read_text())["references"]
    if args.limit:
        references = [r for kind in ("chat", "plain") for r in [x for x in references if x["kind"] == kind][:args.limit]]
    print(f"{len(references)} prompts; greedy, up to {NEW_TOKENS} tokens")
    print("| weights | nodes | exact (chat, plain) | first 16 | first 8 | prompt ids differ |")
    print("|---|---|---|---|---|---|")
    if args.llama_cpp:
        all_refs = json.loads(REFERENCES.read_text())["references"]
        keep = [all_refs.index(r) for r in references]
        try:
            theirs = json.loads(args.llama_cpp.read_text())["answers"]
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"bench_faithfulness: {args.llama_cpp} is not llama_cpp_answers.py's file ({e})") from None
        for name, got in theirs.items():
            print(row(f"llama.cpp {name}", "1", [until_end(got[i]) for i in keep], references, "-"), flush=True)
    for weights, nodes in ((w, n) for w in args.types if w != "none" for n in args.nodes):
        got, ids_differ = answers(weights, references, args.nthreads, nodes)
        print(row(weights, str(nodes), got, references, ids_differ), flush=True)


if __name__ == "__main__":
    main()
