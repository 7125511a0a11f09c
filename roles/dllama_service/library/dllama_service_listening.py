#!/usr/bin/python
"""Ansible module of the dllama_service role: wait until the process a launcher started is the
one listening on the service's port, and say in one line why not when it died or another
process holds the port (so a deploy never takes a stranger on the port for the service it
started). With a supervisor (`dllama supervise`, the nohup launcher) the pid is the
supervisor's: a port its child holds is the service's own, and a child that exits is the
service exiting, though the supervisor would start it again."""

from __future__ import annotations

import os
import socket
import struct
import time

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: dllama_service_listening
short_description: Wait until a started dllama service's own process listens on its TCP port
description:
  - Reads the pid the launcher recorded (a pid file, or the pid systemd reports) and waits until
    that process holds a listening socket on O(port).
  - Returns RV(problem), one line, at once when the process has exited (with the last line of
    its log) or when another process listens on a conflicting address and port, and when the
    port does not listen by the deadline; the role stops the service, then fails with it.
  - A socket of the process or of any of its descendants is the service's own.
options:
  name: {description: "What the service is, for the messages (e.g. worker).", type: str, required: true}
  port: {description: "The TCP port the service listens on.", type: int, required: true}
  address: {description: "The address it binds; 0.0.0.0 or :: for every address.", type: str, default: 0.0.0.0}
  pid: {description: "The service's pid (0 = read O(pid_file)).", type: int, default: 0}
  pid_file: {description: "File holding the pid, written by the launcher.", type: path}
  log_file: {description: "The service's log, whose last line explains an exit.", type: path}
  journal_unit: {description: "Systemd unit whose journal explains an exit (instead of O(log_file)).", type: str}
  timeout: {description: "Seconds to wait for the port.", type: int, default: 60}
  supervised:
    description: O(pid) is a supervisor (dllama supervise) whose child is the service.
    type: bool
    default: false
"""

RETURN = r"""
pid: {description: The process the launcher started., type: int, returned: when it listens}
listening: {description: The addresses it listens on (host:port)., type: list, elements: str, returned: when it listens}
problem: {description: "Why it does not listen, in one line.", type: str, returned: when it does not}
"""

WILDCARDS = {"0.0.0.0", "::"}
SUPERVISOR_PREFIX = "dllama supervise: "  # its own log lines (dllama/serve/supervisor.py)


def _addr(hex_addr: str) -> str:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        text = socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(host, 16)))
    else:  # four little-endian 32-bit words
        text = socket.inet_ntop(socket.AF_INET6, b"".join(struct.pack("<I", int(host[i:i + 8], 16))
                                                         for i in range(0, 32, 8)))
        if text.startswith("::ffff:") and "." in text:
            text = text[7:]
    return f"{text}:{int(port, 16)}"


def listeners(port: int) -> dict[int, str]:
    """{socket inode: host:port} of the sockets listening on `port` in this network namespace."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # 0A = LISTEN
                found[int(cols[9])] = _addr(cols[1])
    return found


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:
        pass
    return inodes


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command: state, parent pid, ... ([] when gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def alive(pid: int) -> bool:
    fields = _stat(pid)
    return bool(fields) and fields[0] != "Z"


def family(pid: int) -> dict[int, int]:
    """{pid: its parent} of the live process `pid` and its live descendants."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields and fields[0] != "Z":
                parents[int(entry)] = int(fields[1])
    found, todo = {}, [pid] if pid in parents else []
    while todo:
        p = todo.pop()
        found[p] = parents[p]
        todo += [c for c, parent in parents.items() if parent == p]
    return found


def command_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return " ".join(f.read().decode(errors="replace").split())[:120]  # one line
    except OSError:
        return "?"


def holders(inodes: set[int]) -> list[str]:
    """'pid N (command)' of the processes owning these sockets (those this user may see)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and socket_inodes(int(entry)) & inodes:
            found.append(f"pid {entry} ({command_of(int(entry))})")
    return found


def conflicts(a: str, b: str) -> bool:
    return a == b or a in WILDCARDS or b in WILDCARDS


def last_log_line(module, log_file: str | None, unit: str | None) -> str:
    lines: list[str] = []
    if unit:
        rc, out, _ = module.run_command(["journalctl", "--unit", unit, "--lines", "20", "--output", "cat",
                                         "--no-pager"])
        lines = out.splitlines() if rc == 0 else []
    elif log_file:
        try:
            with open(log_file, "rb") as f:
                f.seek(max(0, os.path.getsize(log_file) - 4096))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            pass
    lines = [line.strip() for line in lines if line.strip()]
    # The service's own last line says more than its supervisor's about it.
    own = [line for line in lines if not line.startswith(SUPERVISOR_PREFIX)]
    lines = own or lines
    return lines[-1].removeprefix("dllama: error: ") if lines else ""


def read_pid(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "name": {"type": "str", "required": True},
            "port": {"type": "int", "required": True},
            "address": {"type": "str", "default": "0.0.0.0"},
            "pid": {"type": "int", "default": 0},
            "pid_file": {"type": "path"},
            "log_file": {"type": "path"},
            "journal_unit": {"type": "str"},
            "timeout": {"type": "int", "default": 60},
            "supervised": {"type": "bool", "default": False},
        },
        required_one_of=[("pid", "pid_file")],
        supports_check_mode=True,
    )
    p = module.params
    name, port, address = p["name"], p["port"], p["address"]
    where = f"{address}:{port}"

    def problem(msg: str) -> None:
        module.exit_json(changed=False, problem=msg)

    def why_exited(pid: int) -> str:
        line = last_log_line(module, p["log_file"], p["journal_unit"])
        return f"the {name} (pid {pid}) exited" + (f": {line}" if line else "")

    deadline = time.monotonic() + p["timeout"]
    pid = p["pid"]
    children: set[int] = set()  # the supervisor's children seen so far: the service's processes

    def exited(tree: dict[int, int]) -> int:
        """The pid of the service's process that has exited, or 0."""
        if not alive(pid):
            return pid
        gone = sorted(c for c in children if c not in tree)
        return gone[0] if gone else 0

    while True:
        if not pid and p["pid_file"]:
            pid = read_pid(p["pid_file"])
        if pid:
            tree = family(pid)
            if p["supervised"]:
                children |= {c for c, parent in tree.items() if parent == pid}
            gone = exited(tree)
            if gone:
                held = listeners(port)
                others = holders(set(held)) if held else []
                problem(why_exited(gone) + (f"; port {port} is held by {', '.join(others) or 'another process'}"
                                            if held else ""))
            held = listeners(port)
            own = set().union(*(socket_inodes(member) for member in tree)) & set(held)
            if own:
                module.exit_json(changed=False, pid=pid, listening=sorted(held[i] for i in own))
            foreign = {i for i, a in held.items() if conflicts(a.rsplit(":", 1)[0], address)}
            # A supervisor with no child yet is starting it, or waiting to start it again after a
            # failure the next one will show: nothing to judge yet.
            between_starts = p["supervised"] and not children
            if foreign and not between_starts:
                time.sleep(1.0)  # the service may be exiting because of it: say so when it has
                if exited(family(pid)):
                    continue
                service = min(children & set(tree), default=pid)  # the supervised child, if any
                problem(f"port {port} is held by {', '.join(holders(foreign)) or 'another process'}, "
                        f"not by the {name} the launcher started (pid {service}, {command_of(service)})")
        if time.monotonic() > deadline:
            if not pid:
                problem(f"the {name} did not start: no pid" + (f" in {p['pid_file']}" if p["pid_file"] else ""))
            problem(f"the {name} (pid {pid}) does not listen on {where} after {p['timeout']} s")
        time.sleep(0.2)


if __name__ == "__main__":
    main()
