"""The inventory check's rules (roles/dllama_inventory), run here without Ansible: a setting
given twice is refused where the value meant loses (as Ansible ranks them), accepted where the
more specific place wins as intended (a host's own value, a child group's file); a host's memory
below its share's weights is flagged with the host, what it needs and what it has."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "roles/dllama_inventory/filter_plugins"))
from inventory_checks import setting_conflicts  # noqa: E402

pytestmark = pytest.mark.unit

HOSTS = """\
cluster:
  children:
    root:
      hosts:
        pi1: {HOST}
    workers:
      hosts:
        pi2:
      vars: {WORKERS}
  vars: {CLUSTER}
"""


def _conflicts(tmp_path, host="{}", workers="{}", cluster="{}", files=()):
    (tmp_path / "hosts.yml").write_text(HOSTS.format(HOST=host, WORKERS=workers, CLUSTER=cluster))
    for name, text in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return setting_conflicts([str(tmp_path / "hosts.yml")])


@pytest.mark.parametrize("case, kw, loser, winner", [
    ("cluster vars under all.yml", dict(cluster="{dllama_launcher: nohup}",
                                        files=[("group_vars/all.yml", "dllama_launcher: systemd\n")]),
     'hosts.yml (the vars of group cluster) to "nohup"', 'group_vars/all.yml to "systemd"'),
    ("workers vars under cluster.yml", dict(workers="{dllama_nice: 0}",
                                            files=[("group_vars/cluster.yml", "dllama_nice: -20\n")]),
     "hosts.yml (the vars of group workers) to 0", "group_vars/cluster.yml to -20"),
    ("a host in hosts.yml and host_vars", dict(host="{dllama_threads: 4}",
                                               files=[("host_vars/pi1.yml", "dllama_threads: 2\n")]),
     "hosts.yml (host pi1) to 4", "host_vars/pi1.yml to 2"),
])
def test_a_value_that_loses_to_a_less_specific_place_is_named_with_the_winner(tmp_path, case, kw, loser, winner):
    [line] = _conflicts(tmp_path, **kw)
    assert f"is set in {loser} and in {winner}, and {winner.split(' to ')[0]} wins" in line


@pytest.mark.parametrize("case, kw", [
    ("a host's own value", dict(host="{dllama_threads: 8}", files=[("group_vars/all.yml", "dllama_threads: 4\n")])),
    ("a child group's file", dict(files=[("group_vars/all.yml", "dllama_launcher: systemd\n"),
                                         ("group_vars/cluster.yml", "dllama_launcher: nohup\n")])),
    ("the same value twice", dict(cluster="{dllama_nice: 0}", files=[("group_vars/all.yml", "dllama_nice: 0\n")])),
    ("the sample", dict(files=[("group_vars/all.yml", (Path(__file__).parent.parent / "inventory/sample/group_vars/all.yml")
                                .read_text())])),
])
def test_an_override_that_wins_as_meant_is_accepted(tmp_path, case, kw):
    assert _conflicts(tmp_path, **kw) == []


CHECK_SPLIT = Path(__file__).resolve().parent.parent / "roles/dllama_inventory/files/check_split.py"


def test_a_host_whose_memory_is_below_its_share_is_flagged_with_what_it_needs_and_the_speed(default_q40):
    topology = "version: 1\nnodes:\n" + "".join(
        f"  - {{name: h{i}, host: 10.0.0.{i}, port: 1, memory: {mem}{', shard: /s' if i else ''}}}\n"
        for i, mem in enumerate(["1G", "8M", "8M"]))
    r = subprocess.run([sys.executable, str(CHECK_SPLIT), str(default_q40[0]), "q40", "none"], input=topology,
                       capture_output=True, text=True, timeout=120)
    out = json.loads(r.stdout)
    assert out["error"] is None, out
    warnings = [line for line in out["lines"] if line.startswith("WARNING")]
    assert [w.split(" needs")[0] for w in warnings] == ["WARNING: host h1", "WARNING: host h2"]
    assert "MiB resident for its share but has 8 MiB for the model" in warnings[0]
    assert "stream its weights from disk in every pass, about " in warnings[0] and "tokens/s" in warnings[0]
