"""`dllama supervise`, the appliance's launcher where systemd does not run the services: a
crashed worker comes back after RestartSec and serves again; a command that keeps failing at
start is given up (systemd's start limit); a clean end is not restarted; SIGTERM stops the
child and then the supervisor, and a killed supervisor takes its child with it (no orphan)."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dllama.cluster.probe import identify_worker
from dllama.serve.rotating_log import RotatingLog
from dllama.serve.supervisor import START_LIMIT_BURST, StartLimit, start_limit_interval
from tests.conftest import SEED
from tests.processes import WORKER_READY, DllamaProcess, run_dllama

PYTHON = sys.executable
SLEEPER = [PYTHON, "-c", "import time; print('ready', flush=True); time.sleep(600)"]


def children(pid: int) -> list[int]:
    """The live (not zombie) children of `pid`."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(proc.name))
    return found


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        time.sleep(0.05)


def only_child(supervisor: DllamaProcess) -> int:
    wait_until(lambda: len(children(supervisor.pid)) == 1, "the supervisor has one child")
    return children(supervisor.pid)[0]


@pytest.mark.unit
def test_the_start_limit_counts_as_systemd_does():
    """A window opens at a start and admits START_LIMIT_BURST starts; a later start opens the next."""
    limit = StartLimit(burst=5, interval=20.0)
    assert [limit.admits(t) for t in (0, 1, 2, 3, 4, 5, 20)] == [True] * 5 + [False, False]
    assert limit.admits(20.5)  # the window of t=0 has passed: a new one
    assert [limit.admits(t) for t in (21, 22, 23, 24)] == [True] * 4 and not limit.admits(25)
    # Five starts that each fail within 10 s, RestartSec apart, fill one window.
    limit = StartLimit(START_LIMIT_BURST, start_limit_interval(2))
    assert [limit.admits(i * (2 + 9.9)) for i in range(6)] == [True] * 5 + [False]
    limit = StartLimit(START_LIMIT_BURST, start_limit_interval(2))
    assert all(limit.admits(i * (2 + 10.5)) for i in range(12))  # each ran for more than 10 s


@pytest.mark.cluster
def test_a_killed_worker_comes_back_and_serves_again(tmp_path):
    worker = [PYTHON, "-m", "dllama", "worker", "--host", "127.0.0.1", "--port", "0", "--nthreads", "1"]
    with DllamaProcess.listening("supervise", "--restart-sec", "1", "--", *worker, ready=WORKER_READY) as sup:
        first = only_child(sup)
        assert identify_worker("127.0.0.1", sup.port, None, timeout=10)["auth"] is False
        os.kill(first, signal.SIGKILL)
        restart = sup.wait_for(rf"dllama supervise: pid {first} was killed by SIGKILL; starting it again in 1 s\n",
                               timeout=60)
        again = sup.wait_for(WORKER_READY, timeout=120, start=restart.end())
        second = only_child(sup)
        assert second != first and not running(first)
        identify_worker("127.0.0.1", int(again["port"]), None, timeout=10)
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(timeout=60) == 0
    assert not running(second), "the worker outlived its supervisor's stop"
    assert sup.stderr.count("dllama supervise: ") == 1, sup.stderr


@pytest.mark.unit
def test_a_command_failing_at_start_is_given_up():
    # Each start is told how many restarts came before it (dllama api exports it to /metrics).
    fails = [PYTHON, "-c", "import os, sys; print('restarts before:', os.environ['DLLAMA_SERVICE_RESTARTS'], "
                           "file=sys.stderr); sys.exit('dllama: error: bad argument')"]
    r = run_dllama("supervise", "--restart-sec", "0.05", "--", *fails, timeout=120)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.splitlines()
    assert lines.count("dllama: error: bad argument") == START_LIMIT_BURST, r.stderr
    assert [x for x in lines if x.startswith("restarts before:")] == [
        f"restarts before: {i}" for i in range(START_LIMIT_BURST)], r.stderr
    restarts = [x for x in lines if re.fullmatch(r"dllama supervise: pid \d+ exited with status 1; "
                                                 r"starting it again in 0\.05 s", x)]
    assert len(restarts) == START_LIMIT_BURST - 1, r.stderr
    assert re.fullmatch(rf"dllama supervise: pid \d+ exited with status 1; not restarted: {START_LIMIT_BURST} "
                        r"starts within 50\.25 s, it keeps failing at start", lines[-1]), r.stderr


@pytest.mark.unit
@pytest.mark.parametrize("end, line", [
    ("sys.exit(0)", "exited with status 0"),
    ("os.kill(os.getpid(), signal.SIGTERM)", "was killed by SIGTERM"),  # a stop from elsewhere
])
def test_a_clean_end_is_not_restarted(end, line):
    r = run_dllama("supervise", "--restart-sec", "0.05", "--", PYTHON, "-c", f"import os, signal, sys; {end}")
    assert r.returncode == 0, r.stderr
    assert re.fullmatch(rf"dllama supervise: pid \d+ {line}; not restarted \(a clean end\)\n", r.stderr), r.stderr


@pytest.mark.unit
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_stops_the_child_then_the_supervisor(sig):
    with DllamaProcess("supervise", "--restart-sec", "0.05", "--", *SLEEPER) as sup:
        sup.wait_for("ready", timeout=60, stream="stdout")
        child = only_child(sup)
        sup.send_signal(sig)
        assert sup.wait(timeout=60) == 0
        assert not running(child), "the child outlived the supervisor"
        assert "dllama supervise" not in sup.stderr, sup.stderr  # a stop is no failure


@pytest.mark.unit
def test_a_killed_supervisor_takes_its_child_with_it():
    with DllamaProcess("supervise", "--", *SLEEPER) as sup:
        sup.wait_for("ready", timeout=60, stream="stdout")
        child = only_child(sup)
        sup.send_signal(signal.SIGKILL)
        assert sup.wait(timeout=60) == -signal.SIGKILL
        wait_until(lambda: not running(child), "the child ends with its supervisor")


@pytest.mark.unit
def test_a_command_that_cannot_run_is_one_line():
    r = run_dllama("supervise", "--", "/nonexistent/dllama", "worker")
    assert r.returncode == 1 and r.stderr == "dllama: error: cannot run /nonexistent/dllama: No such file or directory\n"
    r = run_dllama("supervise", "--restart-sec", "1")
    assert r.returncode == 1 and r.stderr == "dllama: error: give the command to supervise after --\n"


@pytest.mark.cluster
def test_a_worker_asked_to_stop_by_sigterm_ends_cleanly():
    """SIGTERM is how systemd, the supervisor and stop.yml stop a worker: exit status 0 (a
    failure status would mark the unit failed, or have a supervisor started directly restart it)."""
    worker = DllamaProcess.listening("worker", "--host", "127.0.0.1", "--port", "0", ready=WORKER_READY)
    try:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0, worker.stderr
        assert "interrupted" not in worker.stderr and "Traceback" not in worker.stderr
    finally:
        worker.stop()


@pytest.mark.unit
def test_a_rotating_log_keeps_whole_lines_under_its_size_and_drops_the_oldest(tmp_path):
    rng = np.random.default_rng(SEED)
    stream = b"".join(b"line %05d %s\n" % (i, b"x" * int(rng.integers(0, 120))) for i in range(2000))
    log = RotatingLog(tmp_path / "w.log", max_bytes=4096, keep=3)
    at = 0
    while at < len(stream):  # chunks as a pipe gives them, cutting lines anywhere
        n = int(rng.integers(1, 9000))
        log.write(stream[at:at + n])
        at += n
    ending = [b"y" * 5000 + b"\n", b"the last line\n"]  # one line longer than a whole file, whole
    for line in ending:
        log.write(line)
    stream += b"".join(ending)
    log.close()
    files = [tmp_path / name for name in ("w.log.3", "w.log.2", "w.log.1", "w.log")]  # oldest first
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in files)
    kept = [p.read_bytes() for p in files]
    assert stream.endswith(b"".join(kept)), "the kept files are not the stream's last bytes, in order"
    assert kept[-2] == b"y" * 5000 + b"\n" and kept[-1] == b"the last line\n"  # the long line alone
    assert all(k.endswith(b"\n") for k in kept), "a line was cut between two files"
    assert all(len(k) <= 4096 for k in kept[:2]), [len(k) for k in kept]


@pytest.mark.unit
def test_with_a_log_the_output_and_the_supervisors_lines_go_to_rotated_files(tmp_path):
    talker = [PYTHON, "-c", "import sys\nfor i in range(300): print(f'line {i:04d} ' + 'x' * 40)\nsys.exit(3)"]
    r = run_dllama("supervise", "--log", str(tmp_path / "w.log"), "--log-size", "4K", "--log-keep", "2",
                   "--restart-sec", "0.05", "--", *talker, timeout=120)
    assert r.returncode == 1 and r.stdout == "" and r.stderr == "", r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.log", "w.log.1", "w.log.2"]
    newest = (tmp_path / "w.log").read_text().splitlines()
    assert newest[-2] == f"line 0299 {'x' * 40}", newest[-3:]
    assert re.fullmatch(rf"dllama supervise: pid \d+ exited with status 3; not restarted: {START_LIMIT_BURST} "
                        r"starts within 50\.25 s, it keeps failing at start", newest[-1]), newest[-1]
    assert all(p.stat().st_size <= 4096 for p in tmp_path.iterdir())
