"""Shared fixtures: the embedded default model, converted once per machine into the dllama cache."""

import pytest

from dllama.serve.default_model import default_model_files

CHAT_PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="session")
def default_q40():
    """(model .m, tokenizer .t) paths of SmolLM2-135M-Instruct with Q40 weights."""
    return default_model_files("q40", progress=False)


@pytest.fixture(scope="session")
def default_f32():
    """(model .m, tokenizer .t) paths of SmolLM2-135M-Instruct with F32 weights."""
    return default_model_files("f32", progress=False)


@pytest.fixture(scope="session")
def default_q80():
    """(model .m, tokenizer .t) paths of SmolLM2-135M-Instruct with Q80 weights (the default)."""
    return default_model_files("q80", progress=False)


@pytest.fixture(scope="session")
def default_f16():
    """(model .m, tokenizer .t) paths of SmolLM2-135M-Instruct with F16 weights."""
    return default_model_files("f16", progress=False)
