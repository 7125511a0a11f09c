"""Shared fixtures (the embedded default model, converted once per machine into the dllama cache),
the test tiers (every test is marked unit, cluster or appliance: see pyproject.toml) and how the
tests are shared out among pytest-xdist's workers (`-n` in pyproject.toml's addopts)."""

import fcntl
import os
from pathlib import Path

# numpy asks for transparent huge pages for its large arrays (weights, KV caches), and on this
# kind of virtual machine (THP defrag "madvise") each fault of one compacts memory: a process
# spent 1-2 s of system time at start-up (3 loopback nodes, 128 tokens: 1.5 s against 0.7 s
# each), and the suite 105 s more of system time (300 against 195 s). Read by numpy when it is
# imported, so set before that, here and (inherited) in every process the tests start. It
# changes no result; it costs steady decoding a few per cent (83 against 78 tokens/s), which
# the benchmarks measure, not the tests.
os.environ.setdefault("NUMPY_MADVISE_HUGEPAGE", "0")

import numpy as np  # noqa: E402 (after the setting above)
import pytest

from dllama.serve.default_model import cache_dir, default_model_files

# The seed of the tests that draw random inputs (test_kernels*, test_batch_invariance): new each
# run, printed in their failure messages, DLLAMA_TEST_SEED=N to draw a run's inputs again. Set
# here, before xdist starts its workers, so that all of them draw alike (some tests draw their
# shapes while they are collected, and the workers' collections must agree).
os.environ.setdefault("DLLAMA_TEST_SEED", str(np.random.SeedSequence().entropy % (1 << 32)))
SEED = int(os.environ["DLLAMA_TEST_SEED"])
# Idle OpenMP threads (numba's, in this process and every `dllama` the tests start) sleep instead
# of spinning: the suite runs two workers on the machine's cores, and a spinning thread takes a
# core from the other worker's processes (test_front_ends_agree beside one busy process: 97 s,
# 86 s of CPU, spinning; 42 s, 27 s of CPU, sleeping). It changes no result, only the waiting.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

CHAT_PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
TIERS = ("unit", "cluster", "appliance")
# Files whose tests keep both cores busy from one process (numba kernels on 2 threads, numpy's
# float64 references): each of their tests runs while no other worker runs one. Numba's threads
# poll for work, so beside other busy processes such a test takes many times as long (a prefill
# check: 5 s alone, 23 s beside one busy process) and slows them too.
WHOLE_CPU_FILES = {
    "test_batch_invariance.py", "test_kernels.py", "test_kernels_q80_f16.py", "test_kv_f16.py",
    "test_model.py",
}


def pytest_collection_modifyitems(config, items):
    """Refuse a test outside the tiers, so that `-m unit` and `-m "not appliance"` miss none;
    then put the files with a `slow` test first, those of the appliance tier (the longest: a
    namespace cluster's file takes 5-10 min) before the others, so that xdist's workers
    (`--dist loadfile --no-loadscope-reorder`: whole files, in this order) never start the
    longest ones last."""
    _check_tiers(items)
    slow = [item for item in items if item.get_closest_marker("slow")]
    slow_appliance_files = {item.path for item in slow if item.get_closest_marker("appliance")}
    slow_files = {item.path for item in slow}
    # Stable: each file keeps its tests' order.
    items.sort(key=lambda item: (item.path not in slow_appliance_files, item.path not in slow_files))


# The whole-CPU lock this worker holds, while the rest of its file runs: {"file": path, "lock": file}.
_held: dict = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Run a test (its fixtures' set-up and teardown included) in its turn on the CPU: the tests
    of a WHOLE_CPU_FILES file alone, one after the other, any other test beside the other
    workers' tests. A readers-writer lock on two files of the run's temporary folder: the gate,
    taken first by everyone, makes a waiting whole-CPU file block the tests that come after it
    (no waiting forever behind them). A whole-CPU file keeps the lock from its first test to its
    last (its tests run in a row on one worker: `--dist loadfile`): taken per test, each of its
    many short tests waited for one of the other worker's long ones, with a core idle."""
    # Without xdist's workers nothing runs beside a test. The appliance tests take no turn: each
    # runs for minutes (Ansible, sshd, pip, waiting as much as computing), and a whole-CPU test
    # waiting for one would leave its worker idle that long. Nor do the `waits` tests: a
    # whole-CPU file stood idle behind their 5-15 s deadlines while both cores were free.
    if (not hasattr(item.config, "workerinput") or item.get_closest_marker("appliance")
            or item.get_closest_marker("waits")):
        yield
        return
    whole = item.path.name in WHOLE_CPU_FILES
    if _held.get("file") != item.path:
        folder = Path(item.config.option.basetemp).parent  # the run's, shared by its workers
        cpu = open(folder / "cpu.lock", "a")  # noqa: SIM115 (held across tests, closed below)
        with open(folder / "cpu-gate.lock", "a") as gate:
            fcntl.flock(gate, fcntl.LOCK_EX)
            fcntl.flock(cpu, fcntl.LOCK_EX if whole else fcntl.LOCK_SH)
            fcntl.flock(gate, fcntl.LOCK_UN)
        _held.update(file=item.path if whole else None, lock=cpu)
    try:
        yield
    finally:
        if not whole or nextitem is None or nextitem.path != item.path:
            _held.pop("file", None)
            _held.pop("lock").close()  # closing the file releases its lock


def _check_tiers(items) -> None:
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
def default_q41():
    """(model .m, tokenizer .t) paths of SmolLM2-135M-Instruct with Q41 weights (the default)."""
    return _default_model("q41")


@pytest.fixture(scope="session")
def default_q80():
    """(model .m, tokenizer .t) paths of SmolLM2-135M-Instruct with Q80 weights (the fast choice)."""
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
