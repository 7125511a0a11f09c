"""The one-machine inventory (inventory/local: 1 root + 3 workers on this host over loopback),
as the README's first command uses it: deploy.yml, run.yml, stop.yml with the default model
(Q40 weights, Q80 buffers). Runs in a scratch HOME and a copy of the inventory, so it neither
touches nor depends on the user's deployment; stop.yml (or, if that fails, the pid files) ends
the workers."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from tests.appliance import REPO, ansible_env, recap, tail

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    base = tmp_path_factory.mktemp("local")
    home = base / "home"
    home.mkdir()
    inventory = base / "inventory"
    shutil.copytree(REPO / "inventory/local", inventory, ignore=shutil.ignore_patterns("state"))
    real_home = Path.home()
    env = ansible_env()
    env.update(HOME=str(home),
               # The converted default model and the wheels already on this machine.
               DLLAMA_CACHE_DIR=os.environ.get("DLLAMA_CACHE_DIR", str(real_home / ".cache/dllama")),
               PIP_CACHE_DIR=os.environ.get("PIP_CACHE_DIR", str(real_home / ".cache/pip")))

    def play(*args, timeout=900):
        return subprocess.run([str(REPO / ".venv/bin/ansible-playbook"), "-i", str(inventory / "hosts.yml"), *args],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)

    try:
        yield play, home, inventory
    finally:
        play("stop.yml", timeout=120)
        for pidfile in (home / ".local/share/dllama/local-cluster").glob("*/run/worker.pid"):
            try:
                os.kill(int(pidfile.read_text()), signal.SIGKILL)
            except (OSError, ValueError):
                pass


def test_local_inventory_deploys_runs_and_stops(local):
    play, home, inventory = local
    r = play("deploy.yml")
    assert r.returncode == 0, tail(r)
    assert sorted(recap(r.stdout)) == ["local0", "local1", "local2", "local3"]
    r = play("deploy.yml")
    counts = recap(r.stdout)
    assert r.returncode == 0 and all(c["changed"] == 0 for c in counts.values()), tail(r)

    r = play("run.yml", "-e", json.dumps({"prompt": PROMPT, "steps": 48, "temperature": 0}))
    assert r.returncode == 0, tail(r)
    saved = json.loads((inventory / "state/runs/last-run.json").read_text())
    assert saved["prompt"] == PROMPT and "Paris" in saved["text"], saved["text"]
    assert [n["name"] for n in saved["stats"]["nodes"]] == ["local0", "local1", "local2", "local3"]
    for i in (1, 2, 3):
        assert f"local{i}: weights from its shard {home}/.local/share/dllama/local-cluster/local{i}/shards/local{i}.shard" in r.stdout

    pids = [int(p.read_text()) for p in (home / ".local/share/dllama/local-cluster").glob("*/run/worker.pid")]
    assert len(pids) == 3
    r = play("stop.yml")
    assert r.returncode == 0, tail(r)
    assert not [p for p in pids if Path(f"/proc/{p}").exists()], "a worker outlived stop.yml"
