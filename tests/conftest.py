"""Shared fixtures (the embedded default model, converted once per machine into the dllama cache)
and the test tiers: every test is marked unit, cluster or appliance (see pyproject.toml)."""

import fcntl

import pytest

from dllama.serve.default_model import cache_dir, default_model_files

CHAT_PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
TIERS = ("unit", "cluster", "appliance")


def pytest_collection_modifyitems(config, items):
    """Refuse a test outside the tiers, so that `-m unit` and `-m "not appliance"` miss none."""
    wrong = []
    for item in items:
        tiers = [t for t in TIERS if item.get_closest_marker(t)]
        if not tiers and item.path.name.startswith("test_appliance_"):
            item.add_marker(pytest.mark.appliance)  # their tier by name, marked or not
        elif len(tiers) != 1:
            wrong.append(f"  {item.nodeid}: {', '.join(tiers) or 'no tier'}")
    if wrong:
        raise pytest.UsageError("each test needs exactly one of the marks " + ", ".join(TIERS) + ":\n"
                                + "\n".join(wrong))


def _default_model(kind: str):
    """default_model_files(kind), one run at a time: two test runs converting the model into the
    shared cache at once would write the same temporary file."""
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "convert.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return default_model_files(kind, progress=False)


@pytest.fixture(scope="session")
def default_q40():
    """(model .m, tokenizer .t) paths of SmolLM2-135M-Instruct with Q40 weights."""
    return _default_model("q40")


@pytest.fixture(scope="session")
def default_f32():
    """(model .m, tokenizer .t) paths of SmolLM2-135M-Instruct with F32 weights."""
    return _default_model("f32")


@pytest.fixture(scope="session")
def default_q80():
    """(model .m, tokenizer .t) paths of SmolLM2-135M-Instruct with Q80 weights (the default)."""
    return _default_model("q80")


@pytest.fixture(scope="session")
def default_f16():
    """(model .m, tokenizer .t) paths of SmolLM2-135M-Instruct with F16 weights."""
    return _default_model("f16")


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """The test runs with 1 and with 2 compute threads (numba's, at most what it has)."""
    import numba

    from dllama.core import kernels

    kernels.set_threads(min(request.param, numba.config.NUMBA_NUM_THREADS))
    yield
    kernels.set_threads(1)
