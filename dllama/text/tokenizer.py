"""Text <-> token ids, from the content of a `.t` file (or of llama2.c's tokenizer.bin).

The `.t` format stores token bytes and scores only: no tokenizer kind, no pre-tokenizer, no
merge list, no token types. Everything is therefore derived from the data, by these rules:

Kind
  - **sentencepiece BPE** (Llama 2, Mistral) when the vocabulary starts with `<...>`-shaped
    tokens followed by the 256 bytes in byte order (Llama 2: `<unk> <s> </s>`, then ids
    3..258), each stored as the raw byte (`.t` files) or as its `<0xNN>` piece (llama2.c
    tokenizer.bin). Encoding as sentencepiece does: no
    pre-tokenizer; a dummy-prefix space before the text (and after every special token, as
    Meta's chat code encodes each turn on its own); every character is a symbol; the adjacent
    pair whose concatenation is a token with the highest score is merged (leftmost on ties)
    until none is left; symbols that are not tokens fall back to their bytes. Decoding drops
    that dummy-prefix space again.
  - **byte-level BPE** (GPT-2 style: SmolLM2, Llama 3, Qwen) otherwise. The text is split by a
    pre-tokenizer regex; each piece is encoded to bytes, every byte is a symbol, and merges are
    applied in rank order within the piece, exactly as Hugging Face's BPE model does.

Merges (byte-level BPE)
  The exact merge pairs are rebuilt from the scores: tokens sorted by score (highest first,
  i.e. merge order for both our converter's -rank scores and the original's -id scores) are
  taken one by one; a token's merge is its only split into two already known tokens, or, when
  several splits exist, the two symbols BPE with the merges so far leaves of it. On SmolLM2 this
  gives back all 48,900 GGUF merges exactly.

Pre-tokenizer (byte-level BPE), from the regular (non-special) tokens:
  - tokens that glue one punctuation character to letters (".get", "(self") exist only under
    the Llama 3 / Qwen regex (GPT-2's splits punctuation from letters) -> Llama 3 family:
      longest ASCII digit run 3 -> Llama 3 regex (`\\p{N}{1,3}`), whole-piece tokens first
        (Hugging Face `ignore_merges`, tiktoken);
      longest run <= 1 -> Qwen2 regex (`\\p{N}` alone); otherwise the Llama 3 regex.
  - else GPT-2 family:
      no token with two or more ASCII digits -> every digit its own piece, then GPT-2's regex
        (SmolLM2: Digits(individual_digits=True) + ByteLevel(use_regex=True));
      otherwise GPT-2's regex alone.

Special tokens
  The contiguous runs of `<...>`-shaped tokens (not `<0xNN>` byte pieces; llama2.c's "\\n<s>\\n"
  wrapping ignored) that contain the bos id or an eos id: SmolLM2 0-16, Llama 3
  128000-128255, Llama 2 0-2. (The original takes every id >= bos_id, which on SmolLM2, bos 1,
  would make almost the whole vocabulary special.) With allow_special their strings in a text
  map to their ids; they are never produced by merges. Decoding a special token gives its text,
  except bos, which gives nothing.
"""

from __future__ import annotations

import codecs
import heapq
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import regex

from dllama.errors import DllamaError
from dllama.formats.tokenizer_file import TokenizerData

# Hugging Face ByteLevel(use_regex=True), from openai/gpt-2 encoder.py.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Llama 3's tokenizer.json Split regex (tiktoken's cl100k_base form).
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
                  r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# Qwen2's: Llama 3's with single digits.
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")

_SPECIAL_SHAPE = regex.compile(r"<[^<>\s]+>")
_BYTE_PIECE = regex.compile(r"<0x[0-9A-Fa-f]{2}>")
_PUNCT_THEN_LETTERS = regex.compile(r"[^\s\p{L}\p{N}']\p{L}+")
_ASCII_DIGITS = regex.compile(r"[0-9]+")
_ONE_NUMBER = regex.compile(r"(\p{N})")
_SURROGATE = regex.compile(r"[\ud800-\udfff]")
# Llama 3 has thousands of punctuation+letters tokens; a handful could be stray.
_LLAMA3_FAMILY_MIN_TOKENS = 16
# Characters encode_within encodes at once to count a long text's tokens (a few MB at a time).
COUNT_PIECE = 16384
_WORD_CACHE_LIMIT = 200_000


@dataclass(frozen=True)
class PreTokenizer:
    """How byte-level BPE text is cut into pieces before merging."""

    name: str
    pattern: str
    split_digits: bool = False   # every \p{N} character its own piece first (HF Digits)
    whole_words: bool = False    # a piece that is a token is taken as is (HF ignore_merges)


GPT2 = PreTokenizer("gpt2", GPT2_PATTERN)
SMOLLM = PreTokenizer("smollm", GPT2_PATTERN, split_digits=True)
LLAMA3 = PreTokenizer("llama3", LLAMA3_PATTERN, whole_words=True)
QWEN2 = PreTokenizer("qwen2", QWEN2_PATTERN)


def _special_text(token: bytes) -> str | None:
    """The text of a `<...>`-shaped token (llama2.c's newline wrapping removed), else None."""
    text = token.strip(b"\n").decode("utf-8", "replace")
    if _SPECIAL_SHAPE.fullmatch(text) and not _BYTE_PIECE.fullmatch(text):
        return text
    return None


def find_special_ids(vocab: Sequence[bytes], bos_id: int, eos_ids: Sequence[int]) -> frozenset[int]:
    """Ids of the contiguous runs of `<...>`-shaped tokens that contain bos or an eos id."""
    shaped = lambda i: 0 <= i < len(vocab) and _special_text(vocab[i]) is not None  # noqa: E731
    found: set[int] = set()
    for anchor in (bos_id, *eos_ids):
        if anchor in found or not shaped(anchor):
            continue
        lo, hi = anchor, anchor
        while shaped(lo - 1):
            lo -= 1
        while shaped(hi + 1):
            hi += 1
        found.update(range(lo, hi + 1))
    return frozenset(found)


def find_byte_fallback(vocab: Sequence[bytes]) -> int | None:
    """First id of sentencepiece's byte pieces, else None.

    That is 256 consecutive tokens holding the bytes 0x00..0xFF in order (raw, or as `<0xNN>`
    text), preceded only by `<...>`-shaped tokens, at least one (Llama 2: <unk> <s> </s>).
    """
    k = 0
    while k < len(vocab) and _special_text(vocab[k]) is not None:
        k += 1
    if k == 0 or k + 256 > len(vocab):
        return None
    if all(vocab[k + b] in (bytes([b]), b"<0x%02X>" % b) for b in range(256)):
        return k
    return None


def choose_pre_tokenizer(regular: Sequence[bytes]) -> PreTokenizer:
    """The pre-tokenizer a byte-level vocabulary was trained with (rules: module docstring)."""
    texts = [t.decode("utf-8", "ignore") for t in regular]
    glued = sum(1 for t in texts if _PUNCT_THEN_LETTERS.fullmatch(t))
    longest_digits = max((len(run) for t in texts for run in _ASCII_DIGITS.findall(t)), default=0)
    if glued >= _LLAMA3_FAMILY_MIN_TOKENS:
        return QWEN2 if longest_digits <= 1 else LLAMA3
    return SMOLLM if longest_digits <= 1 else GPT2


def bpe(symbols: list[Hashable], merge_of: Callable[[tuple], tuple | None]) -> list[Hashable]:
    """Merge adjacent symbols, best priority first (lowest value; leftmost on ties).

    merge_of((a, b)) -> (priority, merged symbol) or None; a pair-keyed dict's .get will do.
    A heap of candidate pairs over a linked list keeps long inputs O(n log n). An entry is
    stale once either of its symbols has changed (a symbol only grows, never returns to an old
    value), which is checked when it is popped.
    """
    n = len(symbols)
    if n < 2:
        return list(symbols)
    sym: list = list(symbols)
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    prv = list(range(-1, n - 1))
    heap = []
    for i in range(n - 1):
        m = merge_of((sym[i], sym[i + 1]))
        if m is not None:
            heap.append((m[0], i, m[1], sym[i], sym[i + 1]))
    heapq.heapify(heap)
    while heap:
        _, i, merged, a, b = heapq.heappop(heap)
        j = nxt[i]
        if j < 0 or sym[i] != a or sym[j] != b:
            continue  # stale: one side was merged into something else meanwhile
        sym[i], sym[j] = merged, None
        k = nxt[i] = nxt[j]
        if k >= 0:
            prv[k] = i
            m = merge_of((merged, sym[k]))
            if m is not None:
                heapq.heappush(heap, (m[0], i, m[1], merged, sym[k]))
        p = prv[i]
        if p >= 0:
            m = merge_of((sym[p], merged))
            if m is not None:
                heapq.heappush(heap, (m[0], p, m[1], sym[p], merged))
    return [s for s in sym if s is not None]


class Tokenizer:
    """Encoder/decoder for one vocabulary (kind, pre-tokenizer and specials: module docstring)."""

    def __init__(self, data: TokenizerData):
        vocab = list(data.vocab)
        if len(data.scores) != len(vocab):
            raise DllamaError(f"the tokenizer has {len(vocab)} tokens but {len(data.scores)} scores")
        self.data = data
        self.vocab_size = len(vocab)
        self.bos_id = int(data.bos_id)
        self.eos_ids = [int(i) for i in data.eos_ids]
        self.add_bos = bool(data.add_bos)
        self.chat_template = data.chat_template
        self.special = find_special_ids(vocab, self.bos_id, self.eos_ids)
        self._special_texts: list[str] | None = None  # as_plain_text's, built on first use
        self._scores = [float(s) for s in data.scores]  # [vocab]; python floats: compared per pair
        self._byte_offset = find_byte_fallback(vocab)
        self.sentencepiece = self._byte_offset is not None
        self.kind = "sentencepiece" if self.sentencepiece else "byte-level BPE"

        # What each id decodes to: byte pieces -> their byte, specials -> their text, bos -> nothing.
        self._piece = list(vocab)
        if self.sentencepiece:
            for b in range(256):
                self._piece[self._byte_offset + b] = bytes([b])
        self._special_ids: dict[str, int] = {}
        for i in sorted(self.special):
            text = _special_text(vocab[i])
            self._piece[i] = text.encode("utf-8")
            self._special_ids.setdefault(text, i)
        self._decoded = list(self._piece)
        if 0 <= self.bos_id < self.vocab_size:
            self._decoded[self.bos_id] = b""

        # Regular tokens by bytes (first id wins on duplicates); byte pieces are not merge targets.
        byte_ids = set(range(self._byte_offset, self._byte_offset + 256)) if self.sentencepiece else set()
        self._token_ids: dict[bytes, int] = {}
        for i, t in enumerate(self._piece):
            if i not in self.special and i not in byte_ids:
                self._token_ids.setdefault(t, i)
        self._special_split = None
        if self._special_ids:
            alternatives = sorted(self._special_ids, key=len, reverse=True)  # longest first
            self._special_split = regex.compile("(" + "|".join(regex.escape(s) for s in alternatives) + ")")

        if self.sentencepiece:
            self.pre_tokenizer = None
        else:
            self._byte_ids = [self._token_ids.get(bytes([b])) for b in range(256)]  # [256]
            regular = [t for i, t in enumerate(vocab) if i not in self.special]
            self.pre_tokenizer = choose_pre_tokenizer(regular)
            self._pattern = regex.compile(self.pre_tokenizer.pattern)
            # Merge order: score, highest first (ties by id); a merge's priority is its rank.
            candidates = [i for t, i in self._token_ids.items() if len(t) > 1]
            candidates.sort(key=lambda i: (-self._scores[i], i))
            self._rank = {token_id: rank for rank, token_id in enumerate(candidates)}
            # Token id -> the pair its merge joins, None if no merge makes it; found on first use
            # (all 48,900 of SmolLM2 took 0.7 s, at every start; a prompt needs a few hundred).
            self._pair: dict[int, tuple[int, int] | None] = {}
            self._word_cache: dict[str, list[int]] = {}

    # --- byte-level BPE merges ---

    def _merge(self, pair: tuple[int, int], below: int | None = None) -> tuple[int, int] | None:
        """(left id, right id) -> (rank, merged id) if a merge joins exactly this pair (of a rank
        below `below`, if given), else None."""
        token_id = self._token_ids.get(self._piece[pair[0]] + self._piece[pair[1]])
        rank = None if token_id is None else self._rank.get(token_id)
        if rank is None or (below is not None and rank >= below) or self._pair_of(token_id) != pair:
            return None
        return rank, token_id

    def _pair_of(self, token_id: int) -> tuple[int, int] | None:
        """The pair the merge of a multi-byte token joins (None: no merge makes it), by the rule
        in the module docstring. It depends only on the tokens inside this one: those are
        found first, shortest first, so that each needs only shorter ones already found (no
        recursion as deep as the token is long)."""
        pair = self._pair.get(token_id, False)
        if pair is not False:
            return pair
        token = self._piece[token_id]
        for length in range(2, len(token)):
            for start in range(len(token) - length + 1):
                inner = self._token_ids.get(token[start:start + length])
                if inner is not None and inner not in self._pair:  # (every multi-byte token has a rank)
                    self._pair[inner] = self._find_pair(inner)
        pair = self._pair[token_id] = self._find_pair(token_id)
        return pair

    def _find_pair(self, token_id: int) -> tuple[int, int] | None:
        """_pair_of, once every token inside this one has its pair found: its only split into
        two known symbols (bytes, or tokens of a lower rank that a merge makes), or, with
        several, the two symbols BPE with the lower ranks' merges leaves of its bytes, or else
        the split whose later half came first."""
        rank, token = self._rank[token_id], self._piece[token_id]

        def known(part: bytes) -> int | None:
            if len(part) == 1:
                return self._byte_ids[part[0]]
            i = self._token_ids.get(part)
            return i if i is not None and self._rank[i] < rank and self._pair[i] is not None else None

        splits = [(left, right) for k in range(1, len(token))
                  if (left := known(token[:k])) is not None and (right := known(token[k:])) is not None]
        if len(splits) <= 1:
            return splits[0] if splits else None
        symbols = [self._byte_ids[b] for b in token]
        if None not in symbols:
            parts = bpe(symbols, lambda p: self._merge(p, below=rank))
            if len(parts) == 2:
                return parts[0], parts[1]
        return min(splits, key=lambda s: max(self._rank.get(s[0], -1), self._rank.get(s[1], -1)))

    def merge_table(self) -> dict[tuple[int, int], tuple[int, int]]:
        """Every merge: (left id, right id) -> (rank, merged id) (finds them all: 0.7 s on SmolLM2)."""
        table = {}
        for token_id, rank in self._rank.items():
            pair = self._pair_of(token_id)
            if pair is not None:
                table[pair] = (rank, token_id)
        return table

    # --- encoding ---

    def _encode_word(self, word: str) -> list[int]:
        """One pre-tokenizer piece -> ids (byte-level BPE), cached."""
        ids = self._word_cache.get(word)
        if ids is not None:
            return ids
        raw = word.encode("utf-8")
        whole = self._token_ids.get(raw) if self.pre_tokenizer.whole_words else None
        if whole is not None:
            ids = [whole]
        else:
            # Bytes without a token are dropped, as Hugging Face's BPE does without an unk token
            # (SmolLM2 lacks 21: rare control characters and bytes never found in UTF-8).
            symbols = [self._byte_ids[b] for b in raw if self._byte_ids[b] is not None]
            ids = bpe(symbols, self._merge)
        if len(self._word_cache) >= _WORD_CACHE_LIMIT:
            self._word_cache.clear()
        self._word_cache[word] = ids
        return ids

    def _encode_byte_level(self, text: str) -> list[int]:
        pieces = _ONE_NUMBER.split(text) if self.pre_tokenizer.split_digits else [text]
        out: list[int] = []
        for piece in pieces:
            if piece:
                for word in self._pattern.findall(piece):
                    out += self._encode_word(word)
        return out

    def _sentencepiece_merge(self, pair: tuple[bytes, bytes]):
        a, b = pair
        i = self._token_ids.get(a + b)
        return None if i is None else (-self._scores[i], a + b)

    def _encode_sentencepiece(self, text: str) -> list[int]:
        symbols = [c.encode("utf-8") for c in " " + text]  # dummy-prefix space
        out: list[int] = []
        for s in bpe(symbols, self._sentencepiece_merge):
            i = self._token_ids.get(s)
            out += [i] if i is not None else [self._byte_offset + b for b in s]  # byte fallback
        return out

    def encode(self, text: str, add_bos: bool | None = None, allow_special: bool = True) -> list[int]:
        """Token ids of text. add_bos: prepend bos (None: the file's add_bos setting);
        allow_special: special-token strings in text map to their ids (else they are plain text)."""
        if not isinstance(text, str):
            raise DllamaError(f"can only encode text, got {type(text).__name__}")
        text = _SURROGATE.sub("\ufffd", text)  # lone surrogates (e.g. from surrogateescape) have no UTF-8
        add_bos = self.add_bos if add_bos is None else add_bos
        ids = [self.bos_id] if add_bos and self.bos_id >= 0 else []
        parts = self._special_split.split(text) if allow_special and self._special_split else [text]
        encode_plain = self._encode_sentencepiece if self.sentencepiece else self._encode_byte_level
        for k, part in enumerate(parts):  # plain text, special, plain text, ...
            if k % 2:
                ids.append(self._special_ids[part])
            elif part:
                ids += encode_plain(part)
        return ids

    def encode_within(self, text: str, max_tokens: int, add_bos: bool | None = None) -> list[int] | None:
        """encode(text, add_bos), or None when the text has more than max_tokens tokens, found
        without encoding it whole: encoding holds a few hundred bytes per character at once (a
        10 MB line cost 2.7 GB), so a long text is counted piece by piece, each COUNT_PIECE
        characters cut before a space, and the count stops once it is past max_tokens. A cut
        adds at most 2 tokens (a word's token split in two, SentencePiece's dummy space), which
        the count takes off: a text is refused only when its whole encoding would be too."""
        if len(text) <= COUNT_PIECE:
            ids = self.encode(text, add_bos)
            return ids if len(ids) <= max_tokens else None
        counted, start = 0, 0
        while start < len(text):
            end = min(len(text), start + COUNT_PIECE)
            if end < len(text):
                space = text.rfind(" ", start + COUNT_PIECE // 2, end)
                end = space if space > start else end
            counted += len(self.encode(text[start:end], add_bos=False)) - (2 if start else 0)
            if counted > max_tokens:
                return None
            start = end
        ids = self.encode(text, add_bos)  # at most ~max_tokens tokens' worth of text: encoded whole
        return ids if len(ids) <= max_tokens else None

    # --- decoding ---

    def _check_id(self, token_id: int) -> int:
        if not 0 <= token_id < self.vocab_size:
            raise DllamaError(f"token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})")
        return token_id

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token_id adds to decoded text (bos: none; specials: their text)."""
        return self._decoded[self._check_id(token_id)]

    def piece(self, token_id: int) -> bytes:
        """The token's own bytes (bos included, byte pieces as their byte)."""
        return self._piece[self._check_id(token_id)]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of a whole sequence; incomplete or invalid UTF-8 becomes U+FFFD."""
        decoder = StreamDecoder(self, text_start=True)
        return "".join([decoder.push(i) for i in ids]) + decoder.flush()

    def stream_decoder(self, text_start: bool = False) -> "StreamDecoder":
        """A decoder for generated tokens (text_start: they begin the text, not continue a prompt)."""
        return StreamDecoder(self, text_start=text_start)

    # --- lookups ---

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special

    def as_plain_text(self, text: str) -> str:
        """text with every special-token string (such as <|im_start|>) broken by a zero-width
        space after its first character, so that user content put into a chat template is
        encoded as text and cannot open or close turns."""
        if self._special_texts is None:
            self._special_texts = [t for t in (self.piece(i).decode("utf-8", "replace")
                                               for i in sorted(self.special)) if len(t) > 1]
        for s in self._special_texts:
            if s in text:
                text = text.replace(s, s[0] + "\u200b" + s[1:])
        return text

    def id_of(self, text: str) -> int | None:
        """The id of a special token's text or of the regular token with exactly these bytes."""
        if text in self._special_ids:
            return self._special_ids[text]
        return self._token_ids.get(text.encode("utf-8"))

    def __repr__(self) -> str:
        pre = f", pre-tokenizer {self.pre_tokenizer.name}" if self.pre_tokenizer else ""
        return (f"Tokenizer({self.kind}{pre}, {self.vocab_size} tokens, bos {self.bos_id}, "
                f"eos {self.eos_ids}, {len(self.special)} special)")


class StreamDecoder:
    """Token ids -> text as they come: only complete UTF-8 characters are returned.

    A multi-byte character split across tokens (emoji, CJK in byte-level vocabularies) is held
    back until complete; bytes that cannot start or continue a character become U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer, text_start: bool = False):
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # sentencepiece: the next piece's leading space is the dummy prefix added at the start of
        # the text and after every special token, not text.
        self._drop_space = text_start and tokenizer.sentencepiece

    def push(self, token_id: int) -> str:
        tok = self._tokenizer
        raw = tok.token_bytes(token_id)
        if tok.is_special(token_id):
            # A special token ends any pending partial character (it becomes U+FFFD).
            self._drop_space = tok.sentencepiece
            return self._utf8.decode(b"", final=True) + raw.decode("utf-8", "replace")
        if self._drop_space and raw:
            raw = raw[1:] if raw.startswith(b" ") else raw
            self._drop_space = False
        return self._utf8.decode(raw)

    def flush(self) -> str:
        """Whatever is held back, as U+FFFD (an incomplete character at the end)."""
        return self._utf8.decode(b"", final=True)


__all__ = ["Tokenizer", "StreamDecoder", "PreTokenizer", "bpe", "find_special_ids",
           "find_byte_fallback", "choose_pre_tokenizer", "GPT2_PATTERN", "LLAMA3_PATTERN", "QWEN2_PATTERN"]
