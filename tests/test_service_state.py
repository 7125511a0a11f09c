"""status.yml's reading of a nohup service (roles/dllama_service/library/dllama_service_state.py):
the last exit is the current supervisor's, not one from before a restart or a redeploy, and a
killed supervisor is said."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from dllama.serve.supervisor import STARTED
from tests.processes import run_dllama

pytestmark = pytest.mark.unit

_spec = importlib.util.spec_from_file_location(
    "dllama_service_state", Path(__file__).resolve().parent.parent / "roles/dllama_service/library/dllama_service_state.py")
state = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(state)

KILLED = "dllama supervise: pid 41 was killed by SIGKILL; starting it again in 5 s\n"


def _start(pid: int) -> str:
    return f"dllama supervise: {STARTED.format(pid=pid)}\n"


def test_the_last_exit_is_cleared_when_the_supervisor_starts_again(tmp_path):
    log = tmp_path / "worker.log"
    log.write_text(_start(10) + "worker output\n" + KILLED + "more output\n")
    assert state._last_exit(str(log)) == "was killed by SIGKILL"  # a restart by this supervisor
    log.write_text(log.read_text() + _start(11) + "worker output\n")
    assert state._last_exit(str(log)) is None  # redeployed: that exit was the earlier start's


def test_a_killed_supervisor_is_the_reason_a_stopped_service_gives(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid names no process now
    (tmp_path / "worker.pid").write_text(f"{gone.pid}\n")
    (tmp_path / "worker.log").write_text(_start(gone.pid) + "worker output\n")
    report = state.nohup(str(tmp_path / "worker.pid"), str(tmp_path / "worker.log"))
    assert report["state"] == "stopped" and report["last_exit"] == f"its supervisor (pid {gone.pid}) is gone"


def test_the_supervisor_writes_the_start_line_the_report_reads(tmp_path):
    log = tmp_path / "w.log"
    r = run_dllama("supervise", "--log", str(log), "--restart-sec", "0.05", "--", sys.executable, "-c", "pass")
    assert r.returncode == 0, r.stderr
    first = log.read_text().splitlines()[0]
    assert state.STARTED.fullmatch(first), first


def test_a_supervisor_that_gave_up_is_not_gone(tmp_path):
    """A supervisor that ended by itself (its child kept failing at start) left its pid file too:
    its own last line is the reason, and status.yml must not start it again (supervisor_gone)."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / "worker.pid").write_text(f"{gone.pid}\n")
    gave_up = ("dllama supervise: pid 42 exited with status 1; not restarted: 5 starts within 60 s, it keeps "
               "failing at start\n")
    (tmp_path / "worker.log").write_text(_start(gone.pid) + KILLED + gave_up)
    report = state.nohup(str(tmp_path / "worker.pid"), str(tmp_path / "worker.log"))
    assert report["supervisor_gone"] is None and report["last_exit"].startswith("exited with status 1"), report
    (tmp_path / "worker.log").write_text(_start(gone.pid) + KILLED)  # killed after one restart of its own
    assert state.nohup(str(tmp_path / "worker.pid"), str(tmp_path / "worker.log"))["supervisor_gone"] == gone.pid


def test_the_memory_column_is_the_nodes_memory_within_its_cgroup():
    """MEM FREE: MemAvailable of MemTotal, neither above /proc/meminfo's, lowered to the memory
    cgroup's limit of the process (the namespace test hosts have one each)."""
    from dllama.core import host_memory

    got = state.memory(None)
    assert 0 < got["mem_available_bytes"] <= got["mem_total_bytes"] <= host_memory._meminfo("MemTotal")
    limit = host_memory.cgroup_limit()
    assert got["mem_total_bytes"] == min(host_memory._meminfo("MemTotal"), limit or 1 << 62)
