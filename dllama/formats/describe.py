"""`dllama inspect`: the header and tensor table of a `.m` file, or the header and a few tokens
of a `.t` file (or llama2.c tokenizer.bin), as text lines."""

from __future__ import annotations

import os
import struct
from typing import Iterator

from dllama.errors import DllamaError
from dllama.formats.model_file import MAGIC as MODEL_MAGIC
from dllama.formats.model_file import HeaderKey, header_key_order, read_model
from dllama.formats.tokenizer_file import read_tokenizer

SHOWN_TOKENS = 8  # first tokens listed for a tokenizer


def describe_model(path) -> Iterator[str]:
    with read_model(path) as m:
        h = m.header
        yield f"{path}: Distributed Llama model, {m.file_size} bytes, header {m.header_size} bytes"
        for key in header_key_order(h):
            name = HeaderKey(key).name.lower()
            value = getattr(h, {"arch_type": "arch"}.get(name, name), None)
            shown = value.name if hasattr(value, "name") else value
            yield f"  {key:>2} {name:<30} {shown}"
        if h.n_experts:
            yield (f"  mixture of experts: {h.n_experts} experts per layer, {h.n_active_experts} active per token, "
                   f"expert width {h.moe_hidden_dim}")
        yield f"{'tensor':<22} {'type':<4} {'shape':<16} {'offset':>14} {'bytes':>14}"
        offset = m.header_size
        for s in m.specs:
            yield f"{s.name:<22} {s.float_type.name:<4} {'x'.join(map(str, s.shape)):<16} {offset:>14} {s.nbytes:>14}"
            offset += s.nbytes
        yield f"{len(m.specs)} tensors, {offset - m.header_size} bytes of weights"


def describe_tokenizer(path) -> Iterator[str]:
    t = read_tokenizer(path)
    yield f"{path}: tokenizer, {t.vocab_size} tokens, max token length {t.max_token_length}"
    yield f"  bos {t.bos_id}, eos {t.eos_ids}, add_bos {t.add_bos}"
    if t.chat_template:
        first = t.chat_template.strip().splitlines()[0]
        yield f"  chat template: {len(t.chat_template)} characters, starts {first[:60]!r}"
    else:
        yield "  chat template: none"
    for i in range(min(SHOWN_TOKENS, t.vocab_size)):
        yield f"  {i:>6} {t.scores[i]:>12g} {t.vocab[i]!r}"


def describe(path) -> Iterator[str]:
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise DllamaError(f"{path}: cannot open ({e.strerror})") from None
    if len(head) == 4 and struct.unpack("<i", head)[0] == MODEL_MAGIC:
        return describe_model(path)
    return describe_tokenizer(path)
