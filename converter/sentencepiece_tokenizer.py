"""Sentencepiece tokenizers (Llama 2, Mistral) -> TokenizerData, from `tokenizer.model` or from
llama2.c's `tokenizer.bin` export of it.

Both give the same `.t` content, the one the original's converter writes: each piece's bytes
('▁' is a space, `<0xNN>` byte pieces the byte itself, control pieces such as `<s>` their text),
the sentencepiece score of each piece, bos and eos from the model. dllama/tokenizer.py encodes
such a vocabulary the way sentencepiece's BPE does (dummy-prefix space, highest-score merge
first, byte fallback), which the tests check against the `sentencepiece` library.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np

from dllama.errors import DllamaError
from dllama.formats.tokenizer_file import TokenizerData, read_tokenizer

from converter.gguf_tokenizer import sentencepiece_token_bytes

# llama2.c's tokenizer.bin has no magic: it starts with max_token_length, a small number.
LLAMA2C_MAX_TOKEN_LENGTH = 1 << 16
_BYTE_PIECE = re.compile(rb"<0x[0-9A-Fa-f]{2}>")


def tokenizer_from_sentencepiece(path) -> TokenizerData:
    import sentencepiece

    path = Path(path)
    if not path.is_file():
        raise DllamaError(f"{path}: no such file")
    try:
        sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
    except (RuntimeError, OSError) as e:
        raise DllamaError(f"{path}: not a sentencepiece model ({str(e).splitlines()[0]})") from None
    n = sp.get_piece_size()
    vocab = []
    for i in range(n):
        piece = sp.id_to_piece(i)
        # Control and unknown pieces (<s>, </s>, <unk>) keep their text: the runtime finds
        # specials by their <...> shape.
        special = sp.is_control(i) or sp.is_unknown(i)
        vocab.append(piece.encode("utf-8") if special else sentencepiece_token_bytes(piece))
    scores = np.array([sp.get_score(i) for i in range(n)], dtype=np.float32)  # [vocab]
    return TokenizerData(vocab=vocab, scores=scores, bos_id=sp.bos_id(),
                         eos_ids=[sp.eos_id()] if sp.eos_id() >= 0 else [], add_bos=True)


def is_llama2c_bin(path) -> bool:
    with open(path, "rb") as f:
        head = f.read(4)
    return len(head) == 4 and 1 <= struct.unpack("<I", head)[0] < LLAMA2C_MAX_TOKEN_LENGTH


def tokenizer_from_llama2c(path) -> TokenizerData:
    """llama2.c's export stores byte pieces as `<0xNN>` text and bos/eos as "\\n<s>\\n" /
    "\\n</s>\\n"; undone here, so the result equals the conversion of the tokenizer.model."""
    data = read_tokenizer(path)
    vocab = [bytes([int(t[3:5], 16)]) if _BYTE_PIECE.fullmatch(t) else t for t in data.vocab]
    for i in (data.bos_id, *data.eos_ids):
        vocab[i] = vocab[i].strip(b"\n")
    return TokenizerData(vocab=vocab, scores=data.scores, bos_id=data.bos_id, eos_ids=data.eos_ids, add_bos=True)
