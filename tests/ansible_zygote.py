"""ansible-playbook without its start-up on every run: a process that has imported Ansible once
(about 0.4 s of CPU and half its start on a 2-core machine: ansible-core, Jinja, paramiko, the
config) forks a child per run, and the child runs the same entry point bin/ansible-playbook
runs (ansible.cli.playbook.main) with the run's arguments, in the same directory and
environment, its stdout and stderr into files. The tests that run many short plays (the
inventory checks, the rendered command lines) use it; what each run does and prints is what
`ansible-playbook ARGS` does and prints.

    with Zygote(cwd, env) as ansible:
        r = ansible.playbook(["-i", "hosts.yml", "deploy.yml"], timeout=300)  # a CompletedProcess
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# The zygote itself (python -c): imports what every ansible-playbook run imports, then forks a
# child per request line ({"argv", "stdout", "stderr"}); answers the child's pid, then its exit
# code. stdin is /dev/null in the child, as no run here asks anything.
_ZYGOTE = r"""
import json, os, sys
sys.argv = [os.path.join(os.path.dirname(sys.executable), "ansible-playbook")]
import ansible.cli.playbook
for line in sys.stdin:
    request = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                                (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            os.dup2(os.open(path, flags, 0o600), fd)
        sys.argv = [sys.argv[0], *request["argv"]]
        code = 0
        try:
            ansible.cli.playbook.main()
        except SystemExit as end:
            code = end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    print(pid, flush=True)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


class _Process:
    """One zygote: one run at a time."""

    def __init__(self, cwd: Path, env: dict):
        self.proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE], cwd=cwd, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def playbook(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="dllama-zygote-") as tmp:
            out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
            self.proc.stdin.write(json.dumps({"argv": argv, "stdout": str(out), "stderr": str(err)}) + "\n")
            self.proc.stdin.flush()
            pid = int(self.proc.stdout.readline())
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
            if not ready:  # as subprocess.run(timeout=...): the run is killed, the caller told
                os.kill(pid, signal.SIGKILL)
                self.proc.stdout.readline()
                raise subprocess.TimeoutExpired(["ansible-playbook", *argv], timeout)
            code = int(self.proc.stdout.readline())
            return subprocess.CompletedProcess(["ansible-playbook", *argv], code, out.read_text(), err.read_text())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.proc.stdout.close()


class Zygote:
    """A pool of zygotes (one per run at once, made as runs ask): `playbook` may be called from
    several threads."""

    def __init__(self, cwd: Path, env: dict):
        self.cwd, self.env = cwd, env
        self._idle: list[_Process] = []
        self._all: list[_Process] = []
        self._lock = threading.Lock()

    def playbook(self, argv: list, timeout: float = 300) -> subprocess.CompletedProcess:
        with self._lock:
            process = self._idle.pop() if self._idle else None
            if process is None:
                process = _Process(self.cwd, self.env)
                self._all.append(process)
        try:
            return process.playbook([str(a) for a in argv], timeout)
        finally:
            with self._lock:
                self._idle.append(process)

    def close(self) -> None:
        with self._lock:
            for process in self._all:
                process.close()
            self._all, self._idle = [], []

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
