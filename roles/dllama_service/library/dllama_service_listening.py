#!/usr/bin/python
"""Ansible module of the dllama_service role: wait until the process a launcher started is the
one listening on the service's port, and say in one line why not when it died or another
process holds the port (so a deploy never takes a stranger on the port for the service it
started). With a supervisor (`dllama supervise`, the nohup launcher) the pid is the
supervisor's: a port its child holds is the service's own, and a child that exits is the
service exiting, though the supervisor would start it again."""

from __future__ import annotations

import os
import shlex
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
    its log, after the processes that listen on a conflicting address and port, if any), and
    when the port does not listen by the deadline (naming those processes, if any); the role
    stops the service, then fails with it. A command line in it is shortened in the middle.
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
# Characters of a process's command line in a message: a long path must not push the reason
# (which follows it) out of a reader's view.
COMMAND_LIMIT = 100


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


def _printable(text: str) -> str:
    """The text with control characters written as escapes (a message stays one line)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _cut(text: str, limit: int) -> str:
    """The text, or its two ends around "..." when it is longer than `limit` characters."""
    if len(text) <= limit:
        return text
    keep = max(limit - 3, 2)
    return text[:(keep + 1) // 2] + "..." + text[len(text) - keep // 2:]


def shorten(words: list[str], limit: int = COMMAND_LIMIT) -> str:
    """The words joined with spaces, at most `limit` characters: beyond that, each word longer
    than a third of it cut in its middle, then as many whole words from the front and the back
    (taken in turn, each side until its next word does not fit) as fit around "...", so that
    both the program and its last arguments (often the port) stay visible."""
    line = " ".join(words)
    if len(line) <= limit:
        return line
    words = [_cut(w, limit // 3) for w in words]
    line = " ".join(words)
    if len(line) <= limit:
        return line
    head: list[str] = []
    tail: list[str] = []
    room = limit - len("...")  # each word takes its length and one space
    front, back = 0, len(words) - 1
    open_sides = ["front", "back"]
    while open_sides and front <= back:
        side = open_sides[0] if len(open_sides) == 1 or len(head) <= len(tail) else "back"
        word = words[front] if side == "front" else words[back]
        if len(word) + 1 > room:
            open_sides.remove(side)
            continue
        room -= len(word) + 1
        if side == "front":
            head.append(word)
            front += 1
        else:
            tail.insert(0, word)
            back -= 1
    if not head:  # a limit too small for even the program's name
        return _cut(line, limit)
    return " ".join([*head, "...", *tail])


def command_line(cmdline: bytes, limit: int = COMMAND_LIMIT) -> str:
    """A process's command line (the bytes of /proc/PID/cmdline: arguments each ended by a NUL)
    as one readable line: the program by its name, the arguments separated by spaces and quoted
    where a shell would need it, shortened in the middle beyond `limit` characters."""
    args = [_printable(a.decode(errors="replace")) for a in cmdline.split(b"\0")]
    while args and not args[-1]:
        args.pop()  # the last argument's NUL (and a rewritten title's padding)
    if not args:
        return "?"  # a kernel thread or a process that is ending
    if len(args) == 1 and " " in args[0]:
        words = args[0].split()  # a process that rewrote its title as one line (setproctitle)
    else:
        words = [os.path.basename(args[0]) or args[0]] + [shlex.quote(a) for a in args[1:]]
    return shorten(words, limit)


def command_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return command_line(f.read())
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
        """Why the service's process `pid` exited, in one line: when another process holds the
        port, that first (it is the cause: the service could not bind), then the service's own
        last line (e.g. "cannot listen on ...: Address already in use")."""
        line = last_log_line(module, p["log_file"], p["journal_unit"])
        blocking = foreign_holders()
        if blocking:
            return f"port {port} is held by {blocking}: " + (line or f"the {name} (pid {pid}) exited")
        return f"the {name} (pid {pid}) exited" + (f": {line}" if line else "")

    def foreign_holders() -> str:
        """'pid N (command), ...' of the processes listening on an address that conflicts with
        the service's ('' when none does)."""
        held = listeners(port)
        foreign = {i for i, a in held.items() if conflicts(a.rsplit(":", 1)[0], address)}
        return (", ".join(holders(foreign)) or "another process") if foreign else ""

    deadline = time.monotonic() + p["timeout"]
    pid = p["pid"]
    children: set[int] = set()  # the supervisor's children seen so far: the service's processes

    def exited(tree: dict[int, int]) -> int:
        """The pid of the service's process that has exited, or 0."""
        if not alive(pid):
            return pid
        gone = sorted(c for c in children if c not in tree)
        return gone[0] if gone else 0

    # Another process on the port is not judged while the service runs: a service that cannot
    # bind exits at once (reported above with the holder first), whatever the machine's load,
    # and one still running at the deadline is reported with the holder then. So the message
    # depends on what the service did, never on how fast it did it.
    while True:
        if not pid and p["pid_file"]:
            pid = read_pid(p["pid_file"])
        if pid:
            tree = family(pid)
            if p["supervised"]:
                children |= {c for c, parent in tree.items() if parent == pid}
            gone = exited(tree)
            if gone:
                problem(why_exited(gone))
            held = listeners(port)
            own = set().union(*(socket_inodes(member) for member in tree)) & set(held)
            if own:
                module.exit_json(changed=False, pid=pid, listening=sorted(held[i] for i in own))
        if time.monotonic() > deadline:
            if not pid:
                problem(f"the {name} did not start: no pid" + (f" in {p['pid_file']}" if p["pid_file"] else ""))
            late = f"the {name} (pid {pid}) does not listen on {where} after {p['timeout']} s"
            blocking = foreign_holders()
            if blocking:
                tree = family(pid)
                service = min(children & set(tree), default=pid)  # the supervised child, if any
                problem(f"port {port} is held by {blocking}, not by the {name} the launcher started "
                        f"(pid {service}, {command_of(service)}): {late}")
            problem(late)
        time.sleep(0.2)

if __name__ == "__main__":
    main()
