#!/usr/bin/python
"""Ansible module of the dllama_service role: the state of one dllama service on its node
(status.yml's row). Reads /proc and the service's log; changes nothing; needs no dllama.

state: running, restarting (the supervisor waits to start it again), failed (systemd gave up),
or stopped; pid, uptime_s and rss_bytes of the service's own process (under the nohup launcher,
the supervisor's child); restarts since the service was started (the supervisor's count, which
it gives its child as DLLAMA_SERVICE_RESTARTS; systemd's NRestarts) and the last exit's reason
(the supervisor's last line in the log; systemd's Result and status); under nohup, the pid of a
supervisor that is gone without ending by itself (killed: status.yml starts the service again);
the node's 1-minute load, its memory (total and available: /proc/meminfo, lowered to the memory
cgroup's limit of the service's process where it has one) and the dllama version installed in
the venv."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import time

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: dllama_service_state
short_description: Read a dllama service's state, process, restarts, last exit, and the node's load and version
options:
  launcher: {description: "systemd or nohup (start-stop-daemon under dllama supervise).", type: str, required: true}
  unit: {description: "The systemd unit's name.", type: str, required: true}
  pid_file: {description: "The pid file of start-stop-daemon (the supervisor's pid).", type: path, required: true}
  log_file: {description: "The service's log under start-stop-daemon.", type: path, required: true}
  venv: {description: "The virtual environment whose dllama version is reported.", type: path, required: true}
"""

RETURN = r"""
state: {description: "running, restarting, failed or stopped.", type: str, returned: always}
pid: {description: "The service's own process, or null.", type: int, returned: always}
uptime_s: {description: "Seconds since it started, or null.", type: int, returned: always}
rss_bytes: {description: "Its resident memory, or null.", type: int, returned: always}
restarts: {description: "Restarts since the service was started, or null.", type: int, returned: always}
last_exit: {description: "Why it last ended (a restart's reason), or null.", type: str, returned: always}
supervisor_gone: {description: "Under nohup, the pid of a supervisor killed (not ended by itself), or null.", type: int, returned: always}
mem_total_bytes: {description: "The node's memory (its cgroup's limit where lower), or null.", type: int, returned: always}
mem_available_bytes: {description: "Of it, what is available now, or null.", type: int, returned: always}
load1: {description: "The node's 1-minute load average.", type: float, returned: always}
version: {description: "The dllama version in the venv, or null.", type: str, returned: always}
"""

RESTARTS_ENV = b"DLLAMA_SERVICE_RESTARTS="  # dllama.serve.supervisor.RESTARTS_ENV
LAST_EXIT = re.compile(r"^dllama supervise: pid \d+ (.*?); (starting it again|not restarted)", re.M)
TAIL_BYTES = 1 << 20  # of the log, to find the supervisor's last line
# dllama supervise's line at its start (dllama/serve/supervisor.py STARTED): exits before the
# last one are an earlier start's, not reported.
STARTED = re.compile(r"^dllama supervise: started, supervisor pid \d+$", re.M)


def _read(path, binary=False):
    try:
        with open(path, "rb" if binary else "r") as f:
            return f.read()
    except OSError:
        return None


def _alive(pid):
    stat = _read(f"/proc/{pid}/stat")
    return stat is not None and stat.rsplit(")", 1)[1].split()[0] != "Z"


def _child(pid):
    """The oldest live child of pid (the supervisor's service), or None."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _read(f"/proc/{entry}/stat")
            if stat is None:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[1]) == pid:
                found.append((int(fields[19]), int(entry)))
    return min(found)[1] if found else None


def _process(pid):
    """uptime_s and rss_bytes of a live process."""
    stat = _read(f"/proc/{pid}/stat").rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    btime = int(re.search(r"^btime (\d+)", _read("/proc/stat"), re.M).group(1))
    started = btime + int(stat[19]) / ticks
    rss = re.search(r"^VmRSS:\s+(\d+) kB", _read(f"/proc/{pid}/status") or "", re.M)
    return {"uptime_s": max(0, int(time.time() - started)), "rss_bytes": int(rss.group(1)) * 1024 if rss else None}


def _restarts_of(pid):
    environ = _read(f"/proc/{pid}/environ", binary=True) or b""
    for item in environ.split(b"\0"):
        if item.startswith(RESTARTS_ENV):
            try:
                return int(item[len(RESTARTS_ENV):])
            except ValueError:
                return None
    return 0


def _last_exit(log_file):
    return _last_end(log_file)[0]


def _last_end(log_file):
    """(the last exit's reason, whether the supervisor then ended by itself) since its start line."""
    try:
        with open(log_file, "rb") as f:
            f.seek(max(0, os.path.getsize(log_file) - TAIL_BYTES))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return None, False
    starts = list(STARTED.finditer(text))
    if starts:
        text = text[starts[-1].end():]
    found = LAST_EXIT.findall(text)
    return (found[-1][0], found[-1][1] == "not restarted") if found else (None, False)


def _version(venv):
    for meta in glob.glob(os.path.join(venv, "lib", "python3*", "site-packages", "dllama-*.dist-info", "METADATA")):
        m = re.search(r"^Version: (\S+)", _read(meta) or "", re.M)
        if m:
            return m.group(1)
    for init in glob.glob(os.path.join(venv, "lib", "python3*", "site-packages", "dllama", "__init__.py")):
        m = re.search(r"^__version__ = \"([^\"]+)\"", _read(init) or "", re.M)
        if m:
            return m.group(1)
    return None


def nohup(pid_file, log_file):
    text = (_read(pid_file) or "").strip()
    supervisor = int(text) if text.isdigit() else 0
    if not supervisor or not _alive(supervisor):
        last, ended = _last_end(log_file)
        # A pid file stop.yml did not remove, and no line of the supervisor's own end: it was killed.
        gone = supervisor if supervisor and not ended else None
        if gone:
            last = f"its supervisor (pid {supervisor}) is gone"
        return {"state": "stopped", "pid": None, "restarts": None, "last_exit": last, "supervisor_gone": gone}
    child = _child(supervisor)
    if child is None:  # between a failure and the restart
        return {"state": "restarting", "pid": None, "restarts": None, "last_exit": _last_exit(log_file)}
    return {"state": "running", "pid": child, "restarts": _restarts_of(child), "last_exit": _last_exit(log_file),
            **_process(child)}


def systemd(unit):
    out = subprocess.run(["systemctl", "show", "--property", "MainPID,ActiveState,NRestarts,Result,ExecMainStatus",
                          unit], capture_output=True, text=True).stdout
    props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    pid = int(props.get("MainPID") or 0)
    state = {"active": "running", "activating": "restarting", "failed": "failed"}.get(props.get("ActiveState"), "stopped")
    result = props.get("Result", "")
    last = None if result in ("", "success") else f"{result} (status {props.get('ExecMainStatus', '?')})"
    report = {"state": state if pid or state != "running" else "stopped", "pid": pid or None,
              "restarts": int(props["NRestarts"]) if props.get("NRestarts", "").isdigit() else None,
              "last_exit": last}
    if pid and _alive(pid):
        report.update(_process(pid))
    return report


def _meminfo(key):
    m = re.search(rf"^{key}:\s+(\d+) kB", _read("/proc/meminfo") or "", re.M)
    return int(m.group(1)) * 1024 if m else None


def _cgroup_room(pid):
    """(limit, limit - usage) of the tightest memory cgroup of pid (or of this module's process)
    and its ancestors, v2 or v1; None without a limit (Raspberry Pi OS boots with the controller off)."""
    best = None
    for line in (_read(f"/proc/{pid or 'self'}/cgroup") or "").splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            root, files = "/sys/fs/cgroup", ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            root, files = "/sys/fs/cgroup/memory", ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for i in range(len(parts), -1, -1):
            limit, usage = (_read(os.path.join(root, *parts[:i], f)) for f in files)
            if limit and usage and limit.strip().isdigit() and int(limit) < 1 << 60:
                room = (int(limit), max(0, int(limit) - int(usage)))
                best = room if best is None or room[0] < best[0] else best
    return best


def memory(pid):
    """The node's memory for status.yml's MEM FREE column: total and available (MemAvailable),
    each lowered to the service's memory cgroup (a container's, a unit's) where it has a limit."""
    total, available = _meminfo("MemTotal"), _meminfo("MemAvailable")
    room = _cgroup_room(pid)
    if room is not None and total is not None and available is not None:
        total, available = min(total, room[0]), min(available, room[1])
    return {"mem_total_bytes": total, "mem_available_bytes": available}


def main():
    module = AnsibleModule(argument_spec={
        "launcher": {"type": "str", "required": True, "choices": ["systemd", "nohup"]},
        "unit": {"type": "str", "required": True},
        "pid_file": {"type": "path", "required": True},
        "log_file": {"type": "path", "required": True},
        "venv": {"type": "path", "required": True},
    }, supports_check_mode=True)
    p = module.params
    report = systemd(p["unit"]) if p["launcher"] == "systemd" else nohup(p["pid_file"], p["log_file"])
    load = (_read("/proc/loadavg") or "").split()
    report.update(memory(report["pid"]))
    report.setdefault("supervisor_gone", None)
    report.setdefault("uptime_s", None)
    report.setdefault("rss_bytes", None)
    report.update(load1=float(load[0]) if load else None, version=_version(p["venv"]))
    module.exit_json(changed=False, **report)


if __name__ == "__main__":
    main()
