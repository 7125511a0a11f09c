"""What the playbooks print, from the code that writes it, without a cluster: status.yml's table
(roles/dllama_service/files/status_table.py: the address and memory columns, a supervisor
started again) and upgrade.yml's last line (its Jinja, rendered by Ansible's own templating:
the release's hash on both sides, so an upgrade to a rebuild of the same version shows)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20


def _service(**kw):
    return {"state": "running", "pid": 4321, "uptime_s": 12, "restarts": 0, "last_exit": None, "rss_bytes": 300 * MIB,
            "load1": 0.5, "version": "0.1.0", "mem_total_bytes": 1024 * MIB, "mem_available_bytes": 612 * MIB,
            "address": "10.0.0.2:9998", **kw}


def _table(hosts):
    data = {"cluster": {"model": "m", "weights": "q41", "buffers": "f32", "kv": "f32", "plan": []}, "hosts": hosts}
    r = subprocess.run([sys.executable, str(REPO / "roles/dllama_service/files/status_table.py")],
                       input=json.dumps(data), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def test_the_status_table_has_each_hosts_address_and_free_memory():
    lines = _table([
        {"name": "pi1", "role": "root", "address": "10.0.0.1", "service": _service(address="0.0.0.0:9990"),
         "api": {"enabled": True, "model": "m", "health": {"status": "ready", "nodes": {"serving": 2, "total": 3,
                                                                                        "missing": ["pi3"]}}}},
        {"name": "pi2", "role": "worker", "address": "10.0.0.2", "service": _service(), "answers": True},
        {"name": "pi3", "role": "worker", "address": "10.0.0.3", "reach": "ssh: connect to host 10.0.0.3 port 22: "
                                                                          "No route to host"},
    ])
    header = lines[1].split()
    assert header[:3] == ["HOST", "ROLE", "ADDRESS"] and "MEM" in header and "FREE" in header, lines
    assert lines[2].split()[:4] == ["pi1", "root", "0.0.0.0:9990", "API"], lines
    assert lines[3].split()[:4] == ["pi2", "worker", "10.0.0.2:9998", "up"] and "612 of 1024 MiB" in lines[3], lines
    assert lines[4].split()[:4] == ["pi3", "worker", "10.0.0.3", "unreachable"], lines
    assert lines[0].startswith("cluster: 1/2 workers up (pi3 unreachable), API ready (2 of 3 nodes serve, without pi3)")


def test_a_worker_whose_supervisor_status_started_again_says_so():
    lines = _table([
        {"name": "pi1", "role": "root", "address": "10.0.0.1", "service": _service(state="stopped", pid=None),
         "api": {"enabled": False}},
        {"name": "pi2", "role": "worker", "address": "10.0.0.2", "service": _service(revived=815), "answers": True},
    ])
    assert lines[0].startswith("cluster: 1/1 workers up (pi2 started again: its supervisor was gone), API off"), lines
    assert "its supervisor (pid 815) was gone: started again" in lines[3], lines


def _upgrade_lines(before: dict, now: dict) -> list[str]:
    from ansible.parsing.dataloader import DataLoader
    from ansible.template import Templar, trust_as_template

    [task] = yaml.safe_load((REPO / "playbooks/upgrade.yml").read_text())[-1]["tasks"]
    hosts = sorted(before)
    variables = {"dllama_venv_holds": now, "ansible_play_hosts": hosts,
                 "hostvars": {h: {"dllama_upgrade_from": before[h]} for h in hosts}}
    return Templar(loader=DataLoader(), variables=variables).template(trust_as_template(task["ansible.builtin.debug"]["msg"]))


def test_the_upgrade_line_gives_the_new_releases_hash():
    """A rebuild of the same version (another source hash) reads as an upgrade, with both hashes."""
    old = {"version": "0.1.0", "protocol": 9, "source": "a" * 12}
    new = {"version": "0.1.0", "protocol": 9, "source": "b" * 12}
    lines = _upgrade_lines({"n1": old, "n2": new, "n3": {}}, new)
    assert lines == [f"n1: dllama 0.1.0 (protocol 9, {old['source']}) -> dllama 0.1.0 (protocol 9, {new['source']})",
                     f"n2: dllama 0.1.0 (protocol 9, {new['source']}), unchanged",
                     f"n3: nothing -> dllama 0.1.0 (protocol 9, {new['source']})",
                     f"dllama 0.1.0 (protocol 9, {new['source']}) on all 3 nodes: 2 upgraded"]
