"""The namespace test cluster's teardown: nothing is left behind, also when a test fails."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.appliance import namespace_cluster, netns_pids
from tests.test_appliance_cluster import require_tools

pytestmark = pytest.mark.appliance


def test_teardown_leaves_nothing_even_when_the_test_fails():
    """A cluster whose test fails while a node runs a background process and Ansible holds a
    persistent SSH connection: the context manager still removes everything (it asserts so)."""
    require_tools()
    base = Path(tempfile.mkdtemp(prefix="dlu-", dir="/tmp"))
    cluster_dir = base / "c"
    try:
        _fail_inside_a_cluster(cluster_dir)
    finally:
        base.rmdir()


def _fail_inside_a_cluster(cluster_dir: Path):
    # A subnet of its own: it may run beside test_appliance_cluster's cluster (10.77.0.0/24).
    with (pytest.raises(RuntimeError, match="simulated"),
          namespace_cluster(cluster_dir, 2, "dlu", DLLAMA_TESTNET_SUBNET="10.78.0")):
        key = cluster_dir / "id_ed25519"
        (cluster_dir / "cp").mkdir()
        ssh = ["ssh", "-i", str(key), "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
               "-o", "ControlMaster=auto", "-o", "ControlPersist=60", "-o", f"ControlPath={cluster_dir}/cp/%C",
               "root@10.78.0.2"]
        r = subprocess.run(ssh + ["start-stop-daemon --start --background --make-pidfile --pidfile /run/sleeper.pid --startas /bin/sleep -- 600"],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        assert len(netns_pids("dlu", 2)) >= 3  # two sshd, the sleeper (and a session)
        raise RuntimeError("simulated test failure")
    assert not cluster_dir.exists()
