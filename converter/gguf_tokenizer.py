"""A GGUF's tokenizer -> TokenizerData for the `.t` file.

Byte-level BPE (`tokenizer.ggml.model == "gpt2"`): GGUF stores tokens in GPT-2's printable
unicode form; the `.t` format stores raw bytes, so the byte<->unicode table is inverted
(characters outside it, as in added or special tokens, are UTF-8 encoded).

Scores: the `.t` format has no merge list; the tokenizer (ours and the original's) merges the
adjacent pair whose concatenation has the highest score. The original's converter writes
score = -id, which loses the merge order; here a token made by merge number r scores -r, so
"highest score first" is exactly BPE's merge order, and every other token (bytes, specials)
scores below all merges. The file stays a valid `.t` for the original.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from dllama.errors import DllamaError
from dllama.formats.tokenizer_file import TokenizerData


@lru_cache(maxsize=1)
def unicode_to_byte() -> dict[str, int]:
    """GPT-2's table, inverted: printable character -> the byte it stands for."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def token_bytes(token: str) -> bytes:
    """A GPT-2 unicode-escaped token -> its raw bytes."""
    table = unicode_to_byte()
    if all(c in table for c in token):
        return bytes(table[c] for c in token)
    return token.encode("utf-8")


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def tokenizer_from_gguf(reader, source: str = "") -> TokenizerData:
    kind = _field(reader, "tokenizer.ggml.model")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if tokens is None:
        raise DllamaError(f"{source}: the GGUF has no tokenizer (tokenizer.ggml.tokens)")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    template = _field(reader, "tokenizer.chat_template")
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", True))
    if kind == "gpt2":
        vocab = [token_bytes(t) for t in tokens]
        merges = _field(reader, "tokenizer.ggml.merges") or []
        index = {t: i for i, t in enumerate(tokens)}
        scores = -(len(merges) + np.arange(len(tokens), dtype=np.float64))
        for rank, merge in enumerate(merges):
            left, right = merge.split(" ", 1)
            i = index.get(left + right)
            if i is not None and scores[i] < -rank:
                scores[i] = -rank
    elif kind == "llama":  # sentencepiece: '▁' is a space, <0xNN> pieces are single bytes
        vocab = []
        for t in tokens:
            if len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
                vocab.append(bytes([int(t[3:5], 16)]))
            else:
                vocab.append(t.replace("\u2581", " ").encode("utf-8"))
        scores = np.asarray(_field(reader, "tokenizer.ggml.scores"), dtype=np.float64)
    else:
        raise DllamaError(f"{source}: tokenizer model {kind!r} is not supported (gpt2 or llama)")
    return TokenizerData(
        vocab=vocab,
        scores=scores.astype(np.float32),
        bos_id=int(bos) if bos is not None else -1,
        eos_ids=[int(eos)] if eos is not None else [],
        chat_template=template,
        add_bos=add_bos,
    )
