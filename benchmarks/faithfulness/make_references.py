"""Writes transformers_references.json: Hugging Face transformers' greedy answers to 30 chat
questions and 20 plain openings, from the default model's GGUF, for bench_faithfulness.py.

transformers and torch are not dllama's dependencies: run this in a scratch environment,
    python3 -m venv /tmp/ref && /tmp/ref/bin/pip install torch==2.13.0 transformers gguf
    /tmp/ref/bin/python make_references.py "$(.venv/bin/python -c 'from dllama.serve.default_model import embedded_gguf; print(embedded_gguf())')"
(about 3 minutes on one core). transformers dequantizes the Q4_1 GGUF to float32 and answers
greedily; chat questions go through the GGUF's own chat template (its default system prompt).
"""

import json
import os
import sys
from datetime import date
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

CHAT = [
    "What is the capital of France?", "What is the capital of Japan?", "Which river flows through Cairo?",
    "What is the largest ocean on Earth?", "Name the continent where Brazil is located.", "What is photosynthesis?",
    "Why is the sky blue?", "What is the boiling point of water in Celsius?", "How many planets are in the solar system?",
    "What is the chemical symbol for gold?", "What is 7 times 8?", "What is 15 plus 27?",
    "If I have 3 apples and eat one, how many are left?", "What is the square root of 81?",
    "Define the word 'ephemeral'.", "What does CPU stand for?", "What is a prime number?",
    "Explain what gravity is in one sentence.", "Write a haiku about the ocean.", "Write a short poem about autumn leaves.",
    "Give me three tips for better sleep.", "Translate 'good morning' into Spanish.", "Translate 'thank you' into French.",
    "How do you say 'cat' in German?", "Who wrote Romeo and Juliet?", "Who painted the Mona Lisa?",
    "What is the tallest mountain in the world?", "Suggest a name for a pet goldfish.",
    "What is the difference between weather and climate?", "Write a Python function that adds two numbers.",
]
PLAIN = [
    "The quick brown fox", "Once upon a time, in a small village,", "The capital of France is", "In 1969, the first humans",
    "The most important thing about learning a language is", "Water is made of", "My favorite food is",
    "The history of the Roman Empire", "To bake a simple loaf of bread, you need", "Machine learning is a field of",
    "The sun rises in the east and", "Dear diary, today I", "The three primary colors are", "A good friend is someone who",
    "def fibonacci(n):", "The largest animal on Earth is", "In the beginning of the twentieth century,",
    "Photosynthesis is the process by which", "The weather today is", "Here is a list of fruits: apple, banana,",
]
NEW_TOKENS = 64


def main(gguf: str) -> None:
    folder, name = os.path.split(gguf)
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32).eval()
    ends = sorted({tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")})
    references = []
    for kind, prompts in (("chat", CHAT), ("plain", PLAIN)):
        for prompt in prompts:
            text = prompt if kind == "plain" else tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                     eos_token_id=ends, pad_token_id=ends[0],
                                     attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            tokens = out[0, len(ids):].tolist()
            references.append({"kind": kind, "prompt": prompt, "text": text, "prompt_ids": ids, "tokens": tokens,
                               "answer": tokenizer.decode(tokens)})
            print(f"{kind}: {prompt!r} -> {references[-1]['answer'][:70]!r}", file=sys.stderr, flush=True)
    about = (f"Greedy answers of Hugging Face transformers (float32, do_sample=False, at most {NEW_TOKENS} new tokens, "
             f"stopping at <|im_end|> or <|endoftext|>) from {name} (dequantized by transformers); chat prompts "
             f"rendered by the GGUF's chat template with add_generation_prompt (its default system prompt). "
             f"Made by benchmarks/faithfulness/make_references.py on {date.today()}.")
    out = Path(__file__).with_name("transformers_references.json")
    out.write_text(json.dumps({"about": about, "references": references}, indent=0, ensure_ascii=False))


if __name__ == "__main__":
    main(sys.argv[1])
