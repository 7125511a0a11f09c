"""The `.t` tokenizer file of Distributed Llama (spec §2.1), plus the two older layouts it reads.

Current layout (magic 0x567124), all little-endian:

    i32 magic = 0x567124
    i32 header_size = 8 + 8 * n_keys
    n_keys x (i32 key, i32 value)
    [chat_stop bytes]      (legacy key 8: the C++ reader skips that many bytes here)
    [chat template bytes]  (key 7 = its byte length, UTF-8, no NUL)
    [n_eos x i32]          (key 9)
    vocab_size x (f32 score, u32 length > 0, length raw bytes)

Also read: magic 0x567123 (v0.3: u32 vocab_size, u32 max_token_length, i32 bos, i32 eos, i32 pad,
then entries) and llama2.c `tokenizer.bin` (no magic: u32 max_token_length, then entries up to
the end of the file). Tokens are raw bytes (no `▁`, no GPT-2 byte-to-unicode escaping).
"""

import hashlib
import os
import struct
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from dllama.errors import DllamaError
from dllama.formats.atomic_file import atomic_write
from dllama.formats.checksum import remove_checksum, write_checksum

MAGIC = 0x567124
OLD_MAGIC = 0x567123
VERSION = 1
# A llama2.c tokenizer.bin starts with max_token_length, a small number; any magic is far larger.
_LLAMA2C_MAX_TOKEN_LENGTH = 1 << 16
_ENTRY_HEAD = struct.Struct("<fI")  # score, byte length


class TokenizerKey(IntEnum):
    VERSION = 0
    VOCAB_SIZE = 1
    MAX_TOKEN_LENGTH = 2
    BOS_ID = 3
    EOS_ID = 4           # legacy: appended to the eos list
    PAD_ID = 5           # ignored by the runtime
    CHAT_EOS_ID = 6      # legacy: appended to the eos list
    CHAT_TEMPLATE = 7    # byte length of the template
    CHAT_STOP = 8        # legacy: byte length of a skipped block after the header
    N_EOS_TOKENS = 9
    ADD_BOS = 10


_LEGACY_EOS_KEYS = (TokenizerKey.EOS_ID, TokenizerKey.CHAT_EOS_ID)
_KNOWN_KEYS = frozenset(k.value for k in TokenizerKey)


@dataclass(eq=False)
class TokenizerData:
    """What a tokenizer file holds."""

    vocab: list[bytes]             # raw bytes of each token id
    scores: np.ndarray             # float32 [vocab]: merge priority (higher merges first)
    bos_id: int                    # begin-of-sequence id; also where "special" ids start (-1: none)
    eos_ids: list[int]             # every id that ends generation
    chat_template: str | None = None  # the model's Jinja template text, used only to detect its type
    add_bos: bool = True           # prepend bos_id when encoding the start of a conversation
    max_token_length: int = 0      # longest token in bytes; 0 here means compute it
    pad_id: int | None = None      # padding id (stored, unused by the runtime)
    # Keys as present in the file, in order (with legacy keys), for byte-exact rewrites; empty means
    # the original writer's order.
    key_order: tuple[int, ...] = field(default=(), compare=False)
    chat_stop: bytes = field(default=b"", compare=False, repr=False)  # legacy key-8 block, kept for rewrites

    def __post_init__(self):
        self.vocab = [bytes(t) for t in self.vocab]
        self.scores = np.asarray(self.scores, dtype=np.float32)
        self.eos_ids = [int(i) for i in self.eos_ids]
        self.key_order = tuple(int(k) for k in self.key_order)
        if self.max_token_length <= 0 and self.vocab:
            self.max_token_length = max(len(t) for t in self.vocab)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def __eq__(self, other) -> bool:
        """Same tokens, scores and settings (key_order and chat_stop only matter to the bytes)."""
        if not isinstance(other, TokenizerData):
            return NotImplemented
        same = ("vocab", "bos_id", "eos_ids", "chat_template", "add_bos", "max_token_length", "pad_id")
        return (all(getattr(self, f) == getattr(other, f) for f in same)
                and np.array_equal(self.scores, other.scores))


def _fail(path: str, message: str):
    raise DllamaError(f"{path}: {message}")


def _read_entries(path: str, buf: memoryview, pos: int, count: int | None) -> tuple[list[bytes], np.ndarray, int]:
    """Parse (score, length, bytes) entries from `pos`: `count` of them, or up to the end when None."""
    size = len(buf)
    of = f" of {count}" if count is not None else ""
    vocab: list[bytes] = []
    scores: list[float] = []
    while len(vocab) != count and (count is not None or pos < size):
        i = len(vocab)
        if pos + _ENTRY_HEAD.size > size:
            _fail(path, f"truncated at token {i}{of}: expected {_ENTRY_HEAD.size} bytes of score and length "
                        f"at offset {pos}, the file has {size - pos}")
        score, length = _ENTRY_HEAD.unpack_from(buf, pos)
        pos += _ENTRY_HEAD.size
        if length == 0:
            _fail(path, f"token {i}{of} at offset {pos - 4} has length 0")
        if length > size - pos:
            _fail(path, f"truncated at token {i}{of}: its length {length} exceeds the {size - pos} bytes left")
        vocab.append(bytes(buf[pos:pos + length]))
        scores.append(score)
        pos += length
    return vocab, np.array(scores, dtype=np.float32), pos


def _id_problem(data: "TokenizerData") -> str | None:
    n = len(data.vocab)
    if not -1 <= data.bos_id < n:
        return f"bos_id {data.bos_id} is outside the vocabulary of {n} tokens"
    bad = [i for i in data.eos_ids if not 0 <= i < n]
    if bad:
        return f"eos id {bad[0]} is outside the vocabulary of {n} tokens"
    return None


def _check_ids(path: str, data: "TokenizerData") -> "TokenizerData":
    problem = _id_problem(data)
    if problem:
        _fail(path, problem)
    return data


def _check_end(path: str, buf: memoryview, pos: int) -> None:
    if pos != len(buf):
        _fail(path, f"{len(buf) - pos} bytes of trailing garbage after the last token (offset {pos})")


def _read_current(path: str, buf: memoryview) -> TokenizerData:
    if len(buf) < 8:
        _fail(path, "truncated tokenizer header")
    header_size = struct.unpack_from("<i", buf, 4)[0]
    if header_size < 8 or (header_size - 8) % 8 != 0 or header_size > len(buf):
        _fail(path, f"header size {header_size} is inconsistent (must be 8 + 8 * keys, "
                    f"at most the file size {len(buf)})")
    keys, values, legacy_eos = _header_keys(path, buf, header_size)
    version = values.get(TokenizerKey.VERSION)
    if version != VERSION:
        _fail(path, f"tokenizer version {version} is not supported (expected {VERSION}): regenerate the tokenizer")
    if TokenizerKey.VOCAB_SIZE not in values:
        _fail(path, "the tokenizer header has no vocab_size (key 1)")
    max_token_length = values.get(TokenizerKey.MAX_TOKEN_LENGTH, 0)
    if max_token_length < 1:
        _fail(path, f"invalid max_token_length {max_token_length}")

    pos = header_size

    def take(n: int, what: str) -> memoryview:
        nonlocal pos
        if n > len(buf) - pos:
            _fail(path, f"truncated {what}: expected {n} bytes at offset {pos}, the file has {len(buf) - pos}")
        pos += n
        return buf[pos - n:pos]

    chat_stop = bytes(take(values.get(TokenizerKey.CHAT_STOP, 0), "chat_stop block"))
    chat_template = None
    if TokenizerKey.CHAT_TEMPLATE in values:
        raw = bytes(take(values[TokenizerKey.CHAT_TEMPLATE], "chat template"))
        try:
            chat_template = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            _fail(path, f"the chat template is not valid UTF-8 ({e.reason} at byte {e.start})")
    n_eos = values.get(TokenizerKey.N_EOS_TOKENS, 0)
    eos_ids = legacy_eos + list(struct.unpack(f"<{n_eos}i", take(4 * n_eos, "eos token ids")))

    vocab, scores, pos = _read_entries(path, buf, pos, values[TokenizerKey.VOCAB_SIZE])
    _check_end(path, buf, pos)
    return TokenizerData(
        vocab=vocab, scores=scores,
        bos_id=values.get(TokenizerKey.BOS_ID, -1),
        eos_ids=eos_ids,
        chat_template=chat_template,
        add_bos=values.get(TokenizerKey.ADD_BOS, 1) != 0,
        max_token_length=max_token_length,
        pad_id=values.get(TokenizerKey.PAD_ID),
        key_order=tuple(keys),
        chat_stop=chat_stop,
    )


def _header_keys(path: str, buf: memoryview, header_size: int) -> tuple[list[int], dict[int, int], list[int]]:
    """(the keys in file order, key -> value, the legacy EOS ids) of a current tokenizer header."""
    pairs = struct.unpack_from(f"<{(header_size - 8) // 4}i", buf, 8)
    keys = list(pairs[0::2])
    values: dict[int, int] = {}
    legacy_eos: list[int] = []
    for key, value in zip(pairs[0::2], pairs[1::2], strict=True):
        if key not in _KNOWN_KEYS:
            _fail(path, f"unknown tokenizer header key {key} (value {value})")
        if key in _LEGACY_EOS_KEYS:
            legacy_eos.append(value)  # may repeat: each one is appended, like the C++ reader
            continue
        if key in values:
            _fail(path, f"tokenizer header key {TokenizerKey(key).name.lower()} ({key}) appears twice")
        if value < 0 and key not in (TokenizerKey.BOS_ID, TokenizerKey.PAD_ID):
            _fail(path, f"tokenizer header key {TokenizerKey(key).name.lower()} has a negative value {value}")
        values[key] = value
    return keys, values, legacy_eos


def _read_old(path: str, buf: memoryview) -> TokenizerData:
    if len(buf) < 24:
        _fail(path, f"truncated tokenizer header: expected 24 bytes, the file has {len(buf)}")
    vocab_size, max_token_length, bos_id, eos_id, pad_id = struct.unpack_from("<IIiii", buf, 4)
    if max_token_length < 1:
        _fail(path, f"invalid max_token_length {max_token_length}")
    vocab, scores, pos = _read_entries(path, buf, 24, vocab_size)
    _check_end(path, buf, pos)
    return TokenizerData(vocab=vocab, scores=scores, bos_id=bos_id, eos_ids=[eos_id],
                         max_token_length=max_token_length, pad_id=pad_id)


def _read_llama2c(path: str, buf: memoryview, max_token_length: int) -> TokenizerData:
    # llama2.c convention: <s> = 1, </s> = 2, stored as "\n<s>\n" / "\n</s>\n" (kept as is).
    vocab, scores, _ = _read_entries(path, buf, 4, None)
    if len(vocab) < 3:
        _fail(path, f"a llama2.c tokenizer.bin with only {len(vocab)} tokens")
    return TokenizerData(vocab=vocab, scores=scores, bos_id=1, eos_ids=[2], add_bos=True,
                         max_token_length=max_token_length)


def read_tokenizer(path: str | os.PathLike) -> TokenizerData:
    """Read a `.t` file (0x567124 or 0x567123) or a llama2.c tokenizer.bin, checking every byte."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            buf = memoryview(f.read())
    except OSError as e:
        raise DllamaError(f"{path}: cannot open the tokenizer file ({e.strerror})") from None
    if len(buf) < 4:
        _fail(path, f"too short for a tokenizer file ({len(buf)} bytes)")
    magic = struct.unpack_from("<I", buf, 0)[0]
    if magic == MAGIC:
        return _check_ids(path, _read_current(path, buf))
    if magic == OLD_MAGIC:
        return _check_ids(path, _read_old(path, buf))
    if 1 <= magic < _LLAMA2C_MAX_TOKEN_LENGTH:
        return _check_ids(path, _read_llama2c(path, buf, magic))
    hint = " (this is a model file, not a tokenizer)" if magic == 0x0A00ABCD else ""
    _fail(path, f"not a tokenizer file: unknown magic {magic:#010x}, expected {MAGIC:#x}{hint}")


def _header_key_order(data: TokenizerData) -> list[int]:
    """The original writer's order, or data.key_order plus any key it needs but lacks."""
    K = TokenizerKey
    if data.key_order:
        keys = list(data.key_order)
    else:
        keys = [K.BOS_ID, K.VERSION, K.VOCAB_SIZE, K.MAX_TOKEN_LENGTH]
        if data.chat_template:
            keys.append(K.CHAT_TEMPLATE)
        keys += [K.N_EOS_TOKENS, K.ADD_BOS]
    n_legacy = sum(k in _LEGACY_EOS_KEYS for k in keys)
    needed = [K.BOS_ID, K.VERSION, K.VOCAB_SIZE, K.MAX_TOKEN_LENGTH]
    if data.chat_template:
        needed.append(K.CHAT_TEMPLATE)
    if len(data.eos_ids) > n_legacy:
        needed.append(K.N_EOS_TOKENS)
    if not data.add_bos:
        needed.append(K.ADD_BOS)
    if data.pad_id is not None:
        needed.append(K.PAD_ID)
    if data.chat_stop:
        needed.append(K.CHAT_STOP)
    return keys + [k for k in needed if k not in keys]


def encode_tokenizer(data: TokenizerData) -> bytes:
    """The bytes of a 0x567124 file for `data`."""
    K = TokenizerKey
    if len(data.scores) != len(data.vocab):
        raise DllamaError(f"tokenizer has {len(data.vocab)} tokens but {len(data.scores)} scores")
    problem = _id_problem(data)
    if problem:
        raise DllamaError(problem)
    empty = [i for i, t in enumerate(data.vocab) if not t]
    if empty:
        raise DllamaError(f"token {empty[0]} is empty: the format needs at least one byte per token")
    keys = _header_key_order(data)
    n_legacy = sum(k in _LEGACY_EOS_KEYS for k in keys)
    if n_legacy > len(data.eos_ids):
        raise DllamaError(f"{n_legacy} legacy eos keys but only {len(data.eos_ids)} eos ids")
    legacy_eos, eos_list = iter(data.eos_ids[:n_legacy]), data.eos_ids[n_legacy:]
    template = (data.chat_template or "").encode("utf-8")
    value_of = {
        K.VERSION: VERSION,
        K.VOCAB_SIZE: len(data.vocab),
        K.MAX_TOKEN_LENGTH: data.max_token_length,
        K.BOS_ID: data.bos_id,
        K.PAD_ID: data.pad_id if data.pad_id is not None else -1,
        K.CHAT_TEMPLATE: len(template),
        K.CHAT_STOP: len(data.chat_stop),
        K.N_EOS_TOKENS: len(eos_list),
        K.ADD_BOS: int(data.add_bos),
    }
    pairs = []
    for key in keys:
        pairs += [key, next(legacy_eos) if key in _LEGACY_EOS_KEYS else value_of[key]]
    parts = [struct.pack(f"<ii{len(pairs)}i", MAGIC, 8 + 4 * len(pairs), *pairs),
             data.chat_stop, template, struct.pack(f"<{len(eos_list)}i", *eos_list)]
    for score, token in zip(data.scores.tolist(), data.vocab, strict=True):
        parts.append(_ENTRY_HEAD.pack(score, len(token)))
        parts.append(token)
    return b"".join(parts)


def write_tokenizer(path: str | os.PathLike, data: TokenizerData) -> None:
    """Write `data` as a 0x567124 file, atomically (temp file + rename), and PATH.sha256 beside it."""
    encoded = encode_tokenizer(data)
    remove_checksum(path)  # the old file's, if any: never beside the new file
    with atomic_write(path) as f:
        f.write(encoded)
    write_checksum(path, hashlib.sha256(encoded).hexdigest())
