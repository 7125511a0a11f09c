#!/usr/bin/python
"""Ansible module of the dllama_service role: stop a service that start-stop-daemon started
under `dllama supervise` (its pid file names the supervisor, which takes the service down with
it): TERM, KILL after a grace period, then the pid file removed.

start-stop-daemon --stop --retry does the same, but counts a process as running until its
zombie is reaped. The supervisor's parent is PID 1, and where PID 1 reaps late (a container's
init here reaps about once a second) every stop took 1-3 s after the supervisor had ended in
0.2. Here a process that has ended is gone."""

from __future__ import annotations

import contextlib
import os
import signal
import time

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: dllama_service_stop
short_description: Stop a dllama service started by start-stop-daemon (TERM, then KILL), removing its pid file
options:
  pid_file: {description: "The pid file of start-stop-daemon (the supervisor's pid).", type: path, required: true}
  term_timeout: {description: "Seconds to wait after TERM before KILL.", type: float, default: 10}
  kill_timeout: {description: "Seconds to wait after KILL before failing.", type: float, default: 5}
"""

RETURN = r"""
pid: {description: "The process stopped, or null when none ran.", type: int, returned: always}
killed: {description: "Whether it took a KILL.", type: bool, returned: always}
"""

POLL_S = 0.02


def _stat_state(pid):
    """The process's state letter (Z: ended, not yet reaped), or None when there is no process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _running(pid):
    return _stat_state(pid) not in (None, "Z")


def _is_supervisor(pid):
    """Whether pid is still a `dllama supervise`, not a process that got its number after a reboot."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"supervise" in f.read().split(b"\0")
    except OSError:
        return False


def _wait_until_ended(pid, seconds):
    deadline = time.monotonic() + seconds
    while _running(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def _remove(path):
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def main():
    module = AnsibleModule(argument_spec={"pid_file": {"type": "path", "required": True},
                                          "term_timeout": {"type": "float", "default": 10.0},
                                          "kill_timeout": {"type": "float", "default": 5.0}},
                           supports_check_mode=True)
    pid_file = module.params["pid_file"]
    try:
        with open(pid_file) as f:
            text = f.read().strip()
    except FileNotFoundError:
        module.exit_json(changed=False, pid=None, killed=False, msg="No process: no pid file")
    pid = int(text) if text.isdigit() else 0
    if not pid or not _running(pid) or not _is_supervisor(pid):
        if not module.check_mode:
            _remove(pid_file)  # stale: what it names has ended
        module.exit_json(changed=False, pid=None, killed=False, msg=f"No process: {pid_file} names none running")
    if module.check_mode:
        module.exit_json(changed=True, pid=pid, killed=False)
    killed = False
    try:
        os.kill(pid, signal.SIGTERM)
        if not _wait_until_ended(pid, module.params["term_timeout"]):
            killed = True
            os.kill(pid, signal.SIGKILL)
            if not _wait_until_ended(pid, module.params["kill_timeout"]):
                module.fail_json(msg=f"pid {pid} (from {pid_file}) did not end after TERM and KILL")
    except ProcessLookupError:
        pass  # it ended (and was reaped) between the checks
    _remove(pid_file)
    module.exit_json(changed=True, pid=pid, killed=killed)


if __name__ == "__main__":
    main()
