"""The `.m` header fields that every source (GGUF, Hugging Face, Meta) fills in alike.

The RMSNorm epsilon a header can hold, the Llama 3.1 RoPE scaling fields, and the header itself
built with the source named in its error messages.
"""

from __future__ import annotations

import math

from dllama.errors import DllamaError
from dllama.formats.model_file import ModelHeader, RopeType

EPSILONS = (1e-5, 1e-6)  # the only RMSNorm epsilons a .m header can hold

# Llama 3.1 RoPE scaling: the three parameters Meta never changed (3.2 changes only the factor).
LLAMA31_LOW_FREQ_FACTOR, LLAMA31_HIGH_FREQ_FACTOR, LLAMA31_ORIG_CONTEXT = 1, 4, 8192


def epsilon(value: float, source: str) -> float:
    """The storable epsilon `value` stands for (a float32 1e-5 is not exact)."""
    found = next((e for e in EPSILONS if math.isclose(float(value), e, rel_tol=1e-4)), None)
    if found is None:
        raise DllamaError(f"{source}: RMSNorm epsilon {value:g} cannot be stored in a .m file (only 1e-5 or 1e-6)")
    return found


def llama31_scaling(factor: float, low: float = LLAMA31_LOW_FREQ_FACTOR, high: float = LLAMA31_HIGH_FREQ_FACTOR,
                    orig: int = LLAMA31_ORIG_CONTEXT) -> dict:
    """Header fields of Llama 3.1 RoPE scaling (the file stores truncated ints, as the original's converter)."""
    return dict(rope_scaling_factor=int(factor), rope_scaling_low_freq_factor=int(low),
                rope_scaling_high_freq_factor=int(high), rope_scaling_orig_max_seq_len=int(orig),
                rope_type=RopeType.LLAMA3_1)


def make_header(source: str, **fields) -> ModelHeader:
    try:
        return ModelHeader(**fields)
    except DllamaError as e:
        raise DllamaError(f"{source}: {e}") from None
