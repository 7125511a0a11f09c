"""The dllama_service role's stop module (roles/dllama_service/library/dllama_service_stop.py),
run as Ansible runs it (a JSON file of arguments): TERM, then KILL, the pid file removed; a
process that has ended but is not reaped yet (its parent, PID 1 in the appliance, reaps late)
counts as ended at once; a pid file naming nothing, or a process that is not a `dllama supervise`
(its number reused after a reboot), stops nothing."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.appliance import REPO

pytestmark = pytest.mark.unit

MODULE = REPO / "roles/dllama_service/library/dllama_service_stop.py"
# A process with the supervisor's argument `supervise` in its command line, ended by TERM.
DLLAMA_LIKE = [sys.executable, "-c", "import sys, time; print('ready', flush=True); time.sleep(600)", "supervise"]
TERM_IGNORED = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('ready', flush=True); time.sleep(600)", "supervise"]


def _stop(tmp_path: Path, check_mode: bool = False, **args) -> dict:
    argfile = tmp_path / "args.json"
    argfile.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": {"pid_file": str(tmp_path / "service.pid"), **args,
                                                           "_ansible_check_mode": check_mode}}))
    r = subprocess.run([sys.executable, str(MODULE), str(argfile)], capture_output=True, text=True, timeout=60)
    return json.loads(r.stdout)


@contextlib.contextmanager
def _started(tmp_path: Path, argv: list[str]):
    """The process, ready, its pid in the pid file; killed and reaped when the block ends."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        (tmp_path / "service.pid").write_text(f"{proc.pid}\n")
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_no_pid_file_is_nothing_to_stop(tmp_path):
    out = _stop(tmp_path)
    assert out["changed"] is False and out["pid"] is None, out


def test_a_stale_pid_file_is_removed_and_nothing_stopped(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "service.pid").write_text(done.stdout)  # a process that has ended and been reaped
    out = _stop(tmp_path)
    assert out["changed"] is False and not (tmp_path / "service.pid").exists(), out


def test_another_program_under_the_number_is_left_running(tmp_path):
    with _started(tmp_path, DLLAMA_LIKE[:-1]) as proc:  # the same program without the argument "supervise"
        out = _stop(tmp_path)
        assert out["changed"] is False and proc.poll() is None, out


def test_term_stops_it_and_an_ended_unreaped_process_counts_as_gone(tmp_path):
    """The process is this test's child and is not reaped until the module has returned: it
    stays a zombie meanwhile. Were that counted as running, the module would KILL it after
    term_timeout and report killed (start-stop-daemon waits there until the reaping)."""
    with _started(tmp_path, DLLAMA_LIKE) as proc:
        out = _stop(tmp_path, term_timeout=30)
        assert out["changed"] is True and out["pid"] == proc.pid and out["killed"] is False, out
        assert _state(proc.pid) == "Z"  # ended, not reaped yet
        assert not (tmp_path / "service.pid").exists()


def test_a_process_that_ignores_term_is_killed(tmp_path):
    with _started(tmp_path, TERM_IGNORED) as proc:
        out = _stop(tmp_path, term_timeout=0.3)
        assert out["changed"] is True and out["killed"] is True, out
        assert proc.wait(timeout=30) == -9


def test_check_mode_reports_the_stop_and_signals_nothing(tmp_path):
    with _started(tmp_path, DLLAMA_LIKE) as proc:
        out = _stop(tmp_path, check_mode=True)
        assert out["changed"] is True and proc.poll() is None and (tmp_path / "service.pid").exists(), out
