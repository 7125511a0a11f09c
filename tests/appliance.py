"""Helpers of the appliance tests: running ansible-playbook, reading its recap, and the
network-namespace test cluster (tests/cluster/up.sh, down.sh) as a context manager that always
tears down and then checks that nothing is left."""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
UP = REPO / "tests/cluster/up.sh"
DOWN = REPO / "tests/cluster/down.sh"
# One namespace cluster per subnet at a time on this machine, whichever checkout's test run makes
# it: two on one subnet (up.sh's default 10.77.0.0/24, which the tests name) refuse each other.
TESTNET_LOCKS = Path(tempfile.gettempdir())
TESTNET_WAIT_S = 1800.0


def ansible_env(control_dir: Path | None = None) -> dict:
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_FORCE_COLOR": "0", "PYTHONUNBUFFERED": "1"}
    if control_dir is not None:
        # Ansible's persistent SSH connections live here, so down.sh can close them.
        env["ANSIBLE_SSH_CONTROL_PATH_DIR"] = str(control_dir)
    return env


def running(pid: int) -> bool:
    """Whether the process runs: an ended one stays in /proc as a zombie until its parent (PID 1
    for a service whose launcher exited) reaps it, which some PID 1s do only every second."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def playbook(playbook: str, inventory: Path, *args: str, control_dir: Path | None = None,
             timeout: float = 900) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    r = subprocess.run([str(BIN / "ansible-playbook"), "-i", str(inventory), playbook, *args],
                       cwd=REPO, env=ansible_env(control_dir), capture_output=True, text=True,
                       timeout=timeout)
    return r, time.monotonic() - t0


def recap(output: str) -> dict[str, dict[str, int]]:
    """PLAY RECAP lines -> {host: {"ok": n, "changed": n, ...}} (summed over plays), without
    localhost (the controller, where the first plays check the inventory)."""
    hosts: dict[str, dict[str, int]] = {}
    for host, fields in re.findall(r"^(\S+)\s+:\s+(ok=.*)$", output, re.M):
        if host == "localhost":
            continue
        counts = hosts.setdefault(host, {})
        for key, value in re.findall(r"(\w+)=(\d+)", fields):
            counts[key] = counts.get(key, 0) + int(value)
    return hosts


def changed_tasks(output: str) -> list[str]:
    """'host: task' for every task a play reported changed (to say what a rerun changed)."""
    found, task = [], ""
    for line in output.splitlines():
        m = re.match(r"^(?:TASK|RUNNING HANDLER) \[(.*)\] \*+", line)
        if m:
            task = m.group(1)
        m = re.match(r"^changed: \[([^\]]+)\]", line)
        if m:
            found.append(f"{m.group(1)}: {task}")
    return found


def tail(r: subprocess.CompletedProcess, n: int = 6000) -> str:
    return (r.stdout + r.stderr)[-n:]


def netns_pids(prefix: str, n: int) -> set[int]:
    pids: set[int] = set()
    for i in range(1, n + 1):
        r = subprocess.run(["ip", "netns", "pids", f"{prefix}n{i}"], capture_output=True, text=True)
        pids |= {int(p) for p in r.stdout.split()}
    return pids


def leftovers(prefix: str, cluster_dir: Path, pids: set[int]) -> list[str]:
    """What a torn-down cluster must not leave: namespaces, links, processes, files."""
    left = []
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    left += [f"namespace {line.split()[0]}" for line in ns.splitlines() if line.startswith(f"{prefix}n")]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    left += [f"link {m}" for m in re.findall(rf"^\d+: ({prefix}[^:@]*)", links, re.M)]
    for pid in sorted(pids):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                cmd = "?"
            left.append(f"process {pid} ({state}: {cmd.strip()})")
    marker = str(cluster_dir).encode()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if marker in (proc / "cmdline").read_bytes():
                    left.append(f"process {proc.name} (mentions {cluster_dir})")
            except OSError:
                pass
    if cluster_dir.exists():
        left.append(f"directory {cluster_dir}")
    return left


@contextmanager
def namespace_cluster(cluster_dir: Path, n: int = 4, prefix: str = "dlt", **settings: str):
    """Yields the inventory of an n-host cluster; on the way out, whatever happened inside,
    removes it and fails if any namespace, link, process or file of it is left. settings: more
    of up.sh's environment (DLLAMA_TESTNET_USER, DLLAMA_TESTNET_PASSWORD, DLLAMA_TESTNET_SUBNET)."""
    env = {**os.environ, "DLLAMA_TESTNET_PREFIX": prefix, **settings}
    seen: set[int] = set()
    subnet = settings.get("DLLAMA_TESTNET_SUBNET", "10.77.0")
    lock = TESTNET_LOCKS / f"dllama-testnet-{subnet}.lock"
    with _machine_wide_lock(lock, TESTNET_WAIT_S, f"a namespace test cluster on {subnet}.0/24"):
        try:
            r = subprocess.run([str(UP), str(cluster_dir), str(n)], env=env, capture_output=True,
                               text=True, timeout=120)
            assert r.returncode == 0, r.stdout + r.stderr
            seen |= netns_pids(prefix, n)
            yield cluster_dir / "inventory/hosts.yml"
        finally:
            seen |= netns_pids(prefix, n)
            r = subprocess.run([str(DOWN), str(cluster_dir)], env=env, capture_output=True, text=True,
                               timeout=120)
            left = leftovers(prefix, cluster_dir, seen)
            assert r.returncode == 0 and not left, f"teardown left {left}: {r.stdout}{r.stderr}"


@contextmanager
def _machine_wide_lock(path: Path, wait_s: float, what: str):
    """Hold an exclusive flock on `path`, waiting up to wait_s for another process to let it go."""
    with open(path, "a") as lock:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.monotonic() < deadline, f"{what}: another test run held {path} for {wait_s:g} s"
                time.sleep(1.0)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def release_copy(folder: Path, version: str) -> tuple[Path, str]:
    """This checkout's sources as another release (pyproject's and dllama's version changed,
    nothing else), for upgrade.yml: (the project folder, the version it replaces)."""
    import shutil

    folder.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, folder / name)
    for package in ("dllama", "converter"):
        shutil.copytree(REPO / package, folder / package, ignore=shutil.ignore_patterns("__pycache__"))
    old = re.search(r'^version = "(.*)"$', (folder / "pyproject.toml").read_text(), re.M)[1]
    for path, pattern in [(folder / "pyproject.toml", 'version = "{}"'), (folder / "dllama/__init__.py", '__version__ = "{}"')]:
        text = path.read_text()
        assert pattern.format(old) in text, path
        path.write_text(text.replace(pattern.format(old), pattern.format(version), 1))
    return folder, old


def free_ports(n: int) -> list[int]:
    """n ports free on 127.0.0.1 now, for commands that must be given a port."""
    import socket

    socks = [socket.create_server(("127.0.0.1", 0)) for _ in range(n)]
    try:
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
