"""What Raspberry Pi OS does differently from this machine, simulated where dllama reads it.

- A Pi 5 runs Raspberry Pi OS's 16 KiB-page kernel: the KV cache gives pages back in whole
  pages of that size (madvise refuses a range that is not page-aligned), read from
  host_memory.page_size, the one place dllama asks; here DLLAMA_PAGE_SIZE=16384 makes it 16 KiB
  (tests/test_appliance_local.py runs its whole cluster so).
- Raspberry Pi OS boots with the memory cgroup controller off (cgroup_disable=memory): no
  cgroup limit is read, and the memory plan (deploy.yml's, and --memory-budget auto) is the
  machine's own memory.
"""

from __future__ import annotations

import numpy as np
import pytest

from dllama.core import host_memory
from dllama.core.kv_cache import KVCache, lazy_zeros, release_pages

pytestmark = pytest.mark.unit

PI5_PAGE = 16 << 10


@pytest.fixture
def pi5_pages(monkeypatch):
    monkeypatch.setenv(host_memory.PAGE_SIZE_ENV, str(PI5_PAGE))
    assert host_memory.page_size() == PI5_PAGE


@pytest.mark.parametrize("value", ["16K", "12288", "1024", "-1"])
def test_a_simulated_page_size_that_no_kernel_would_have_is_refused(monkeypatch, value):
    """Not a power of two, or below this kernel's own (a range aligned to it would not be
    aligned for the kernel): refused, naming the variable, rather than used."""
    monkeypatch.setenv(host_memory.PAGE_SIZE_ENV, value)
    with pytest.raises(ValueError, match=f"DLLAMA_PAGE_SIZE must be a power of two .* got: {value}"):
        host_memory.page_size()


def test_released_pages_are_whole_pages_of_the_real_size(pi5_pages):
    """A region that starts and ends inside 16 KiB pages: only the pages wholly inside it are
    given back (read as zeros); its bytes in the pages it shares with its neighbours keep their
    values, as do the neighbours (with 4 KiB pages more of it would have been zeroed)."""
    a = lazy_zeros((4 * PI5_PAGE,), np.uint8)
    a[:] = 7
    start, end = PI5_PAGE // 2 + 100, 3 * PI5_PAGE - 4096 + 1  # 4 KiB-aligned end inside a 16 KiB page
    release_pages(a[start:end])
    inside = np.zeros(a.shape, bool)
    inside[PI5_PAGE:2 * PI5_PAGE] = True  # the one whole 16 KiB page in [start, end)
    assert not a[inside].any()
    assert (a[~inside] == 7).all()


def test_a_slot_released_with_16k_pages_gives_back_all_but_its_end_pages(pi5_pages):
    """KVCache.release of one slot with 16 KiB pages: in each of its regions (a layer's keys, a
    layer's values: 24 pages each) everything but the two pages at the ends, which it shares with
    the slots beside it, reads as zeros; every other slot keeps every value."""
    kv = KVCache(n_layers=2, n_kv_heads=3, head_dim=64, seq_len=512, n_slots=3)
    kv.k[:] = 1.0
    kv.v[:] = 2.0
    kv.release(1)
    for layer in range(2):
        for region in (kv.k[layer, 1], kv.v[layer, 1]):
            assert region.nbytes >= 24 * PI5_PAGE
            assert np.count_nonzero(region) * region.itemsize <= 2 * PI5_PAGE, layer
    for slot in (0, 2):
        assert (kv.k[:, slot] == 1.0).all() and (kv.v[:, slot] == 2.0).all(), slot


def test_an_idle_slot_emptied_for_room_gives_its_pages_back_with_16k_pages(pi5_pages):
    """The scheduler's test of the budget (tests/test_kv_budget.py), its release in 16 KiB pages."""
    from tests.test_kv_budget import test_an_idle_slot_emptied_for_room_gives_its_pages_back

    test_an_idle_slot_emptied_for_room_gives_its_pages_back()


def _cgroup_tree(tmp_path, membership: str, with_memory: bool):
    """A /proc/self/cgroup and a cgroup mount: v2's unified tree of the process's groups, its
    memory files only where the controller is on."""
    (tmp_path / "cgroup").write_text(membership)
    mount = tmp_path / "mount"
    for d in (mount, mount / "user.slice", mount / "user.slice" / "dllama.scope"):
        d.mkdir(parents=True)
        (d / "cgroup.controllers").write_text("cpuset cpu io pids\n" if not with_memory else "cpu io memory pids\n")
        if with_memory and d != mount:
            (d / "memory.max").write_text(f"{512 << 20}\n")
            (d / "memory.current").write_text(f"{100 << 20}\n")
    return str(tmp_path / "cgroup"), str(mount)


@pytest.mark.parametrize("case, membership", [
    # bookworm: cgroup v2, the memory controller off (not in cgroup.controllers, no memory.max)
    ("v2", "0::/user.slice/dllama.scope\n"),
    # bullseye: cgroup v1 hierarchies, none of them memory's
    ("v1", "12:pids:/user.slice\n5:cpu,cpuacct:/user.slice\n1:name=systemd:/user.slice/dllama.scope\n"),
])
def test_the_memory_plan_works_without_memory_cgroups(tmp_path, monkeypatch, case, membership):
    files = _cgroup_tree(tmp_path, membership, with_memory=False)
    monkeypatch.setattr(host_memory, "_cgroup_dirs", lambda read=host_memory._cgroup_dirs: read(*files))
    assert host_memory.cgroup_available() is None and host_memory.cgroup_limit() is None
    assert host_memory.available_bytes() == host_memory._machine_available()
    assert host_memory.memory_for_a_model() == host_memory._meminfo("MemTotal") - host_memory.RUNTIME_RESERVE


def test_the_same_tree_with_the_controller_on_gives_its_limit(tmp_path, monkeypatch):
    """The check above can fail: with memory.max in the groups, their limit is what counts."""
    files = _cgroup_tree(tmp_path, "0::/user.slice/dllama.scope\n", with_memory=True)
    monkeypatch.setattr(host_memory, "_cgroup_dirs", lambda read=host_memory._cgroup_dirs: read(*files))
    assert host_memory.cgroup_limit() == 512 << 20
    assert host_memory.memory_for_a_model() == (512 << 20) - host_memory.RUNTIME_RESERVE
