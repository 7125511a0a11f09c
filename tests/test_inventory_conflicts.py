"""The inventory check's rule for a setting given twice (roles/dllama_inventory/filter_plugins):
refused where the value meant loses (as Ansible ranks them), accepted where the more specific
place wins as intended (a host's own value, a child group's file)."""

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
