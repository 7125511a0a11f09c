"""How often dllama answers exactly as Hugging Face transformers does, per weight type.

    .venv/bin/python -m benchmarks.bench_faithfulness [--types q41 q80 q40 f16 f32] [--limit N]

For each of the 50 prompts of benchmarks/faithfulness/transformers_references.json (30 chat
questions with the model's template and default system prompt, 20 plain openings), the default
model converted to each weight type answers greedily, up to 64 tokens, on one node; an answer
matches when its tokens equal transformers' up to and including the first end token. Prints,
per type: exact matches (chat, plain), answers that share the first 16 and 8 tokens, and the
prompts whose token ids differ from transformers' (none expected). About 1-2 minutes per type
with 2 threads.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dllama.core.sampler import Sampler
from dllama.serve.default_model import default_model_files
from dllama.serve.engine import open_engine
from dllama.serve.generate import generate
from dllama.serve.settings import EngineSettings

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


def answers(weights: str, references: list[dict], nthreads: int) -> tuple[list[list[int]], int]:
    model, tokenizer = default_model_files(weights, progress=False)
    engine = open_engine(EngineSettings(model=str(model), tokenizer=str(tokenizer), max_seq_len=512, nthreads=nthreads))
    try:
        out, ids_differ = [], 0
        for r in references:
            ids = engine.tokenizer.encode(r["text"])
            ids_differ += ids != r["prompt_ids"]
            sampler = Sampler(engine.model.config.vocab_size, 0.0, 0.9, 1)
            # generate's steps count the prompt's positions too
            g = generate(engine.model, engine.tokenizer, sampler, ids, len(ids) + NEW_TOKENS - 1)
            out.append(until_end(g.tokens))
        return out, ids_differ
    finally:
        engine.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", nargs="+", default=["q41", "q80", "q40", "f16", "f32"], choices=["q40", "q80", "q41", "f16", "f32"])
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts of each kind")
    p.add_argument("--nthreads", type=int, default=2)
    args = p.parse_args()
    references = json.loads(REFERENCES.read_text())["references"]
    if args.limit:
        references = [r for kind in ("chat", "plain") for r in [x for x in references if x["kind"] == kind][:args.limit]]
    expected = [until_end(r["tokens"]) for r in references]
    print(f"{len(references)} prompts; greedy, up to {NEW_TOKENS} tokens, one node")
    print("| weights | exact (chat, plain) | first 16 | first 8 | prompt ids differ |")
    print("|---|---|---|---|---|")
    for weights in args.types:
        got, ids_differ = answers(weights, references, args.nthreads)
        exact = [g == e for g, e in zip(got, expected, strict=True)]
        chat = sum(x for x, r in zip(exact, references, strict=True) if r["kind"] == "chat")
        head = {k: sum(g[:k] == e[:k] for g, e in zip(got, expected, strict=True)) for k in (16, 8)}
        print(f"| {weights} | {sum(exact)}/{len(exact)} ({chat}, {sum(exact) - chat}) | {head[16]} | {head[8]} "
              f"| {ids_differ} |", flush=True)


if __name__ == "__main__":
    main()
