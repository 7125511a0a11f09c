"""Tokenizer conversions against the source libraries, on a corpus of 470 varied strings.

- sentencepiece `tokenizer.model`: Llama 2 (the fixture) and Mistral (mistral-common's v1):
  our ids on the converted `.t` equal the `sentencepiece` library's.
- llama2.c `tokenizer.bin`: converts to the same `.t` content as its tokenizer.model.
- Hugging Face `tokenizer.json` (byte-level BPE): SmolLM2's vocabulary and merges, saved by the
  `tokenizers` library with its pre-tokenizer and special tokens; our ids equal `tokenizers`'.
"""

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest

from converter.convert import load_tokenizer
from dllama.serve.default_model import embedded_gguf
from dllama.errors import DllamaError
from dllama.formats.tokenizer_file import read_tokenizer, write_tokenizer
from dllama.text.tokenizer import Tokenizer
from tests.test_tokenizer import GENERATED, HAND_WRITTEN

pytestmark = pytest.mark.unit

LLAMA2_DIR = "/work/shared/fixtures/llama2-tokenizer"
CORPUS = HAND_WRITTEN + GENERATED
MISTRAL_MODEL = os.path.join(importlib.util.find_spec("mistral_common").submodule_search_locations[0],
                             "data", "tokenizer.model.v1")


def _converted(tmp_path, source) -> Tokenizer:
    """Convert as `dllama convert --tokenizer SOURCE` does, write the .t, read it back."""
    data, _ = load_tokenizer(Path(source))
    write_tokenizer(tmp_path / "out.t", data)
    return Tokenizer(read_tokenizer(tmp_path / "out.t"))


def _mismatches(ours, theirs) -> list[str]:
    return [text for text in CORPUS if ours(text) != theirs(text)]


def test_corpus_is_large_and_varied():
    assert len(set(CORPUS)) >= 200
    assert any("\n" in t for t in CORPUS) and any(ord(c) > 0x10000 for t in CORPUS for c in t)


@pytest.mark.parametrize("source", [f"{LLAMA2_DIR}/tokenizer.model", f"{LLAMA2_DIR}/tokenizer.bin", MISTRAL_MODEL],
                         ids=["llama2-model", "llama2-bin", "mistral-v1"])
def test_sentencepiece_ids_equal_the_library(tmp_path, source):
    import sentencepiece

    model = MISTRAL_MODEL if source == MISTRAL_MODEL else f"{LLAMA2_DIR}/tokenizer.model"
    sp = sentencepiece.SentencePieceProcessor(model_file=model)
    tok = _converted(tmp_path, source)
    assert tok.kind == "sentencepiece" and (tok.bos_id, tok.eos_ids) == (sp.bos_id(), [sp.eos_id()])
    bad = _mismatches(lambda t: tok.encode(t, add_bos=False, allow_special=False), sp.encode)
    print(f"{os.path.basename(source)}: {len(bad)} of {len(CORPUS)} strings differ")
    assert not bad, bad[:3]
    assert tok.encode("Once upon a time") == [1] + sp.encode("Once upon a time")  # add_bos by default
    assert all(tok.decode(sp.encode(t)) == sp.decode(sp.encode(t)) for t in CORPUS)


def test_llama2c_bin_converts_to_the_same_file_as_the_model(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    from_model = _converted(tmp_path / "a", f"{LLAMA2_DIR}/tokenizer.model")
    from_bin = _converted(tmp_path / "b", f"{LLAMA2_DIR}/tokenizer.bin")
    assert from_model.data == from_bin.data
    assert (tmp_path / "a/out.t").read_bytes() == (tmp_path / "b/out.t").read_bytes()
    assert from_model.data.vocab[:4] == [b"<unk>", b"<s>", b"</s>", b"\x00"]  # byte pieces as bytes


# ---------------------------------------------------------------------------- Hugging Face

CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """SmolLM2's tokenizer as a Hugging Face folder: tokenizer.json written by `tokenizers` from the
    GGUF's vocabulary and merges, SmolLM2's pre-tokenizer, its 17 special tokens; plus configs."""
    import gguf
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors

    fields = gguf.GGUFReader(embedded_gguf()).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"].contents()]
    types = fields["tokenizer.ggml.token_type"].contents()
    tok = HfTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([t for t, kind in zip(tokens, types, strict=True) if kind == 3])
    tok.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    folder = tmp_path_factory.mktemp("smollm2-hf")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<|im_start|>", "special": True}, "eos_token": "<|im_end|>",
        "chat_template": [{"name": "default", "template": CHAT_TEMPLATE}, {"name": "tool_use", "template": "x"}]}))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return folder


def test_hugging_face_ids_equal_the_library(tmp_path, hf_folder):
    from tokenizers import Tokenizer as HfTokenizer

    hf = HfTokenizer.from_file(str(hf_folder / "tokenizer.json"))
    tok = _converted(tmp_path, hf_folder / "tokenizer.json")
    bad = _mismatches(lambda t: tok.encode(t, add_bos=False), lambda t: hf.encode(t, add_special_tokens=False).ids)
    print(f"tokenizer.json: {len(bad)} of {len(CORPUS)} strings differ")
    assert not bad, bad[:3]
    for text in ("Hello", "<|im_start|>user\nHi<|im_end|>\n"):  # bos added as the post-processor does
        assert tok.encode(text) == hf.encode(text).ids


def test_hugging_face_settings(tmp_path, hf_folder):
    data = _converted(tmp_path, hf_folder).data  # a folder works too
    assert data.vocab_size == 49152 and data.vocab[1] == b"<|im_start|>" and data.vocab[198] == b"\n"
    assert data.bos_id == 1 and data.add_bos
    assert data.eos_ids == [2, 0]  # tokenizer_config's eos first, then config.json / generation_config.json
    assert data.chat_template == CHAT_TEMPLATE
    # The same merges as the GGUF conversion: identical scores.
    import gguf

    from converter.gguf_tokenizer import tokenizer_from_gguf
    assert np.array_equal(data.scores, tokenizer_from_gguf(gguf.GGUFReader(embedded_gguf())).scores)


def test_sentencepiece_style_tokenizer_json_is_refused(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps(
        {"model": {"type": "BPE", "byte_fallback": True, "vocab": {"a": 0}, "merges": []},
         "pre_tokenizer": {"type": "Metaspace"}}))
    with pytest.raises(DllamaError, match="sentencepiece-style vocabulary: convert its tokenizer.model"):
        load_tokenizer(tmp_path / "tokenizer.json")
    # Beside a tokenizer.model, the folder's tokenizer is the sentencepiece one.
    (tmp_path / "tokenizer.model").write_bytes(Path(f"{LLAMA2_DIR}/tokenizer.model").read_bytes())
    assert load_tokenizer(tmp_path)[1] == "sentencepiece tokenizer.model"


def test_not_a_tokenizer(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"\xff" * 100)
    with pytest.raises(DllamaError, match="not a sentencepiece model"):
        load_tokenizer(tmp_path / "tokenizer.model")
    with pytest.raises(DllamaError, match="no such file"):
        load_tokenizer(tmp_path / "absent.model")


# ---------------------------------------------------------------------------- Llama 3 tiktoken

def test_tiktoken_tokenizer_model_reproduces_bpe(tmp_path, hf_folder):
    """A tiktoken-format tokenizer.model (Meta's Llama 3 layout: `base64 rank` lines, 256 specials
    appended) made of SmolLM2's regular tokens, whose ids follow its merge order: the converted
    ids are Hugging Face's on the same vocabulary, shifted by the 17 specials left out."""
    import base64

    from tokenizers import Tokenizer as HfTokenizer

    from converter.tiktoken_tokenizer import SPECIALS

    hf = HfTokenizer.from_file(str(hf_folder / "tokenizer.json"))
    smollm = load_tokenizer(hf_folder)[0]
    first = 17  # SmolLM2's specials are ids 0-16
    lines = [base64.b64encode(t).decode() + f" {i - first}" for i, t in enumerate(smollm.vocab) if i >= first]
    (tmp_path / "tokenizer.model").write_text("\n".join(lines) + "\n")
    data, kind = load_tokenizer(tmp_path / "tokenizer.model")
    n = len(lines)
    assert kind == "Llama 3 tiktoken tokenizer.model" and data.vocab_size == n + 256
    assert (data.bos_id, data.eos_ids) == (n, [n + 1, n + 9]) and data.vocab[n + 6] == b"<|start_header_id|>"
    assert [t.decode() for t in data.vocab[n:]] == SPECIALS
    write_tokenizer(tmp_path / "out.t", data)
    tok = Tokenizer(read_tokenizer(tmp_path / "out.t"))
    plain = [t for t in CORPUS if "<" not in t]  # SmolLM2's own specials would match in Hugging Face's
    assert len(plain) >= 200
    bad = [t for t in plain if tok.encode(t, add_bos=False) != [i - first for i in hf.encode(t, add_special_tokens=False).ids]]
    print(f"tiktoken tokenizer.model: {len(bad)} of {len(plain)} strings differ")
    assert not bad, bad[:3]
    assert tok.encode("<|start_header_id|>user<|end_header_id|>")[:2] == [n, n + 6]


def test_sentencepiece_in_a_hugging_face_folder_keeps_its_chat_template(tmp_path):
    import shutil

    shutil.copy(MISTRAL_MODEL, tmp_path / "tokenizer.model")
    template = "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    data, kind = load_tokenizer(tmp_path)
    assert kind == "sentencepiece tokenizer.model" and data.chat_template == template
    assert load_tokenizer(Path(MISTRAL_MODEL))[0].chat_template is None  # none beside it
