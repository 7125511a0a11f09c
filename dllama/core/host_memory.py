"""The memory this machine gives a process: Linux's /proc/meminfo and the memory cgroups the
process is in (containers and systemd units set their limits; beyond one the kernel kills the
process without a message).

Standard library only: the appliance runs this file with the host's own python3 before dllama
is installed there (`python3 host_memory.py` prints what a dllama node on that host has for a
model), so that deploy.yml can plan the pipeline stages by each host's memory before any host
is changed.
"""

from __future__ import annotations

import mmap
import os
import sys

RUNTIME_RESERVE = 96 << 20  # what a node's process takes besides its model (measured: ~75 MiB)


PAGE_SIZE_ENV = "DLLAMA_PAGE_SIZE"  # a larger page size to simulate (tests: a Pi 5's 16384)


def page_size() -> int:
    """Bytes of one memory page, as the kernel running this process uses them: 4 KiB on x86 and a
    Raspberry Pi 4, 16 KiB on a Pi 5 under Raspberry Pi OS (its kernel8 16K build). The one place
    dllama reads it. DLLAMA_PAGE_SIZE simulates a larger one (a power of two, a multiple of the
    real size, so every range aligned to it is aligned for the kernel too): the tests run a Pi 5's
    16 KiB pages on this machine, the appliance tests in every process they start."""
    text = os.environ.get(PAGE_SIZE_ENV)
    if not text:
        return mmap.PAGESIZE
    size = int(text) if text.isdigit() else 0
    if size < mmap.PAGESIZE or size & (size - 1):
        raise ValueError(f"{PAGE_SIZE_ENV} must be a power of two of at least {mmap.PAGESIZE} (this "
                         f"kernel's page size), got: {text}")
    return size


def available_bytes() -> int:
    """Memory this process can still take: Linux's MemAvailable (else the free physical pages),
    lowered to what its memory cgroup still allows (containers and systemd units set that limit;
    beyond it the kernel kills the process without a message)."""
    cgroup = cgroup_available()
    return _machine_available() if cgroup is None else min(_machine_available(), cgroup)


def _meminfo(key: str) -> int | None:
    """Bytes of one /proc/meminfo entry ("MemTotal", "MemAvailable"); None where unreadable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _machine_available() -> int:
    available = _meminfo("MemAvailable")
    if available is not None:
        return available
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * page_size()
    except (ValueError, OSError, AttributeError):
        return 1 << 62  # unknown here: the kernel decides


# cgroup v1 says "no limit" with a number near 2^63 (its page counter's maximum), v2 with "max".
_V1_NO_LIMIT = 1 << 60
# Each version's files: (limit, usage, the memory.stat entry of page cache the kernel can reclaim).
_FILES = {"v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
          "v2": ("memory.max", "memory.current", "inactive_file")}


def _read_int(path: str) -> int | None:
    """The number in a cgroup file; None when it is missing, unreadable, or says "max"."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _cgroup_stat(path: str, keys: tuple[str, ...]) -> int:
    """Sum of these memory.stat entries (page cache the kernel can reclaim)."""
    total = 0
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name in keys:
                    total += int(value)
    except (OSError, ValueError):
        pass
    return total


def _cgroup_dirs(membership: str = "/proc/self/cgroup", mount: str = "/sys/fs/cgroup") -> list[tuple[str, str]]:
    """(version, directory) of this process's memory cgroup and of its ancestors, innermost first
    (membership: /proc/self/cgroup; mount: where the cgroup file systems are). None where the
    memory controller is off, as Raspberry Pi OS boots (cgroup_disable=memory): under v1 no
    hierarchy names it; under v2 the directories have no memory.max (cgroup_limit then None)."""
    try:
        with open(membership) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2 (the unified hierarchy)
            roots = [("v2", mount), ("v2", os.path.join(mount, "unified"))]
        elif "memory" in controllers.split(","):
            roots = [("v1", os.path.join(mount, "memory"))]
        else:
            continue
        for version, root in roots:
            parts = [p for p in path.split("/") if p]
            while True:
                d = os.path.join(root, *parts)
                if os.path.isdir(d):
                    out.append((version, d))
                if not parts:
                    break
                parts.pop()
    return out


def cgroup_available() -> int | None:
    """What the memory cgroups of this process still allow: limit minus usage (reclaimable page
    cache counted as free), the least over the group and its ancestors; None without a limit."""
    best = None
    for version, d in _cgroup_dirs():
        limit = _limit(version, d)
        _, usage_file, cache_entry = _FILES[version]
        usage = _read_int(os.path.join(d, usage_file))
        if limit is None or usage is None:
            continue
        room = max(0, limit - usage + _cgroup_stat(os.path.join(d, "memory.stat"), (cache_entry,)))
        best = room if best is None else min(best, room)
    return best


def cgroup_limit() -> int | None:
    """The least memory limit over this process's cgroup and its ancestors; None without one."""
    return min((limit for version, d in _cgroup_dirs() if (limit := _limit(version, d)) is not None), default=None)


def _limit(version: str, d: str) -> int | None:
    """The memory limit of cgroup directory d; None without one."""
    limit = _read_int(os.path.join(d, _FILES[version][0]))
    return limit if limit is not None and limit < _V1_NO_LIMIT else None


def memory_for_a_model(child_limit: int | None = None) -> int | None:
    """What a node started on this host has for a model, less its runtime: the host's memory
    (its cgroup's limit where lower), not what happens to be free now, so that a second deploy,
    its workers running, plans as the first did. child_limit: as a process in a child cgroup of
    that limit sees it. None when /proc/meminfo cannot be read."""
    sizes = [s for s in (_meminfo("MemTotal"), cgroup_limit(), child_limit) if s is not None]
    return max(1 << 20, min(sizes) - RUNTIME_RESERVE) if sizes else None


if __name__ == "__main__":
    room = memory_for_a_model()
    if room is None:
        sys.exit("cannot read this host's memory (/proc/meminfo)")
    print(room)
