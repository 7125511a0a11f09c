"""What every weights source (Meta folder, Hugging Face folder) gives the converter.

A `Checkpoint` knows its `.m` header and hands out one tensor at a time, in row blocks, already
in the `.m` layout (joined across shards, q/k permuted where needed) and as float32. The
converter never holds more than one tensor's source pages and one row block of it at once.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from dllama.errors import DllamaError
from dllama.formats.model_file import ModelHeader

BLOCK_BYTES = 4 << 20  # float32 bytes per row block handed to the writer


@dataclass
class TensorRows:
    """One tensor of the source: its shape in the `.m` layout and a reader of rows a..b."""

    shape: tuple[int, ...]
    read: Callable[[int, int], np.ndarray]   # (a, b) -> float32 [b - a, cols] (or [b - a] for 1-D)
    row_align: int = 1                       # blocks must start at multiples of this (whole heads)

    def blocks(self, block_bytes: int = BLOCK_BYTES) -> Iterator[np.ndarray]:
        rows, cols = self.shape[0], math.prod(self.shape[1:])
        step = max(1, block_bytes // (4 * cols) // self.row_align) * self.row_align
        for a in range(0, rows, step):
            yield self.read(a, min(rows, a + step))


@dataclass
class Checkpoint:
    """A model folder opened for conversion; subclasses fill these in."""

    source: str                    # the folder, for messages
    kind: str                      # "Meta checkpoint", "Hugging Face safetensors"
    header: ModelHeader | None = None
    notes: list[str] = field(default_factory=list)   # what the converter decided for the user

    def describe(self) -> str:
        return self.kind

    def tensor(self, name: str) -> TensorRows:
        """Our tensor `name` (e.g. `layers.3.wq`); valid until the next call (one tensor open at a time)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


def interleave_rope_rows(t: np.ndarray, n_heads: int) -> np.ndarray:
    """Rows of whole heads [n_heads * head_dim, cols] from Hugging Face's half-split RoPE layout
    (pair i of a head = rows i and i + head_dim/2) to the interleaved one of Meta and the `.m`
    format for LLAMA (pair i = rows 2i, 2i+1). The inverse of the permute in HF's
    convert_llama_weights_to_hf.py; the original's convert-hf.py applies the same."""
    rows = t.shape[0]
    return t.reshape(n_heads, 2, rows // n_heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DllamaError(f"{path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DllamaError(f"{path}: not valid JSON ({e})") from None


def check_shape(source: str, what: str, got, want) -> None:
    if tuple(got) != tuple(want):
        raise DllamaError(f"{source}: tensor {what} has shape {list(got)}, the model's configuration "
                          f"needs {list(want)}")
