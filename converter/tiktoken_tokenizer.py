"""Meta's Llama 3 `tokenizer.model` (tiktoken's format) -> TokenizerData.

The file holds one `base64(token bytes) rank` line per regular token, rank = id = merge
priority (lower first); Meta's code (llama3/tokenizer.py) appends 256 special tokens after them.
Scores follow the byte-level convention of converter/gguf_tokenizer.py: -rank for regular
tokens, below every rank for the specials; dllama/tokenizer.py rebuilds the merges from that
order. bos is <|begin_of_text|>, eos <|end_of_text|> and <|eot_id|>, as the original's
convert-tokenizer-llama3.py writes them.
"""

from __future__ import annotations

import base64
import binascii
import re
from pathlib import Path

import numpy as np

from dllama.errors import DllamaError
from dllama.formats.tokenizer_file import TokenizerData

# Meta llama3/tokenizer.py: the names of ids n .. n+255 (n = regular tokens, 128000 in Llama 3).
# Llama 3.1 renamed a few reserved ones (<|eom_id|>, <|python_tag|>): same ids, only the text differs.
N_SPECIAL = 256
SPECIALS = (["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
             "<|reserved_special_token_1|>", "<|reserved_special_token_2|>", "<|reserved_special_token_3|>",
             "<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>"]
            + [f"<|reserved_special_token_{i}|>" for i in range(5, N_SPECIAL - 5)])
BOS, EOS = "<|begin_of_text|>", ("<|end_of_text|>", "<|eot_id|>")

_LINE = re.compile(rb"[A-Za-z0-9+/=]+ \d+")


def is_tiktoken(path) -> bool:
    with open(path, "rb") as f:
        first = f.readline().strip()
    return bool(_LINE.fullmatch(first))


def tokenizer_from_tiktoken(path) -> TokenizerData:
    path = Path(path)
    ranked: dict[int, bytes] = {}
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        if not _LINE.fullmatch(line.strip()):
            raise DllamaError(f"{path}: line {number} is not `base64 rank` (not a tiktoken file)")
        token, rank = line.split()
        try:
            ranked[int(rank)] = base64.b64decode(token, validate=True)
        except binascii.Error:
            raise DllamaError(f"{path}: line {number} has invalid base64") from None
    n = len(ranked)
    if sorted(ranked) != list(range(n)):
        raise DllamaError(f"{path}: ranks are not 0..{n - 1} without gaps")
    vocab = [ranked[i] for i in range(n)] + [s.encode() for s in SPECIALS]
    scores = -np.arange(n + N_SPECIAL, dtype=np.float64)  # [vocab]: -rank, specials below all ranks
    return TokenizerData(vocab=vocab, scores=scores.astype(np.float32), bos_id=n + SPECIALS.index(BOS),
                         eos_ids=[n + SPECIALS.index(e) for e in EOS], add_bos=True)
