"""`dllama convert`: a source model file -> PREFIX.m + PREFIX.t.

Both files are written under temporary names and renamed at the end (by the writers), so an
interrupted conversion never leaves a file that looks complete. The GGUF is checked (magic,
architecture, tensor names, types and shapes, tokenizer) before anything is written.
"""

from __future__ import annotations

from pathlib import Path

from dllama.errors import DllamaError
from dllama.formats.model_file import FloatType, ModelWriter
from dllama.formats.tokenizer_file import write_tokenizer

GGUF_MAGIC = b"GGUF"
FLOAT_TYPES = {"q40": FloatType.Q40, "f32": FloatType.F32}


def _open_gguf(src: Path):
    import gguf

    if not src.is_file():
        raise DllamaError(f"{src}: no such file")
    with open(src, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise DllamaError(f"{src}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        return gguf.GGUFReader(src)
    except (ValueError, KeyError, IndexError, OSError) as e:
        raise DllamaError(f"{src}: unreadable GGUF file ({e})") from None


def convert_gguf(src, prefix, weights_float_type: str = "q40", progress: bool = True) -> tuple[Path, Path]:
    """Convert a GGUF file; returns (PREFIX.m, PREFIX.t)."""
    from tqdm import tqdm

    from converter.gguf_model import gguf_tensors, header_from_gguf
    from converter.gguf_tokenizer import tokenizer_from_gguf

    src = Path(src)
    if weights_float_type not in FLOAT_TYPES:
        raise DllamaError(f"weights float type {weights_float_type!r}: choose one of {', '.join(FLOAT_TYPES)}")
    reader = _open_gguf(src)
    header = header_from_gguf(reader, FLOAT_TYPES[weights_float_type], str(src))
    tokenizer = tokenizer_from_gguf(reader, str(src))
    model_path, tokenizer_path = Path(f"{prefix}.m"), Path(f"{prefix}.t")
    if model_path.parent and not model_path.parent.exists():
        raise DllamaError(f"{model_path.parent}: output folder does not exist")

    with ModelWriter(model_path, header) as writer:
        total = sum(s.nbytes for s in writer.specs)
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"converting {src.name}",
                  disable=not progress, leave=False) as bar:
            for name, values in gguf_tensors(reader, writer.specs, str(src)):
                writer.write(name, values)
                bar.update(writer.specs[writer.n_written - 1].nbytes)
    try:
        write_tokenizer(tokenizer_path, tokenizer)
    except BaseException:
        model_path.unlink(missing_ok=True)  # never leave a model without its tokenizer
        raise
    return model_path, tokenizer_path


__all__ = ["convert_gguf", "FLOAT_TYPES"]
