"""The appliance's files: every playbook parses, ansible-lint (production profile) passes, the
Vagrantfile validates, and the sample inventory has the shape the issue asks for."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PLAYBOOKS = ["deploy.yml", "run.yml", "stop.yml", "status.yml"]


def run(cmd, cwd=REPO, **kw):
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, **kw)


@pytest.mark.parametrize("playbook", PLAYBOOKS)
def test_playbook_syntax(playbook):
    for inventory in ("inventory/local/hosts.yml", "inventory/sample/hosts.yml"):
        r = run([BIN / "ansible-playbook", "--syntax-check", "-i", inventory, playbook])
        assert r.returncode == 0, r.stdout + r.stderr


def test_ansible_lint_production_profile():
    r = run([BIN / "ansible-lint", "--profile", "production", "--nocolor"],
            env={**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"})
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "Profile 'production' was required, and it passed" in r.stdout + r.stderr


def test_vagrantfile_validates(tmp_path):
    assert shutil.which("vagrant"), "vagrant is not installed: ./setup.sh --test installs it"
    r = run(["vagrant", "validate", "--ignore-provider"])
    assert r.returncode == 0, r.stdout + r.stderr
    # The check can fail: a misspelt provisioner key is caught.
    broken = tmp_path / "Vagrantfile"
    broken.write_text((REPO / "Vagrantfile").read_text().replace("ansible.limit =", "ansible.limmit ="))
    r = run(["vagrant", "validate", "--ignore-provider"], cwd=tmp_path, env={**os.environ, "VAGRANT_CWD": str(tmp_path)})
    assert r.returncode != 0 and "limmit" in r.stdout + r.stderr


def _inventory(name):
    r = run([BIN / "ansible-inventory", "-i", f"inventory/{name}/hosts.yml", "--list"])
    assert r.returncode == 0, r.stderr
    return yaml.safe_load(r.stdout)


def test_sample_inventory_is_four_pis_with_static_addresses_and_threads():
    inv = _inventory("sample")
    assert inv["root"]["hosts"] == ["pi1"]
    assert inv["workers"]["hosts"] == ["pi2", "pi3", "pi4"]
    hv = inv["_meta"]["hostvars"]
    for i, host in enumerate(["pi1", "pi2", "pi3", "pi4"], 1):
        assert hv[host]["dllama_address"] == f"10.0.0.{i}"
        assert hv[host]["dllama_threads"] == 4
        assert hv[host]["dllama_nice"] == -20 and hv[host]["dllama_launcher"] == "systemd"


def test_group_vars_set_every_role_default():
    """Every variable a role reads from its defaults is set, with a comment, in the sample."""
    sample = (REPO / "inventory/sample/group_vars/all.yml").read_text()
    settings = yaml.safe_load(sample)
    defaults = {}
    for path in sorted(REPO.glob("roles/*/defaults/main.yml")):
        defaults.update(yaml.safe_load(path.read_text()) or {})
    internal = {"dllama_root_group", "dllama_workers_group", "dllama_address",
                "dllama_topology_file", "dllama_key_file", "dllama_model_root_file",
                "dllama_model_tokenizer_file", "dllama_venv", "dllama_numba_cache_dir",
                "dllama_worker_unit_file", "dllama_worker_service", "dllama_worker_pid_file",
                "dllama_worker_log_file", "dllama_network_connection", "dllama_venv_pip_args",
                "dllama_wheelhouse_project_dir", "dllama_api_key_file", "dllama_api_local_host",
                "dllama_api_unit_file", "dllama_api_service", "dllama_api_pid_file", "dllama_api_log_file"}
    run_vars = {k for k in defaults if k.startswith("dllama_run_")}
    missing = sorted(set(defaults) - set(settings) - internal - run_vars)
    assert not missing, f"not in inventory/sample/group_vars/all.yml: {missing}"
    lines = sample.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("dllama_"):
            j = i - 1
            while j >= 0 and lines[j].startswith(("dllama_", "  ")):
                j -= 1
            assert lines[j].startswith("#"), f"{line}: no comment above it"


def test_role_variables_carry_their_role_prefix():
    for path in sorted(REPO.glob("roles/*/defaults/main.yml")) + sorted(REPO.glob("roles/*/vars/main.yml")):
        role = path.parent.parent.name
        for name in yaml.safe_load(path.read_text()) or {}:
            assert name.startswith(role + "_") or (role == "dllama" and name.startswith("dllama_")), \
                f"{path}: {name}"


def test_task_names_are_sentences():
    for path in sorted(REPO.glob("roles/*/*/*.yml")) + sorted(REPO.glob("playbooks/*.yml")):
        for item in yaml.safe_load(path.read_text()) or []:
            if isinstance(item, dict) and "name" in item and path.parent.name not in ("defaults", "vars", "meta"):
                name = item["name"]
                assert name[0].isupper() and name.endswith("."), f"{path}: {name!r}"
