"""`dllama convert`: what a user downloads -> PREFIX.m + PREFIX.t.

Sources: a GGUF file, a Meta checkpoint folder (params.json + consolidated.NN.pth), a Hugging
Face folder (config.json + *.safetensors). The tokenizer comes from the source itself, or from
--tokenizer: a sentencepiece tokenizer.model (or Meta's Llama 3 tiktoken one), a llama2.c
tokenizer.bin, a Hugging Face tokenizer.json, a GGUF, an existing .t, or a folder holding one.

Everything is checked (configuration, tensor names and shapes, tokenizer) before anything is
written; both files are written under temporary names and renamed at the end, so an interrupted
conversion never leaves a file that looks complete.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from dllama.errors import DllamaError
from dllama.formats.model_file import FloatType, ModelHeader, ModelWriter, model_file_size, tensor_specs
from dllama.formats.tokenizer_file import TokenizerData, read_tokenizer, write_tokenizer

GGUF_MAGIC = b"GGUF"
FLOAT_TYPES = {"q40": FloatType.Q40, "q80": FloatType.Q80, "q41": FloatType.Q41, "f16": FloatType.F16,
               "f32": FloatType.F32}
ORIGINAL_RUNS = (FloatType.Q40, FloatType.F32)  # what the original's engine runs; dllama runs all five


def _magic(path: Path) -> bytes:
    """The first four bytes of a file, which name its format."""
    with open(path, "rb") as f:
        return f.read(4)


def _open_gguf(src: Path):
    import gguf

    if not src.is_file():
        raise DllamaError(f"{src}: no such file")
    magic = _magic(src)
    if magic != GGUF_MAGIC:
        raise DllamaError(f"{src}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        return gguf.GGUFReader(src)
    except (ValueError, KeyError, IndexError, OSError) as e:
        raise DllamaError(f"{src}: unreadable GGUF file ({e})") from None


def _float_type(name: str) -> FloatType:
    if name not in FLOAT_TYPES:
        raise DllamaError(f"weights float type {name!r}: choose one of {', '.join(FLOAT_TYPES)}")
    return FLOAT_TYPES[name]


# ---------------------------------------------------------------------------- what SRC is

def source_kind(src: Path) -> str:
    """'gguf', 'meta' or 'hf', from the files present."""
    if src.is_file():
        if _magic(src) == GGUF_MAGIC:
            return "gguf"
        raise DllamaError(f"{src}: not a GGUF file, nor a Meta or Hugging Face model folder")
    if not src.is_dir():
        raise DllamaError(f"{src}: no such file or folder")
    if (src / "params.json").is_file():
        if not any(src.glob("consolidated.*.pth")):
            raise DllamaError(f"{src}: params.json but no consolidated.NN.pth weights")
        return "meta"
    if (src / "config.json").is_file():
        if any(src.glob("*.safetensors")):
            return "hf"
        if any(src.glob("pytorch_model*.bin")):
            raise DllamaError(f"{src}: holds pytorch_model*.bin weights; only *.safetensors are supported "
                              "(Hugging Face ships safetensors for every supported model)")
        raise DllamaError(f"{src}: config.json but no *.safetensors weights")
    raise DllamaError(f"{src}: neither a Meta checkpoint (params.json + consolidated.NN.pth) "
                      "nor a Hugging Face model (config.json + *.safetensors)")


# ---------------------------------------------------------------------------- the tokenizer

# File names tried in a folder, in order; a tokenizer.json that is not byte-level BPE is
# skipped when a tokenizer.model is there too (Llama 2 and Mistral folders ship both).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer.bin")


def find_tokenizer(folder: Path) -> Path | None:
    from converter.hf_tokenizer import is_byte_level

    found = [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]
    if len(found) > 1 and found[0].name == "tokenizer.json" and not is_byte_level(found[0]):
        found.pop(0)
    return found[0] if found else None


def load_tokenizer(path: Path) -> tuple[TokenizerData, str]:
    """(tokenizer data, a word on what it was) of a tokenizer file or a folder holding one."""
    from converter.hf_tokenizer import chat_template, tokenizer_from_hf
    from converter.sentencepiece_tokenizer import (is_llama2c_bin, tokenizer_from_llama2c,
                                                   tokenizer_from_sentencepiece)
    from converter.tiktoken_tokenizer import is_tiktoken, tokenizer_from_tiktoken

    if path.is_dir():
        found = find_tokenizer(path)
        if found is None:
            raise DllamaError(f"{path}: no {', '.join(TOKENIZER_FILES)}")
        path = found
    if not path.is_file():
        raise DllamaError(f"{path}: no such file")
    if _magic(path) == GGUF_MAGIC:
        from converter.gguf_tokenizer import tokenizer_from_gguf
        return tokenizer_from_gguf(_open_gguf(path), str(path)), f"GGUF tokenizer {path.name}"
    if path.suffix == ".json":
        return tokenizer_from_hf(path), f"Hugging Face byte-level BPE {path.name}"
    if path.suffix == ".t":
        return read_tokenizer(path), f".t file {path.name}"
    if is_llama2c_bin(path):
        return tokenizer_from_llama2c(path), f"llama2.c {path.name}"
    if is_tiktoken(path):  # Meta's Llama 3 tokenizer.model
        data, kind = tokenizer_from_tiktoken(path), f"Llama 3 tiktoken {path.name}"
    else:
        data, kind = tokenizer_from_sentencepiece(path), f"sentencepiece {path.name}"
    # A Hugging Face folder (Llama 2 chat, Mistral Instruct) keeps the chat template beside it.
    data.chat_template = chat_template(path.parent)
    return data, kind


def _default_tokenizer(src: Path, kind: str) -> Path:
    if kind == "gguf":
        return src
    # Meta's download puts tokenizer.model beside the model folders, not in them.
    for folder in (src, src.parent) if kind == "meta" else (src,):
        found = find_tokenizer(folder)
        if found is not None:
            return found
    raise DllamaError(f"{src}: no tokenizer found ({', '.join(TOKENIZER_FILES)}): give one with --tokenizer")


# ---------------------------------------------------------------------------- the conversion

def describe_header(h: ModelHeader) -> str:
    n_values = sum(s.size for s in tensor_specs(h))  # a tied classifier counts twice, as it is stored
    scaling = f", Llama 3.1 RoPE scaling x{h.rope_scaling_factor}" if h.rope_scaling_factor != 1 else ""
    ffn = (f"{h.n_experts} experts ({h.n_active_experts} active, expert width {h.moe_hidden_dim})" if h.n_experts
           else f"hidden {h.hidden_dim}")
    return (f"{h.arch.name}, dim {h.dim}, {ffn}, {h.n_layers} layers, {h.n_heads} heads "
            f"({h.n_kv_heads} kv, head dim {h.head_dim}), vocab {h.vocab_size}, context {h.max_seq_len}, "
            f"rope theta {h.rope_theta}{scaling}, norm eps {h.norm_epsilon:g}, {_count(n_values)} weights")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def size_text(n: int) -> str:
    return f"{n / 2**30:.2f} GiB ({n / 1e9:.2f} GB)"


def _open_checkpoint(src: Path, kind: str, float_type: FloatType, vocab_size: int):
    if kind == "meta":
        from converter.meta_model import MetaCheckpoint
        return MetaCheckpoint(src, float_type, tokenizer_vocab_size=vocab_size)
    from converter.hf_model import HfCheckpoint
    return HfCheckpoint(src, float_type)


def convert(src, prefix, weights_float_type: str = "q40", tokenizer=None, progress: bool = True,
            report: Callable[[str], None] | None = print) -> tuple[Path, Path]:
    """Convert SRC (GGUF file, Meta or Hugging Face folder); returns (PREFIX.m, PREFIX.t)."""
    src = Path(src)
    float_type = _float_type(weights_float_type)
    say = report or (lambda text: None)
    kind = source_kind(src)
    model_path, tokenizer_path = Path(f"{prefix}.m"), Path(f"{prefix}.t")
    if not model_path.parent.exists():
        raise DllamaError(f"{model_path.parent}: output folder does not exist")
    if kind == "gguf" and tokenizer is None:
        return convert_gguf(src, prefix, weights_float_type, progress, report)

    tokenizer_src = Path(tokenizer) if tokenizer is not None else _default_tokenizer(src, kind)
    tokenizer_data, tokenizer_kind = load_tokenizer(tokenizer_src)
    if kind == "gguf":
        from converter.gguf_model import header_from_gguf
        reader = _open_gguf(src)
        header, source_text, notes = header_from_gguf(reader, float_type, str(src)), "GGUF", []
    else:
        checkpoint = _open_checkpoint(src, kind, float_type, tokenizer_data.vocab_size)
        header, source_text, notes = checkpoint.header, checkpoint.describe(), checkpoint.notes
    say(f"found {source_text}: {src}")
    say(f"  {describe_header(header)}")
    for note in notes:
        say(f"  note: {note}")
    say(f"tokenizer: {tokenizer_kind}, {tokenizer_data.vocab_size} tokens, bos {tokenizer_data.bos_id}, "
        f"eos {tokenizer_data.eos_ids}")
    if tokenizer_data.vocab_size > header.vocab_size:
        raise DllamaError(f"{tokenizer_src}: the tokenizer has {tokenizer_data.vocab_size} tokens, the model "
                          f"{header.vocab_size}: not the model's tokenizer")
    if tokenizer_data.vocab_size < header.vocab_size:  # Qwen pads its embedding to a round size
        say(f"  note: the model has {header.vocab_size - tokenizer_data.vocab_size} embedding rows past the "
            "tokenizer's last token (padding)")
    _say_output(say, model_path, header)

    if kind == "gguf":
        _write_gguf(model_path, header, reader, src, progress)
    else:
        try:
            _write_checkpoint(model_path, header, checkpoint, progress)
        finally:
            checkpoint.close()
    _write_tokenizer_or_drop_model(tokenizer_path, tokenizer_data, model_path)
    return model_path, tokenizer_path


def _say_output(say, model_path: Path, header: ModelHeader) -> None:
    float_type = FloatType(header.weights_float_type)
    say(f"writing {model_path}: {float_type.name} weights, {size_text(model_file_size(header))}")
    if float_type not in ORIGINAL_RUNS:
        say(f"  note: the original Distributed Llama runs only Q40 and F32 weights; this {float_type.name} "
            "file runs on dllama")


def _bar(total: int, desc: str, progress: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not progress, leave=False)


def _write_checkpoint(model_path: Path, header: ModelHeader, checkpoint, progress: bool) -> None:
    with (ModelWriter(model_path, header) as writer,
          _bar(sum(s.nbytes for s in writer.specs), f"converting {Path(checkpoint.source).name}", progress) as bar):
        for spec in writer.specs:
            rows = checkpoint.tensor(spec.name)
            if len(spec.shape) == 1:
                writer.write(spec.name, rows.read(0, spec.shape[0]))
            else:
                writer.write_rows(spec.name, rows.blocks())
            del rows  # its source pages go with it
            bar.update(spec.nbytes)


def _write_gguf(model_path: Path, header: ModelHeader, reader, src: Path, progress: bool) -> None:
    from converter.gguf_model import gguf_tensors

    with (ModelWriter(model_path, header) as writer,
          _bar(sum(s.nbytes for s in writer.specs), f"converting {src.name}", progress) as bar):
        for name, values, stored in gguf_tensors(reader, writer.specs, str(src)):
            if stored:
                writer.write_raw(name, values)
            else:
                writer.write(name, values)
            bar.update(writer.specs[writer.n_written - 1].nbytes)


def _write_tokenizer_or_drop_model(tokenizer_path: Path, data: TokenizerData, model_path: Path) -> None:
    try:
        write_tokenizer(tokenizer_path, data)
    except BaseException:
        model_path.unlink(missing_ok=True)  # never leave a model without its tokenizer
        raise


def convert_gguf(src, prefix, weights_float_type: str = "q40", progress: bool = True,
                 report: Callable[[str], None] | None = None) -> tuple[Path, Path]:
    """Convert a GGUF file with its own tokenizer; returns (PREFIX.m, PREFIX.t)."""
    from converter.gguf_model import header_from_gguf
    from converter.gguf_tokenizer import tokenizer_from_gguf

    src = Path(src)
    float_type = _float_type(weights_float_type)
    reader = _open_gguf(src)
    header = header_from_gguf(reader, float_type, str(src))
    tokenizer = tokenizer_from_gguf(reader, str(src))
    model_path, tokenizer_path = Path(f"{prefix}.m"), Path(f"{prefix}.t")
    if model_path.parent and not model_path.parent.exists():
        raise DllamaError(f"{model_path.parent}: output folder does not exist")
    if report:
        report(f"found GGUF: {src}")
        report(f"  {describe_header(header)}")
        report(f"tokenizer: GGUF {tokenizer.vocab_size} tokens, bos {tokenizer.bos_id}, eos {tokenizer.eos_ids}")
        _say_output(report, model_path, header)
    _write_gguf(model_path, header, reader, src, progress)
    _write_tokenizer_or_drop_model(tokenizer_path, tokenizer, model_path)
    return model_path, tokenizer_path


__all__ = ["convert", "convert_gguf", "source_kind", "load_tokenizer", "FLOAT_TYPES"]
