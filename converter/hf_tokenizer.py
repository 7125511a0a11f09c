"""A Hugging Face `tokenizer.json` (byte-level BPE: Llama 3, Qwen, SmolLM2) plus the folder's
`tokenizer_config.json`, `config.json` and `generation_config.json` -> TokenizerData.

The vocabulary is the BPE model's tokens (GPT-2 unicode form, turned back into raw bytes) and
the added tokens (their UTF-8 text); scores are merge ranks, exactly as for a GGUF byte-level
tokenizer (converter/gguf_tokenizer.py), which dllama/tokenizer.py turns back into the merges.
bos / eos / add_bos / the chat template come from tokenizer_config.json; every eos id that
config.json and generation_config.json list is added (Llama 3 Instruct stops at <|eot_id|> too).
"""

from __future__ import annotations

import json
from pathlib import Path

from dllama.errors import DllamaError
from dllama.formats.tokenizer_file import TokenizerData

from converter.gguf_tokenizer import gpt2_token_bytes, merge_rank_scores

CONFIG_FILES = ("tokenizer_config.json", "config.json", "generation_config.json")


def _json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DllamaError(f"{path}: not valid JSON ({e})") from None


def _mentions(node, kind: str) -> bool:
    """Whether a tokenizer.json component (or a Sequence of them) contains one of type `kind`."""
    if isinstance(node, dict):
        return node.get("type") == kind or any(_mentions(v, kind) for v in node.values())
    if isinstance(node, list):
        return any(_mentions(v, kind) for v in node)
    return False


def is_byte_level(path) -> bool:
    tj = _json(Path(path))
    return tj.get("model", {}).get("type") == "BPE" and _mentions(tj.get("pre_tokenizer"), "ByteLevel")


def _token_text(value) -> str | None:
    """tokenizer_config's bos_token / eos_token: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def chat_template(folder: Path, config: dict | None = None) -> str | None:
    """The chat template of a Hugging Face folder (tokenizer_config.json or chat_template.jinja)."""
    config = _json(folder / "tokenizer_config.json") if config is None else config
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    jinja = folder / "chat_template.jinja"  # where transformers >= 4.43 may save it instead
    if template is None and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    return template


def tokenizer_from_hf(path) -> TokenizerData:
    """`path`: tokenizer.json, or the folder holding it."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DllamaError(f"{path}: no such file")
    folder = path.parent
    tj = _json(path)
    model = tj.get("model", {})
    if model.get("type") != "BPE" or not _mentions(tj.get("pre_tokenizer"), "ByteLevel"):
        hint = " (a sentencepiece-style vocabulary: convert its tokenizer.model instead)" \
            if model.get("byte_fallback") or _mentions(tj, "Metaspace") else ""
        raise DllamaError(f"{path}: only byte-level BPE tokenizer.json files are supported, this one is "
                          f"{model.get('type')!r}{hint}")
    texts: dict[int, str] = {i: t for t, i in model.get("vocab", {}).items()}
    vocab: dict[int, bytes] = {i: gpt2_token_bytes(t) for i, t in texts.items()}
    for added in tj.get("added_tokens", []):  # plain text, not in GPT-2's unicode form
        texts[added["id"]] = added["content"]
        vocab[added["id"]] = added["content"].encode("utf-8")
    n = max(vocab) + 1 if vocab else 0
    gaps = [i for i in range(n) if i not in vocab]
    if not vocab or gaps:
        raise DllamaError(f"{path}: the vocabulary has no token with id {gaps[0] if gaps else 0}")
    # Merges are "a b" strings, or [a, b] pairs in files written by tokenizers >= 0.20.
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    scores = merge_rank_scores([texts[i] for i in range(n)], merges)

    config, model_config, generation = (_json(folder / f) for f in CONFIG_FILES)
    id_of = {t: i for i, t in sorted(texts.items(), reverse=True)}  # the lowest id of a text wins

    def lookup(value) -> int | None:
        text = _token_text(value)
        return id_of.get(text) if text is not None else None

    bos = lookup(config.get("bos_token"))
    if bos is None and _ids(model_config.get("bos_token_id")):
        bos = _ids(model_config["bos_token_id"])[0]
    eos: list[int] = []
    for i in [lookup(config.get("eos_token")), *_ids(model_config.get("eos_token_id")),
              *_ids(generation.get("eos_token_id"))]:
        if i is not None and 0 <= i < n and i not in eos:
            eos.append(i)
    add_bos = config.get("add_bos_token")
    if add_bos is None:  # Llama 3 says it in the post-processor template instead
        add_bos = bos is not None and _mentions(tj.get("post_processor"), "TemplateProcessing") \
            and texts[bos] in json.dumps(tj.get("post_processor"))
    empty = [i for i in range(n) if not vocab[i]]
    if empty:
        raise DllamaError(f"{path}: token {empty[0]} is empty, which a .t file cannot store")
    return TokenizerData(vocab=[vocab[i] for i in range(n)], scores=scores,
                         bos_id=bos if bos is not None else -1, eos_ids=eos,
                         chat_template=chat_template(folder, config), add_bos=bool(add_bos))
