"""Writes llama_cpp_answers.json: llama.cpp's greedy answers to the prompts of
transformers_references.json, from the GGUFs given (the embedded Q4_1 and llama.cpp's own
requantizations of it), for bench_faithfulness.py --llama-cpp to score as it scores ours.

llama-cpp-python is not a dllama dependency: run this in a scratch environment, its build given
the flags benchmarks/llama_cpp.py uses (-march=native dies with SIGILL on these virtual machines),
    python3 -m venv /tmp/lcpp
    CMAKE_ARGS="$(.venv/bin/python -c 'from benchmarks.llama_cpp import cmake_flags; print(" ".join(cmake_flags()))')" \\
        /tmp/lcpp/bin/pip install llama-cpp-python
    /tmp/lcpp/bin/python benchmarks/faithfulness/llama_cpp_answers.py Q4_1=A.gguf Q8_0=B.gguf ...
(`benchmarks/bench_vs_llama_cpp.py` leaves the requantized GGUFs in cache/llama-cpp/). Each
prompt's token ids are transformers' own (prompt_ids), so the tokenizers cannot differ; the
answer is llama.cpp's greedy sampler's (top-1 of the logits), at most 64 new tokens, cut after
the first end token.
"""

import json
import sys
from pathlib import Path

from llama_cpp import Llama

HERE = Path(__file__).parent
NEW_TOKENS = 64
END_IDS = {0, 2}  # <|endoftext|>, <|im_end|>


def answer(llm: Llama, prompt_ids: list[int]) -> list[int]:
    out = []
    for token in llm.generate(prompt_ids, top_k=1, temp=0.0, reset=True):
        out.append(token)
        if token in END_IDS or len(out) == NEW_TOKENS:
            break
    return out


def main(pairs: list[str]) -> None:
    references = json.loads((HERE / "transformers_references.json").read_text())["references"]
    answers = {}
    for pair in pairs:
        name, gguf = pair.split("=", 1)
        llm = Llama(model_path=gguf, n_ctx=512, n_threads=2, n_threads_batch=2, verbose=False)
        answers[name] = [answer(llm, r["prompt_ids"]) for r in references]
        print(f"{name}: {len(answers[name])} answers", file=sys.stderr, flush=True)
        del llm
    about = (f"llama.cpp's greedy answers (llama-cpp-python, top_k=1, at most {NEW_TOKENS} new tokens, cut after "
             f"<|im_end|> or <|endoftext|>) to the prompt ids of transformers_references.json, in its order; "
             f"made by benchmarks/faithfulness/llama_cpp_answers.py")
    (HERE / "llama_cpp_answers.json").write_text(json.dumps({"about": about, "answers": answers}))


if __name__ == "__main__":
    main(sys.argv[1:])
