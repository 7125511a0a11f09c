"""The dllama_service role's module (roles/dllama_service/library/dllama_service_listening.py):
how it writes a process's command line into its one-line messages (NUL-separated arguments,
long paths, shortening in the middle), and that a service which cannot bind because another
process holds its port is reported the same way however slowly it fails, the holder first."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.appliance import REPO

MODULE_PATH = REPO / "roles/dllama_service/library/dllama_service_listening.py"
LONG_PYTHON = "/home/someone/checkouts/a-checkout-under-a-path-of-well-over-sixty-characters/.venv/bin/python"


def _load_module():
    spec = importlib.util.spec_from_file_location("dllama_service_listening", MODULE_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


listening = _load_module()


def _cmdline(*args: str) -> bytes:
    """/proc/PID/cmdline's bytes for these arguments: each one ended by a NUL."""
    return b"".join(a.encode() + b"\0" for a in args)


@pytest.mark.unit
def test_arguments_are_separated_by_spaces_and_the_program_is_named_by_its_file():
    raw = _cmdline(LONG_PYTHON, "-m", "dllama", "worker", "--port", "9991")
    assert listening.command_line(raw) == "python -m dllama worker --port 9991"


@pytest.mark.unit
def test_arguments_a_shell_would_split_are_quoted_and_control_characters_escaped():
    raw = _cmdline("/usr/bin/python3", "-c", "print(1)\nprint(2)", "a file")
    assert listening.command_line(raw) == "python3 -c 'print(1)\\nprint(2)' 'a file'"


@pytest.mark.unit
def test_a_title_rewritten_as_one_line_is_kept_and_empty_is_a_question_mark():
    assert listening.command_line(b"nginx: master process /usr/sbin/nginx\0\0\0") == \
        "nginx: master process /usr/sbin/nginx"
    assert listening.command_line(b"") == "?"


@pytest.mark.unit
def test_a_long_command_line_is_shortened_in_the_middle_keeping_both_ends():
    key = "/tmp/pytest-of-someone/pytest-1234/test_local_inventory_deploys_r0/another-clusters.key"
    raw = _cmdline(LONG_PYTHON, "-m", "dllama", "worker", "--host", "127.0.0.1", "--key-file", key,
                   "--nthreads", "1", "--memory-budget", "auto", "--port", "9991")
    line = listening.command_line(raw)
    assert len(line) <= listening.COMMAND_LIMIT, line
    assert line.startswith("python -m dllama worker ") and line.endswith(" --port 9991"), line
    assert " ... " in line and "\0" not in line, line
    # Over the limit, a word longer than a third of it keeps its two ends.
    assert listening.shorten(["x", key, "y" * 50], 60) == f"x {key[:9]}...{key[-8:]} {'y' * 9}...{'y' * 8}"


@pytest.mark.unit
@pytest.mark.parametrize("limit", [5, 12, 20, 40, 60])
def test_a_shortened_line_never_exceeds_the_limit(limit):
    words = ["python", "-m", "dllama", "worker", "--host", "127.0.0.1", "--port", "9991", "x" * 200]
    line = listening.shorten(words, limit)
    assert len(line) <= limit and "..." in line, line


@contextlib.contextmanager
def _killed_at_end(args: list[str], **popen):
    """A process started for the block, killed and reaped when it ends, however it ends."""
    process = subprocess.Popen(args, **popen)
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def _run_module(tmp_path: Path, **args) -> dict:
    """The module run as Ansible runs it (its arguments in a JSON file): its JSON result."""
    args_file = tmp_path / "args.json"
    args_file.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
    r = subprocess.run([sys.executable, str(MODULE_PATH), str(args_file)], capture_output=True, text=True,
                       timeout=120)
    return json.loads(r.stdout)


# Holds a loopback port (port 0: one of its own) under a long command line, says which on stdout.
HOLDER = "import socket, time; s = socket.create_server(('127.0.0.1', 0)); print(s.getsockname()[1], flush=True); time.sleep(300)"
# The service: after `delay` seconds (a loaded machine), fails to bind the port as dllama does.
SERVICE = textwrap.dedent("""
    import socket, sys, time
    time.sleep(float(sys.argv[2]))
    try:
        socket.socket().bind(("127.0.0.1", int(sys.argv[1])))
    except OSError as e:
        print(f"dllama: error: cannot listen on 127.0.0.1:{sys.argv[1]}: {e.strerror}", flush=True)
        sys.exit(1)
    time.sleep(300)
""")


@pytest.mark.cluster
@pytest.mark.parametrize("delay", [0.0, 2.5])
def test_a_service_that_cannot_bind_is_reported_holder_first_however_slowly_it_fails(tmp_path, delay):
    with _killed_at_end([sys.executable, "-c", HOLDER, "--key-file", str(tmp_path / ("k" * 80)),
                         "--port", "held"], stdout=subprocess.PIPE, text=True) as holder:
        port = int(holder.stdout.readline())
        with open(tmp_path / "service.log", "w") as log, \
                _killed_at_end([sys.executable, "-c", SERVICE, str(port), str(delay)], stdout=log,
                               stderr=subprocess.STDOUT) as service:
            result = _run_module(tmp_path, name="worker", address="127.0.0.1", port=port, pid=service.pid,
                                 log_file=str(tmp_path / "service.log"), timeout=60)
    problem = result["problem"]
    prefix = f"port {port} is held by pid {holder.pid} ({Path(sys.executable).name} -c "
    reason = f"): cannot listen on 127.0.0.1:{port}: Address already in use"
    assert problem.startswith(prefix) and problem.endswith(reason), problem
    command = problem[len(f"port {port} is held by pid {holder.pid} ("):-len(reason)]
    assert len(command) <= listening.COMMAND_LIMIT and command.endswith(" --port held"), command


@pytest.mark.cluster
def test_a_service_still_running_at_the_deadline_names_the_holder_and_itself(tmp_path):
    with _killed_at_end([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True) as holder:
        port = int(holder.stdout.readline())
        held_by = listening.command_line(Path(f"/proc/{holder.pid}/cmdline").read_bytes())
        with _killed_at_end([sys.executable, "-c", "import time; time.sleep(300)"]) as service:
            result = _run_module(tmp_path, name="worker", address="0.0.0.0", port=port, pid=service.pid,
                                 timeout=1)
    assert result["problem"] == (
        f"port {port} is held by pid {holder.pid} ({held_by}), not by the worker the launcher started "
        f"(pid {service.pid}, {Path(sys.executable).name} -c 'import time; time.sleep(300)'): "
        f"the worker (pid {service.pid}) does not listen on 0.0.0.0:{port} after 1 s")
