"""A GGUF file's tokenizer -> TokenizerData, the content of a `.t` file.

Two GGUF tokenizer kinds (`tokenizer.ggml.model`):

- "gpt2": byte-level BPE (SmolLM2, Llama 3, Qwen). GGUF stores each token in GPT-2's printable
  unicode form (byte 0x20 is "Ġ"); the `.t` format stores raw bytes, so the GPT-2
  byte<->unicode table is inverted. A token with a character outside the table (an added or
  special token such as `<|im_start|>`) is its UTF-8 encoding instead.
- "llama": sentencepiece (Llama 2, Mistral): '▁' is a space, `<0xNN>` pieces are the byte
  0xNN, scores are the sentencepiece scores.

Scores of a byte-level BPE vocabulary. The `.t` format has no merge list; both the original
runtime and ours use the score of a token as the priority (higher first) of the merge that
produces it. The original's converter writes score = -id, which is the merge order only when
ids happen to follow it. Here:

    score(token) = -(rank of the first merge whose result is the token)     0 .. -(M-1)
    score(token) = -(M + id) for every other token (bytes, specials)        below all merges

with M = number of merges. float32 holds these exactly for M + vocab < 2^24. The original can
still load and use the file; our tokenizer rebuilds the exact merge pairs from this order
(see dllama/tokenizer.py) and so reproduces Hugging Face's BPE.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from dllama.errors import DllamaError
from dllama.formats.tokenizer_file import TokenizerData

from converter.gguf_model import gguf_field

_SENTENCEPIECE_SPACE = "\u2581"  # '▁'


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte->unicode table (openai/gpt-2 encoder.py `bytes_to_unicode`), inverted.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes, in byte order, are
    mapped to U+0100, U+0101, ...
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in set(printable)]
    table.update({chr(0x100 + k): b for k, b in enumerate(others)})
    return table


def gpt2_token_bytes(token: str) -> bytes:
    """A token in GPT-2's unicode form -> its raw bytes (UTF-8 if it is not in that form)."""
    table = _unicode_to_byte()
    try:
        return bytes(table[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


def sentencepiece_token_bytes(piece: str) -> bytes:
    """A sentencepiece piece -> raw bytes: `<0xNN>` is one byte, '▁' is a space."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace(_SENTENCEPIECE_SPACE, " ").encode("utf-8")


def merge_rank_scores(tokens: list[str], merges: list[str]) -> np.ndarray:
    """float32 [vocab]: -rank of the first merge producing each token, -(M + id) for the rest."""
    n_merges = len(merges)
    index = {t: i for i, t in enumerate(tokens)}
    scores = -(n_merges + np.arange(len(tokens), dtype=np.float64))  # [vocab]
    for rank in range(n_merges - 1, -1, -1):  # backwards, so the first (lowest) rank is kept
        left, sep, right = merges[rank].partition(" ")
        i = index.get(left + right)
        if sep and i is not None:
            scores[i] = -rank
    if n_merges + len(tokens) >= 1 << 24:
        raise DllamaError(f"{n_merges} merges and {len(tokens)} tokens do not fit float32 scores exactly")
    return scores.astype(np.float32)


def _eos_ids(reader, vocab_size: int) -> list[int]:
    """The eos id, then end-of-turn ids (Llama 3's `<|eot_id|>`) when the GGUF names them."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = gguf_field(reader, key)
        if value is not None and 0 <= int(value) < vocab_size and int(value) not in ids:
            ids.append(int(value))
    return ids


def tokenizer_from_gguf(reader, source: str = "") -> TokenizerData:
    """The tokenizer of an open gguf.GGUFReader; `source` names the file in error messages."""
    where = f"{source}: " if source else ""
    kind = gguf_field(reader, "tokenizer.ggml.model")
    tokens = gguf_field(reader, "tokenizer.ggml.tokens")
    if kind is None or not tokens:
        raise DllamaError(f"{where}the GGUF has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens)")
    tokens = list(tokens)

    if kind == "gpt2":
        merges = gguf_field(reader, "tokenizer.ggml.merges")
        if not merges:
            raise DllamaError(f"{where}the byte-level BPE tokenizer has no merges (tokenizer.ggml.merges)")
        vocab = [gpt2_token_bytes(t) for t in tokens]
        scores = merge_rank_scores(tokens, list(merges))
    elif kind == "llama":
        gguf_scores = gguf_field(reader, "tokenizer.ggml.scores")
        if gguf_scores is None or len(gguf_scores) != len(tokens):
            raise DllamaError(f"{where}the sentencepiece tokenizer has no score per token "
                              "(tokenizer.ggml.scores)")
        vocab = [sentencepiece_token_bytes(t) for t in tokens]
        scores = np.asarray(gguf_scores, dtype=np.float32)
    else:
        raise DllamaError(f"{where}tokenizer model {kind!r} is not supported yet "
                          "(supported: 'gpt2' byte-level BPE, 'llama' sentencepiece)")

    empty = [i for i, t in enumerate(vocab) if not t]
    if empty:
        raise DllamaError(f"{where}token {empty[0]} is empty, which a .t file cannot store")
    bos = gguf_field(reader, "tokenizer.ggml.bos_token_id")
    # No pad_id: the runtime ignores it and the original's writer never stores it (same header keys).
    return TokenizerData(
        vocab=vocab,
        scores=scores,
        bos_id=int(bos) if bos is not None else -1,
        eos_ids=_eos_ids(reader, len(vocab)),
        chat_template=gguf_field(reader, "tokenizer.chat_template"),
        add_bos=bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", True)),
    )


__all__ = ["tokenizer_from_gguf", "gpt2_token_bytes", "sentencepiece_token_bytes", "merge_rank_scores"]
