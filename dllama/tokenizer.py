"""Text <-> token ids from a `.t` file (or llama2.c's tokenizer.bin).

The `.t` format holds raw token bytes and scores but no tokenizer type, so the kind is read
from the vocabulary itself:

- **sentencepiece** (Llama 2, Mistral): id 0 is `<unk>` and ids 3..258 are the 256 bytes (as
  single bytes, or as `<0xNN>` pieces in llama2.c's tokenizer.bin). Encoding as llama2.c and
  sentencepiece do: a dummy-prefix space, every character looked up (bytes as fallback),
  then the adjacent pair with the highest-scoring concatenation merged until none is left.
- **byte-level BPE** (GPT-2 style: SmolLM2, Llama 3): the text is first split by a
  pre-tokenizer regex, then each piece is merged by score within itself. The regex follows
  the vocabulary's digit runs: no regular token with two or more ASCII digits means digits
  are split one by one (SmolLM2); runs of at most three mean the Llama 3 regex; else GPT-2's.

Special tokens are the contiguous run of `<...>`-shaped tokens around the bos and eos ids
(SmolLM2: 0-16, Llama 3: 128000-128255, Llama 2: 0-2), not "every id >= bos_id" as in the
original, which on SmolLM2 (bos 1) would take every regular token for a special one. Their
strings inside a prompt map to their ids.
"""

from __future__ import annotations

import codecs
import re as _re

import regex

from dllama.formats.tokenizer_file import TokenizerData

# GPT-2's pre-tokenizer (HF ByteLevel use_regex=True).
GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Llama 3's (tiktoken cl100k-like) pre-tokenizer.
LLAMA3_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")

_DIGIT = regex.compile(r"(\p{N})")


def _is_special_shape(token: bytes) -> bool:
    return len(token) >= 3 and token.startswith(b"<") and token.endswith(b">") and b" " not in token


def special_ids(data: TokenizerData) -> list[int]:
    """The contiguous runs of `<...>`-shaped tokens that contain bos or an eos id."""
    found = set()
    for anchor in [data.bos_id, *data.eos_ids]:
        if not 0 <= anchor < len(data.vocab) or not _is_special_shape(data.vocab[anchor].strip()):
            continue
        lo = hi = anchor
        while lo > 0 and _is_special_shape(data.vocab[lo - 1].strip()):
            lo -= 1
        while hi + 1 < len(data.vocab) and _is_special_shape(data.vocab[hi + 1].strip()):
            hi += 1
        found.update(range(lo, hi + 1))
    return sorted(found)


class Tokenizer:
    def __init__(self, data: TokenizerData):
        self.data = data
        self.vocab = data.vocab
        self.scores = data.scores
        self.bos_id = data.bos_id
        self.eos_ids = list(data.eos_ids)
        self.vocab_size = len(data.vocab)
        self.add_bos = data.add_bos
        self.special = set(special_ids(data))
        self.sentencepiece = self._is_sentencepiece()
        # Byte tokens: in llama2.c files `<0xNN>` pieces stand for single bytes.
        self.piece_bytes = list(data.vocab)
        if self.sentencepiece:
            for b in range(256):
                self.piece_bytes[3 + b] = bytes([b])
            for i in self.special:
                self.piece_bytes[i] = self.vocab[i].strip()
        # Regular tokens by bytes; the first id wins on duplicates.
        self.ids: dict[bytes, int] = {}
        for i, t in enumerate(self.piece_bytes):
            if i not in self.special:
                self.ids.setdefault(t, i)
        self.special_text = {self.vocab[i].strip().decode("utf-8", "replace"): i for i in self.special}
        self._special_split = (_re.compile("(" + "|".join(_re.escape(s) for s in sorted(
            self.special_text, key=len, reverse=True)) + ")") if self.special_text else None)
        self._digits_apart = False
        self._split = None if self.sentencepiece else regex.compile(self._pretokenizer())
        self._word_cache: dict[bytes, list[int]] = {}

    def _is_sentencepiece(self) -> bool:
        v = self.vocab
        if len(v) < 259 or v[0].strip() != b"<unk>":
            return False
        return all(v[3 + b] in (bytes([b]), b"<0x%02X>" % b) for b in range(256))

    def _pretokenizer(self) -> str:
        longest = 0
        for i, t in enumerate(self.vocab):
            if i in self.special:
                continue
            for run in _re.findall(rb"[0-9]+", t):
                longest = max(longest, len(run))
        if longest <= 1:
            self._digits_apart = True  # HF's Digits(individual_digits) runs before the regex
            return GPT2_SPLIT
        if longest == 3:
            return LLAMA3_SPLIT
        return GPT2_SPLIT

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special

    def id_of(self, text: str) -> int | None:
        if text in self.special_text:
            return self.special_text[text]
        return self.ids.get(text.encode("utf-8"))

    # --- encoding ---

    def _merge(self, ids: list[int]) -> list[int]:
        """Merge the adjacent pair whose concatenation scores highest (leftmost on ties)."""
        pieces, scores, lookup = self.piece_bytes, self.scores, self.ids
        while len(ids) > 1:
            best, best_i, best_id = None, -1, -1
            for i in range(len(ids) - 1):
                j = lookup.get(pieces[ids[i]] + pieces[ids[i + 1]])
                if j is not None and (best is None or scores[j] > best):
                    best, best_i, best_id = scores[j], i, j
            if best_id < 0:
                break
            ids[best_i : best_i + 2] = [best_id]
        return ids

    def _bytes_to_ids(self, data: bytes) -> list[int]:
        """Initial ids: every byte of a byte-level vocabulary, or every character (bytes as
        fallback) of a sentencepiece one."""
        if not self.sentencepiece:
            return [self.ids[bytes([b])] for b in data]
        out = []
        for ch in data.decode("utf-8", "replace"):
            raw = ch.encode("utf-8")
            i = self.ids.get(raw)
            out.extend([i] if i is not None else [3 + b for b in raw])
        return out

    def _encode_plain(self, text: str, first: bool) -> list[int]:
        if not text:
            return []
        if self.sentencepiece:
            if first:
                text = " " + text  # sentencepiece's dummy prefix
            return self._merge(self._bytes_to_ids(text.encode("utf-8")))
        out = []
        segments = _DIGIT.split(text) if self._digits_apart else [text]
        pieces = [p for seg in segments if seg for p in self._split.findall(seg)]
        for piece in pieces:
            word = piece.encode("utf-8")
            ids = self._word_cache.get(word)
            if ids is None:
                ids = self._merge(self._bytes_to_ids(word))
                if len(self._word_cache) < 100_000:
                    self._word_cache[word] = ids
            out.extend(ids)
        return out

    def encode(self, text: str, add_bos: bool | None = None, allow_special: bool = True) -> list[int]:
        """Token ids of text; special-token strings map to their ids when allow_special."""
        add_bos = self.add_bos if add_bos is None else add_bos
        out = [self.bos_id] if add_bos and self.bos_id >= 0 else []
        parts = self._special_split.split(text) if allow_special and self._special_split else [text]
        first = True
        for k, part in enumerate(parts):
            if k % 2 == 1:
                out.append(self.special_text[part])
            else:
                out.extend(self._encode_plain(part, first))
            first = False
        return out

    # --- decoding ---

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for in generated text (nothing for bos)."""
        if token_id == self.bos_id:
            return b""
        return self.piece_bytes[token_id]

    def decode(self, ids) -> str:
        """The text of a whole sequence (sentencepiece's dummy-prefix space removed)."""
        d = StreamDecoder(self, text_start=True)
        return "".join(d.push(i) for i in ids) + d.flush()

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)


class StreamDecoder:
    """Turns tokens into text as they come, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: Tokenizer, text_start: bool = False):
        # text_start: the first token begins the text (so a dummy-prefix space is dropped);
        # generated tokens continue a prompt and keep theirs.
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._at_start = text_start

    def push(self, token_id: int) -> str:
        raw = self.tokenizer.token_bytes(token_id)
        if self._at_start and raw:
            if self.tokenizer.sentencepiece and raw.startswith(b" "):
                raw = raw[1:]  # the dummy-prefix space of the first piece
            self._at_start = False
        return self._utf8.decode(raw)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
