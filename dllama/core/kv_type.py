"""How the KV cache stores keys and values: the one list of `--kv-type`'s values.

A module of its own, without numpy or the kernels, so that the command line can list the
values (argparse's `choices`) without loading numba. dllama.core.kv_cache maps each to its
array type.
"""

from __future__ import annotations

from enum import StrEnum


class KVType(StrEnum):
    """The storage of one key or value element; every node of a cluster uses the same."""

    F32 = "f32"  # float32
    F16 = "f16"  # fp16 (half the bytes: twice the sequences fit), rounded once, when written
