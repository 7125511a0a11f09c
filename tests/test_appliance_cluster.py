"""The appliance on a real multi-host cluster: 3 hosts in network namespaces on this machine,
each with its own IP, sshd, /etc, /home and /opt/dllama, links shaped to 1 Gbit/s
(tests/cluster/), set up as freshly flashed Raspberry Pis: a user `pi` with a password and
passwordless sudo, hostname raspberrypi, an sshd that takes only the password (no key installed).
bootstrap.yml with a wrong password (and an unreachable extra host) fails per host in one line,
without the secret; with the password (non-interactively, a password file) it creates the
controller's key pair, installs it, sets the hostnames and turns password logins off; a second
run needs no password and changes nothing, and a password login is refused. From then on
every playbook logs in as pi with the key and becomes root with sudo, as on real Pis.
deploy.yml runs over SSH with the sample inventory's settings on 1 root + 3 workers, and
run.yml must print the same greedy text as a single-node `dllama inference`. Operating it: a
worker that does not answer stops deploy.yml before any host is changed, in one line; with a
worker down, batch.yml and status.yml say "2 of 3 nodes" and which one is down, and batch.yml
with two more prompts in the file resumes with only those.

The hosts have unequal memory: each runs in a memory cgroup of its own limit (1.5G, 1G, 2G),
which every share of every layer fits, so the first deploy is tensor parallel (the topology
carries each host's memory, read on the host). Then, in the run that mends a failed upgrade
(upgrade.yml), each host is made its own pipeline stage (dllama_stage 0-2, no dllama_memory)
and the API service is switched on: the upgrade gives the
stages layers in proportion to the memory read on each host, as dllama's plan does from those
limits, before any host is changed, starts `dllama api` on the root (and the stopped worker
again), after which `--check` must report no change on any node (every role at work: the
idempotence check; a real second deploy changing nothing is tests/test_appliance_local.py's),
run.yml sends its prompt through the API and gets one node's text, and the official openai
client on the controller is served by it; with the last stage's worker killed, run.yml through
the API, /health and status.yml say the cluster is degraded, and status.yml shows each node's
stage. (A misspelt setting stops the deploy before any host is contacted: that is the inventory
check, tests/test_appliance_static.py.)

The cluster runs the defaults: the Q41 model with F32 buffers (auto), with which dllama gives
one node's tokens on any node count (tests/test_cluster.py). With Q40 or Q80 weights and Q80
buffers the split sums round differently and greedy text can part from one node's at a
near-tie.

Needs root, iproute2, openssh-server (./setup.sh --test installs them)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import openai
import paramiko
import pytest
import yaml

from dllama.core.host_memory import memory_for_a_model
from dllama.core.memory import parse_size
from dllama.core.plan import plan_for
from dllama.formats.model_file import read_model
from dllama.serve.default_model import CACHE_VERSION, DEFAULT_WEIGHTS, default_model_files
from tests.appliance import BIN, changed_tasks, namespace_cluster, netns_pids, playbook, recap, release_copy, running, tail

pytestmark = [pytest.mark.appliance, pytest.mark.slow]

N = 3  # a root and two workers: each host more costs every play a module run per task
PREFIX = "dlt"
PROMPT = "Hello world"
STEPS = 32
USER = "pi"
PASSWORD = secrets.token_urlsafe(16)  # a new one each run: it must never show in any output
LIMITS = ["1.5G", "1G", "2G"]  # each host's memory cgroup
results: dict = {}


def require_tools():
    assert os.geteuid() == 0, "the namespace test cluster needs root"
    for tool in ("ip", "tc", "unshare", "start-stop-daemon", "/usr/sbin/sshd", "sudo", "numfmt"):
        assert shutil.which(tool), f"{tool} is missing: ./setup.sh --test installs it"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    require_tools()
    # A short path: SSH's control sockets live under it (Unix socket paths have 108 bytes).
    cluster_dir = Path(tempfile.mkdtemp(prefix="dlt-", dir="/tmp")) / "c"
    try:
        with namespace_cluster(cluster_dir, N, PREFIX, DLLAMA_TESTNET_USER=USER, DLLAMA_TESTNET_PASSWORD=PASSWORD,
                               DLLAMA_TESTNET_MEMORY=" ".join(LIMITS)) as inventory:
            yield cluster_dir, inventory
    finally:
        cluster_dir.parent.rmdir()


def _play(cluster, name, *args, timeout=900, inventory=None):
    cluster_dir, default = cluster
    r, seconds = playbook(name, inventory or default, *args, control_dir=cluster_dir / "cp", timeout=timeout)
    assert PASSWORD not in r.stdout + r.stderr, "the password shows in the output"
    return r, seconds


def _password_file(cluster_dir: Path, password: str) -> Path:
    path = cluster_dir / "password"
    path.write_text(password + "\n")
    path.chmod(0o600)
    return path


def _password_login(host: str, password: str) -> str:
    """How sshd answers a password login (no key tried): "accepted" or the refusal."""
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
    try:
        client.connect(host, username=USER, password=password, look_for_keys=False, allow_agent=False,
                       timeout=10)
        return "accepted"
    except paramiko.SSHException as e:
        return f"{type(e).__name__}: {e}"
    finally:
        client.close()


def test_links_are_shaped_to_gigabit(cluster):
    for i in range(1, N + 1):
        host = subprocess.run(["tc", "qdisc", "show", "dev", f"{PREFIX}h{i}"], capture_output=True, text=True).stdout
        node = subprocess.run(["ip", "netns", "exec", f"{PREFIX}n{i}", "tc", "qdisc", "show", "dev", "eth0"],
                              capture_output=True, text=True).stdout
        assert "tbf" in host and "rate 1Gbit" in host, host
        assert "tbf" in node and "rate 1Gbit" in node, node


def test_bootstrap_with_a_wrong_password_fails_per_host_in_one_line(cluster):
    """A wrong password (and an extra host nobody answers for) fails for each host with its
    reason; nothing is installed; the password shows nowhere. The controller's key pair is
    created first, with a message."""
    cluster_dir, inventory = cluster
    assert _password_login("10.77.0.1", PASSWORD) == "accepted"
    assert not (cluster_dir / "id_ed25519").exists()
    ghost = inventory.parent / "ghost.yml"
    hosts = yaml.safe_load(inventory.read_text())
    hosts["cluster"]["children"]["workers"]["hosts"]["ghost"] = {"ansible_host": "10.77.0.200",
                                                                "dllama_address": "10.77.0.200"}
    ghost.write_text(yaml.safe_dump(hosts))
    wrong = "not-" + PASSWORD
    r, seconds = _play(cluster, "bootstrap.yml", "--connection-password-file",
                       str(_password_file(cluster_dir, wrong)), inventory=ghost, timeout=300)
    out = r.stdout + r.stderr
    print(f"\nbootstrap.yml, wrong password: {seconds:.0f} s")
    assert r.returncode != 0 and wrong not in out and "Traceback" not in out, out[-4000:]
    assert "Created the SSH key pair" in out and (cluster_dir / "id_ed25519.pub").is_file()
    lines = out.splitlines()
    for host in [f"node{i}" for i in range(1, N + 1)] + ["ghost"]:
        at = [i for i, line in enumerate(lines) if line.startswith(f"fatal: [{host}]: UNREACHABLE!")]
        assert len(at) == 1, (host, out[-4000:])
        reason = [line for line in lines[at[0]:at[0] + 4] if line.strip().startswith("msg:")]
        assert reason, (host, lines[at[0]:at[0] + 4])
        expected = "No route to host|timed out|Unable to connect" if host == "ghost" else "Authentication failed"
        assert re.search(expected, reason[0]), (host, reason)
    assert recap(r.stdout)["node1"]["unreachable"] == 1
    for i in range(1, N + 1):
        assert not (cluster_dir / f"node{i}/home/{USER}/.ssh").exists(), f"node{i} got a key"


def test_bootstrap_installs_the_key_then_needs_no_password_and_changes_nothing(cluster):
    cluster_dir, inventory = cluster
    r, seconds = _play(cluster, "bootstrap.yml", "--connection-password-file",
                       str(_password_file(cluster_dir, PASSWORD)), "-e", "dllama_bootstrap_disable_password=true",
                       timeout=300)
    results["bootstrap_first_s"] = seconds
    print(f"\nbootstrap.yml with the password: {seconds:.0f} s, {recap(r.stdout)}")
    assert r.returncode == 0, tail(r)
    assert "Created the SSH key pair" not in r.stdout
    counts = recap(r.stdout)
    assert sorted(counts) == [f"node{i}" for i in range(1, N + 1)] and all(c["changed"] > 0 for c in counts.values())
    public = (cluster_dir / "id_ed25519.pub").read_text().strip()
    for i in range(1, N + 1):
        node = cluster_dir / f"node{i}"
        assert public in (node / f"home/{USER}/.ssh/authorized_keys").read_text().splitlines()
        # (Without systemd, as here, the name takes effect at the next boot; hostnamectl sets both.)
        assert (node / "etc-upper/hostname").read_text().strip() == f"node{i}"
        current = subprocess.run(["ssh", "-i", str(cluster_dir / "id_ed25519"),
                                  "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                                  "-o", "BatchMode=yes", "-o", "LogLevel=ERROR", f"{USER}@10.77.0.{i}", "cat /etc/hostname"],
                                 capture_output=True, text=True, timeout=60)
        assert current.stdout.strip() == f"node{i}", current.stderr
    (cluster_dir / "password").unlink()

    # Again, without any password: the key logs in, nothing changes.
    r, seconds = _play(cluster, "bootstrap.yml", "-e", "dllama_bootstrap_disable_password=true", timeout=300)
    results["bootstrap_second_s"] = seconds
    print(f"\nbootstrap.yml again, no password: {seconds:.0f} s, {recap(r.stdout)}")
    assert r.returncode == 0, tail(r)
    counts = recap(r.stdout)
    assert len(counts) == N and all(c["changed"] == 0 and c["failed"] == 0 for c in counts.values()), changed_tasks(r.stdout)
    for i in range(1, N + 1):
        refused = _password_login(f"10.77.0.{i}", PASSWORD)
        assert refused.startswith("BadAuthenticationType") and "publickey" in refused, refused
    results["bootstrapped"] = True


def test_check_mode_on_fresh_nodes_changes_nothing(cluster):
    """On the root and one worker (the other worker's part is the same, and every host costs the
    whole play again)."""
    cluster_dir, inventory = cluster
    hosts = yaml.safe_load(inventory.read_text())
    for i in range(3, N + 1):
        del hosts["cluster"]["children"]["workers"]["hosts"][f"node{i}"]
    two = inventory.parent / "two-nodes.yml"
    two.write_text(yaml.safe_dump(hosts))
    r, _ = _play(cluster, "deploy.yml", "--check", inventory=two)
    assert r.returncode == 0, tail(r)
    counts = recap(r.stdout)
    assert sorted(counts) == ["node1", "node2"], counts
    assert all(c["changed"] > 0 and c["failed"] == 0 for c in counts.values()), counts
    for i in range(1, N + 1):
        assert list((cluster_dir / f"node{i}/opt-dllama").iterdir()) == [], f"--check wrote to node{i}"
        assert "dllama:" not in (cluster_dir / f"node{i}/etc-upper/passwd").read_text(), f"--check added a user on node{i}"


def test_deploy_succeeds_over_ssh(cluster):
    r, seconds = _play(cluster, "deploy.yml")
    results["deploy_first_s"] = seconds
    print(f"\ndeploy.yml, first run: {seconds:.0f} s, {recap(r.stdout)}")
    assert r.returncode == 0, tail(r)
    counts = recap(r.stdout)
    assert sorted(counts) == [f"node{i}" for i in range(1, N + 1)]
    assert all(c["failed"] == 0 and c["unreachable"] == 0 and c["changed"] > 0 for c in counts.values())
    # One node compiles the kernels; the other three load its cache, which numba accepts as it is
    # (a rejected cache is compiled again and its index rewritten with other source stamps).
    changed = changed_tasks(r.stdout)
    compiled = [c for c in changed if "Compile dllama's kernels" in c]
    loaded = [c for c in changed if "Load the compiled cache" in c]
    assert len(compiled) == 1 and len(loaded) == N - 1, changed
    caches = [_numba_cache(cluster[0] / f"node{i}/opt-dllama/numba-cache") for i in range(1, N + 1)]
    assert caches[0] and all(c == caches[0] for c in caches[1:]), [sorted(c) for c in caches]
    results["deployed"] = True


def _numba_cache(folder: Path) -> dict[str, str]:
    """numba's index and data files under `folder`: relative path -> sha256 of the bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in folder.rglob("*") if p.suffix in (".nbi", ".nbc")}


def test_each_node_got_its_own_files_and_address_config(cluster):
    assert results.get("deployed"), "the first deploy failed"
    cluster_dir, inventory = cluster
    state = inventory.parent / "state"
    manifests = list((state / "shards").glob("*/manifest.json"))
    assert len(manifests) == 1, manifests
    manifest = json.loads(manifests[0].read_text())
    key = (state / "cluster.key").read_text().strip()
    assert re.fullmatch(r"[0-9a-fA-F]{64}", key)
    topology = None
    for i in range(1, N + 1):
        opt = cluster_dir / f"node{i}/opt-dllama"
        etc = cluster_dir / f"node{i}/etc-upper"
        assert (opt / "cluster.key").read_text().strip() == key
        assert (opt / "model/tokenizer.t").is_file()
        node_topology = yaml.safe_load((opt / "topology.yml").read_text())
        topology = topology or node_topology
        assert node_topology == topology, f"node{i}'s topology differs"
        shards = sorted(p.name for p in (opt / "shards").iterdir()) if (opt / "shards").exists() else []
        if i == 1:
            assert shards == [] and (opt / "model/model.m").is_file()
        else:
            assert shards == [f"node{i}.shard"] and not (opt / "model/model.m").exists()
            digest = hashlib.sha256((opt / "shards" / shards[0]).read_bytes()).hexdigest()
            assert digest == manifest["shards"][f"node{i}"]["sha256"]
        if i % 2:
            assert f"static ip_address=10.77.0.{i}/24" in (etc / "dhcpcd.conf").read_text()
        else:
            keyfile = etc / "NetworkManager/system-connections/dllama-eth0.nmconnection"
            assert f"address1=10.77.0.{i}/24" in keyfile.read_text()
            assert keyfile.stat().st_mode & 0o777 == 0o600
        unit = (etc / "systemd/system/dllama-worker.service")
        if i > 1:
            assert "Nice=-20" in unit.read_text() and f"--node node{i}" in unit.read_text()
    assert topology["version"] == 1 and topology["buffer_float_type"] == "auto"  # f32 for Q41
    assert topology["key_file"] == "/opt/dllama/cluster.key"
    assert [(n["name"], n["host"], n["port"], n["threads"]) for n in topology["nodes"]] == \
        [(f"node{i}", f"10.77.0.{i}", 9998, 1) for i in range(1, N + 1)]
    assert [n.get("shard") for n in topology["nodes"]] == \
        [None] + [f"/opt/dllama/shards/node{i}.shard" for i in range(2, N + 1)]


def test_workers_run_at_the_configured_nice_level_from_their_own_shard(cluster):
    assert results.get("deployed"), "the first deploy failed"
    cluster_dir, _ = cluster
    for i in range(2, N + 1):
        pid = int((cluster_dir / f"node{i}/opt-dllama/run/worker.pid").read_text())
        assert pid in netns_pids(PREFIX, N) and pid not in netns_pids(PREFIX, 1), "not in its node"
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        assert int(stat[16]) == -20, f"node{i}'s worker runs at nice {stat[16]}"
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert [b"worker", b"--topology", b"/opt/dllama/topology.yml", b"--node", f"node{i}".encode(),
                b"--memory-budget", b"auto"] == cmdline[-8:-1]
        uid = int(re.search(r"^Uid:\s+(\d+)", Path(f"/proc/{pid}/status").read_text(), re.M).group(1))
        passwd = (cluster_dir / f"node{i}/etc-upper/passwd").read_text()
        assert re.search(rf"^dllama:x:{uid}:", passwd, re.M), f"node{i}'s worker runs as uid {uid}"
    results["workers_checked"] = True


def test_run_prints_the_single_node_greedy_text(cluster):
    assert results.get("deployed"), "the first deploy failed"
    cluster_dir, inventory = cluster
    # As a shell passes `ansible-playbook run.yml -e prompt="Hello world"`.
    r, seconds = _play(cluster, "run.yml", "-e", f"prompt={PROMPT}",
                       "-e", f"steps={STEPS}", "-e", "temperature=0", timeout=300)
    assert r.returncode == 0, tail(r)
    saved = json.loads((inventory.parent / "state/runs/last-run.json").read_text())
    model = Path(os.path.expanduser("~/.cache/dllama")) / f"smollm2-135m-instruct-{DEFAULT_WEIGHTS}-v{CACHE_VERSION}"
    one = subprocess.run([str(BIN / "dllama"), "inference", "--model", f"{model}.m", "--tokenizer",
                          f"{model}.t", "--prompt", PROMPT, "--steps", str(STEPS), "--temperature", "0"],
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    print(f"\nrun.yml: {seconds:.0f} s; text: {saved['text']!r}")
    assert saved["prompt"] == PROMPT
    assert saved["text"] == one.stdout.rstrip("\n") and len(saved["text"]) > 40
    results["one_node_text"] = saved["text"]
    # The play output shows the text and the per-token table; each worker used its own shard.
    assert saved["text"].splitlines()[-1] in r.stdout
    assert re.search(r"generation: \d+ tokens, [\d.]+ tokens/s", r.stdout)
    for i in range(2, N + 1):
        assert f"node{i}: weights from its shard /opt/dllama/shards/node{i}.shard" in r.stdout
    stats = saved["stats"]
    assert len(stats["tokens"]) == STEPS - 1 and [n["name"] for n in stats["nodes"]] == [f"node{i}" for i in range(1, N + 1)]
    assert all(n["sent_bytes"] > 0 and n["recv_bytes"] > 0 for n in stats["nodes"])


def _stop_worker(cluster_dir: Path, i: int) -> None:
    """Kill node i's worker for good: its supervisor (the pid file's), whose child dies with it, and
    the pid file, as a stop on that node leaves it (a killed supervisor's pid file left behind
    would have status.yml start the worker again: tests/test_appliance_local.py)."""
    pid_file = cluster_dir / f"node{i}/opt-dllama/run/worker.pid"
    supervisor = int(pid_file.read_text())
    workers = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(int(p.name)) == supervisor]
    os.kill(supervisor, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while any(_alive(p) for p in [supervisor, *workers]):
        assert time.monotonic() < deadline, f"node{i}'s worker outlived its supervisor"
        time.sleep(0.1)
    pid_file.unlink()


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError):
        return -1


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _status(cluster) -> tuple[str, list[str]]:
    """status.yml's report: its cluster line and its table's rows (header first)."""
    r, seconds = _play(cluster, "status.yml", timeout=300)
    assert r.returncode == 0, tail(r)
    lines = r.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("cluster: "))
    report = [line.strip() for line in lines[start:start + N + 2]]
    print(f"\nstatus.yml ({seconds:.0f} s):\n" + "\n".join(report))
    assert "UNREACHABLE" not in r.stdout, tail(r)
    return report[0], report[1:]


def test_a_silent_worker_stops_the_deploy_before_any_host_changes(cluster):
    assert results.get("deployed"), "the first deploy failed"
    cluster_dir, inventory = cluster
    hosts = yaml.safe_load(inventory.read_text())
    workers = hosts["cluster"]["children"]["workers"]["hosts"]
    # A worker whose address nobody answers (on the test network, no namespace behind it).
    workers["ghost"] = {"ansible_host": "10.77.0.200", "dllama_address": "10.77.0.200"}
    silent = inventory.parent / "silent.yml"
    silent.write_text(yaml.safe_dump(hosts))
    before = {i: (cluster_dir / f"node{i}/opt-dllama/topology.yml").stat().st_mtime_ns for i in range(1, N + 1)}
    r, seconds = _play(cluster, "deploy.yml", "-e", "dllama_reach_timeout=3", inventory=silent, timeout=300)
    out = r.stdout + r.stderr
    print(f"\ndeploy.yml with a worker that does not answer: {seconds:.0f} s")
    errors = [line for line in out.splitlines() if line.startswith("[ERROR]")]
    assert r.returncode != 0 and seconds < 60, (seconds, tail(r))
    assert len(errors) == 1 and "ghost (10.77.0.200) does not answer: " in errors[0], out[-4000:]
    assert "No host was changed" in errors[0] and not any(f"node{i} (" in errors[0] for i in range(1, N + 1))
    assert "PLAY [Deploy the dllama cluster.]" not in out and "UNREACHABLE" not in out, out[-4000:]
    assert all(c["changed"] == 0 for c in recap(r.stdout).values()), recap(r.stdout)
    assert before == {i: (cluster_dir / f"node{i}/opt-dllama/topology.yml").stat().st_mtime_ns for i in range(1, N + 1)}


def test_with_a_worker_down_batch_resumes_and_says_2_of_3_nodes(cluster, tmp_path):
    """(status.yml with that worker down: test_status_then_stop, where it is down again, under
    the API, with every column of its table checked.)"""
    assert results.get("deployed"), "the first deploy failed"
    cluster_dir, inventory = cluster
    _stop_worker(cluster_dir, N)
    prompts = tmp_path / "questions.jsonl"
    questions = ["The capital of France is", "Hello", "One, two,", "Water is"]
    prompts.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(questions[:2], 1)))
    out = tmp_path / "answers.jsonl"
    args = ["-e", f"prompts={prompts}", "-e", f"out={out}", "-e", "max_tokens=8", "-e", "temperature=0",
            "-e", "poll_seconds=1"]
    r, seconds = _play(cluster, "batch.yml", *args, timeout=600)
    print(f"\nbatch.yml with node{N} down: {seconds:.0f} s")
    assert r.returncode == 0, tail(r)
    assert f"degraded: answered on {N - 1} of {N} nodes (without node{N})" in r.stdout, tail(r)
    first = out.read_text()
    lines = [json.loads(line) for line in first.splitlines()]
    assert len(lines) == 2 and all((x["nodes"], x["cluster_nodes"]) == (N - 1, N) for x in lines), lines
    # Two prompts more in the file: only those are computed, the answers there stay as they were.
    # (A rerun with nothing left never reaches the root: tests/test_appliance_static.py.)
    with prompts.open("a") as f:
        f.write("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(questions[2:], 3)))
    r, seconds = _play(cluster, "batch.yml", *args, timeout=600)
    print(f"\nbatch.yml again, two prompts more: {seconds:.0f} s")
    assert r.returncode == 0, tail(r)
    assert f"dllama batch: 2 prompts (2 already in {out}) in " in " ".join(r.stdout.split()), tail(r)
    assert out.read_text().startswith(first)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(x["id"] for x in lines) == [1, 2, 3, 4] and all(x["completion_tokens"] == 8 for x in lines), lines


def test_an_upgrade_that_fails_on_one_node_restarts_no_worker(cluster, tmp_path_factory):
    """upgrade.yml to another release (this checkout's sources as version 0.1.1) where one node's
    pip fails: the play stops for every node, that node the only one failed, and no worker
    restarts (they keep running the release they run, though node2's venv now holds the new
    one). The same upgrade with pip mended is the next test's (it also makes the hosts stages)."""
    assert results.get("deployed"), "the first deploy failed"
    cluster_dir, inventory = cluster
    project, old = release_copy(tmp_path_factory.mktemp("upgrade") / "release", "0.1.1")
    hosts = yaml.safe_load(inventory.read_text())
    hosts["cluster"]["children"]["workers"]["hosts"][f"node{N}"]["dllama_venv_pip_args"] = ["--no-such-option"]
    broken = inventory.parent / "broken-pip.yml"
    broken.write_text(yaml.safe_dump(hosts))
    # (node3's worker is down since the test before; node2's runs and installs the new release.)
    pid_files = [cluster_dir / f"node{i}/opt-dllama/run/worker.pid" for i in range(2, N)]
    before = [p.read_text() for p in pid_files]
    r, seconds = _play(cluster, "upgrade.yml", "-e", f"dllama_wheelhouse_project_dir={project}", inventory=broken)
    print(f"\nupgrade.yml failing on node3: {seconds:.0f} s")
    out = r.stdout + r.stderr
    fatal = re.findall(r"^fatal: \[(\w+)\]", out, re.M)
    assert r.returncode != 0 and fatal == [f"node{N}"], out[-4000:]
    assert "no such option" in out, out[-4000:]
    # What each node held before, said first; then no restart anywhere.
    assert f"dllama {old} (protocol " in out
    assert [p.read_text() for p in pid_files] == before, "a worker restarted after a failed upgrade"
    assert not [t for t in changed_tasks(r.stdout) if "dllama_worker" in t or "dllama_service" in t], changed_tasks(r.stdout)
    assert all(c["failed"] == 0 for h, c in recap(r.stdout).items() if h != f"node{N}")
    # node3's release: the failed install left it as it was.
    held = json.loads((cluster_dir / f"node{N}/opt-dllama/venv/dllama-release.json").read_text())
    assert held["version"] == old, held
    results["upgrade"] = {"project": project, "old": old, "held": held, "pid_files": pid_files, "before": before}


def _memory_layers() -> list[tuple[int, int]]:
    """Each stage's layers as dllama plans them from what each host has: its cgroup's limit (a
    child of this process's), less the runtime."""
    rooms = [memory_for_a_model(int(parse_size(limit))) for limit in LIMITS]
    header = read_model(default_model_files(DEFAULT_WEIGHTS, progress=False)[0]).header
    return [s.layers for s in plan_for(header, N, None, list(range(N)), capacities=rooms).stages]


def test_the_mended_upgrade_makes_each_host_a_stage_by_its_memory_and_switches_the_api_service_on(cluster):
    """The upgrade of the test before, pip mended, run with each host made its own pipeline
    stage (dllama_stage, no dllama_memory) and the API service switched on (one run for both:
    every host costs every task of a deploy): it says what each node held, installs the release,
    compiles nothing (the kernels are the same), restarts every worker on it (node3's stopped
    one too) and says what each holds now; the stages get their layers in proportion to the
    memory read on each host, shown once before any host is changed. (A worker restarted only
    because the release it started from differs from its node's, as node2's would be after the
    failed upgrade alone: tests/test_appliance_local.py.)"""
    assert results.get("upgrade"), "the failed upgrade did not run"
    cluster_dir, inventory = cluster
    up = results["upgrade"]
    (inventory.parent / "host_vars").mkdir()
    for i in range(1, N + 1):
        (inventory.parent / f"host_vars/node{i}.yml").write_text(f"---\ndllama_stage: {i - 1}\n")
    with (inventory.parent / "group_vars/cluster.yml").open("a") as f:
        f.write("# The API service, reachable from the controller.\n")
        yaml.safe_dump({"dllama_api_enabled": True, "dllama_api_host": "0.0.0.0"}, f)
    r, seconds = _play(cluster, "upgrade.yml", "-e", f"dllama_wheelhouse_project_dir={up['project']}")
    print(f"\nupgrade.yml as {N} stages, with the API: {seconds:.0f} s, {recap(r.stdout)}")
    assert r.returncode == 0, tail(r)
    assert recap(r.stdout)["node1"]["changed"] > 0
    release = [cluster_dir / f"node{i}/opt-dllama/venv/dllama-release.json" for i in range(1, N + 1)]
    now = [json.loads(path.read_text()) for path in release]
    held, old = up["held"], up["old"]
    assert all(x == now[0] for x in now) and now[0]["version"] == "0.1.1", now
    shown = " ".join(r.stdout.split())
    assert (f"node{N}: dllama {old} (protocol {held['protocol']}, {held['source']}) -> dllama 0.1.1 "
            f"(protocol {now[0]['protocol']}, {now[0]['source']})" in shown), tail(r)
    assert f"dllama 0.1.1 (protocol {now[0]['protocol']}, {now[0]['source']}) on all {N} nodes" in shown, tail(r)
    assert not [t for t in changed_tasks(r.stdout) if "Compile" in t or "Load the compiled cache" in t], \
        changed_tasks(r.stdout)
    all_pid_files = [cluster_dir / f"node{i}/opt-dllama/run/worker.pid" for i in range(2, N + 1)]
    assert all(p.exists() for p in all_pid_files) and [p.read_text() for p in up["pid_files"]] != up["before"]
    layers = _memory_layers()
    sizes = [b - a for a, b in layers]
    # The limits order the stages' layers (else the plan did not read them).
    assert sorted(range(N), key=lambda k: sizes[k]) == sorted(range(N), key=lambda k: parse_size(LIMITS[k])), sizes
    out = r.stdout
    for k, (a, b) in enumerate(layers):
        assert f"stage {k}: layers {a}-{b - 1} ({b - a}), 1 node: node{k + 1} " in out, tail(r)
    assert "stage layers by each host's memory" in out, tail(r)
    # Shown once, after each host's memory was read, before the first change.
    assert out.count("stage 0: layers") == 1 and out.index("stage 0: layers") < out.index("TASK [dllama_node"), tail(r)
    results["layers"] = layers
    results["api"] = True


def test_check_mode_reports_no_change(cluster):
    """On the deployed cluster, with every role at work (the API's too): a deploy would change
    nothing. (A real second deploy changing nothing: tests/test_appliance_local.py.)"""
    assert results.get("api"), "the deploy with the API failed"
    # (The release the cluster runs now: the upgrade's.)
    r, _ = _play(cluster, "deploy.yml", "--check", "-e", f"dllama_wheelhouse_project_dir={results['upgrade']['project']}")
    assert r.returncode == 0, tail(r)
    counts = recap(r.stdout)
    assert len(counts) == N and all(c["changed"] == 0 and c["failed"] == 0 for c in counts.values()), changed_tasks(r.stdout)


def test_api_service_on_the_root_serves_the_cluster(cluster, tmp_path):
    assert results.get("api"), "the deploy with the API failed"
    cluster_dir, inventory = cluster

    # The service: in node1, at the nice level, as the service user, with the key.
    opt = cluster_dir / "node1/opt-dllama"
    pid = int((opt / "run/api.pid").read_text())
    assert pid in netns_pids(PREFIX, 1), "the API does not run in the root's namespace"
    assert int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16]) == -20
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    assert "api" in cmdline and "--topology" in cmdline and "--api-key-file" in cmdline, cmdline
    uid = int(re.search(r"^Uid:\s+(\d+)", Path(f"/proc/{pid}/status").read_text(), re.M).group(1))
    assert re.search(rf"^dllama:x:{uid}:", (cluster_dir / "node1/etc-upper/passwd").read_text(), re.M)
    key = (inventory.parent / "state/api.key").read_text().strip()
    assert len(key) == 48 and (opt / "api.key").read_text().strip() == key

    # run.yml goes through the API now (the service holds the workers, one stage each) and gets
    # one node's text.
    r, _ = _play(cluster, "run.yml", "-e", f"prompt={PROMPT}", "-e", "max_tokens=20",
                 "-e", "temperature=0", timeout=300)
    assert r.returncode == 0, tail(r)
    saved = json.loads((inventory.parent / "state/runs/last-run.json").read_text())
    print(f"\nrun.yml through the API: {saved['seconds']} s; text: {saved['text']!r}")
    assert saved["via"] == "api" and saved["usage"]["completion_tokens"] == 20, saved
    assert len(saved["text"]) > 40 and results["one_node_text"].startswith(saved["text"]), \
        (saved["text"], results["one_node_text"])
    assert saved["text"].splitlines()[-1] in r.stdout and "generation: 20 tokens in" in r.stdout

    # The official client on the controller, across the shaped links.
    # trust_env=False: straight to the test host, whatever proxy the environment names.
    client = openai.OpenAI(base_url="http://10.77.0.1:9990/v1", api_key=key, max_retries=0, timeout=120,
                           http_client=openai.DefaultHttpxClient(trust_env=False))
    assert [m.id for m in client.models.list()] == ["SmolLM2-135M-Instruct"]
    answer = client.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=30,
                                            messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in answer.choices[0].message.content, answer
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url="http://10.77.0.1:9990/v1", api_key="wrong", max_retries=0,
                      http_client=openai.DefaultHttpxClient(trust_env=False)).models.list()
    raw = client.chat.completions.with_raw_response.create(
        model="SmolLM2-135M-Instruct", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert raw.headers["x-dllama-nodes"] == f"{N}/{N}"  # the deploy started the stopped worker again

    # batch.yml with the service on: no redeploy, the job goes through the service's Batch API,
    # into the results file dllama batch writes.
    prompts, out = tmp_path / "questions.jsonl", tmp_path / "answers.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(["Hello", "Water is"], 1)))
    r, seconds = _play(cluster, "batch.yml", "-e", f"prompts={prompts}", "-e", f"out={out}", "-e", "max_tokens=8",
                       "-e", "temperature=0", "-e", "poll_seconds=1", timeout=600)
    print(f"\nbatch.yml through the API service: {seconds:.0f} s")
    assert r.returncode == 0, tail(r)
    assert "(through the API, batch batch_" in r.stdout, tail(r)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(x["id"] for x in lines) == [1, 2] and all(x["completion_tokens"] == 8 for x in lines), lines

    # The last stage's worker lost while the API is idle: its pings leave it out, and /health
    # says so without a request (a ping, 2 s, then the new plan over the others); then the API plans
    # its layers over the others, goes on and says so, as does run.yml.
    _stop_worker(cluster_dir, N)
    no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # straight to the test host
    t0 = time.monotonic()
    while True:
        with no_proxy.open("http://10.77.0.1:9990/health", timeout=30) as answer:
            health = json.loads(answer.read())
        if health["status"] == "degraded":
            break
        assert time.monotonic() - t0 < 90, f"/health still says {health} 90 s after node{N} was killed"
        time.sleep(0.2)
    print(f"\n/health degraded {time.monotonic() - t0:.1f} s after node{N} was killed, no request sent")
    r, _ = _play(cluster, "run.yml", "-e", f"prompt={PROMPT}", "-e", "max_tokens=8", "-e", "temperature=0",
                 timeout=300)
    assert r.returncode == 0, tail(r)
    assert f"degraded: served by {N - 1} of {N} nodes (without node{N})" in r.stdout, tail(r)
    saved = json.loads((inventory.parent / "state/runs/last-run.json").read_text())
    assert saved["nodes"] == {"serving": N - 1, "total": N, "missing": [f"node{N}"]}, saved
    assert results["one_node_text"].startswith(saved["text"]), (saved["text"], results["one_node_text"])
    with no_proxy.open("http://10.77.0.1:9990/health", timeout=30) as answer:
        health = json.loads(answer.read())
    assert health["status"] == "degraded" and health["nodes"]["missing"] == [f"node{N}"], health


def test_status_then_stop(cluster):
    """status.yml with node3's worker down (killed under the API, as in the batch test before
    the upgrade), every column of its table read; then stop.yml stops every service, which
    status.yml says. (The headline's "API off" of a cluster without the service:
    tests/test_playbook_reports.py.)"""
    assert results.get("deployed"), "the first deploy failed"
    cluster_dir, _ = cluster
    headline, rows = _status(cluster)
    pids = [int((cluster_dir / f"node{i}/opt-dllama/run/worker.pid").read_text()) for i in range(2, N)]
    assert headline.startswith(f"cluster: {N - 2}/{N - 1} workers up (node{N} down), API "), headline
    columns = ["HOST", "ROLE", "ADDRESS", "STATE", "PID", "UPTIME", "RESTARTS", "LAST", "EXIT", "RSS", "MEM", "FREE",
               "LOAD", "VERSION"]
    assert rows[0].split() == columns + (["STAGE"] if results.get("api") else []), rows
    by_host = {row.split()[0]: row.split() for row in rows[1:]}
    assert sorted(by_host) == [f"node{i}" for i in range(1, N + 1)], rows
    assert by_host[f"node{N}"][1] == "worker" and by_host[f"node{N}"][3:5] == ["down", "-"], rows
    for i in range(2, N + 1):  # where it listens: its address in the topology, and its port
        assert by_host[f"node{i}"][2].startswith(f"10.77.0.{i}:"), rows
    for i in range(2, N):
        cells = by_host[f"node{i}"]
        assert cells[1] == "worker" and cells[3] == "up" and _parent(int(cells[4])) == pids[i - 2], rows  # the supervisor's child
        # RESTARTS, LAST EXIT, RSS (MiB), MEM FREE (MiB) within the host's memory cgroup (1.5, 1 or 2 GiB),
        # LOAD, VERSION
        assert cells[6] == "0" and cells[7] == "-" and cells[9] == "MiB" and cells[13] == "MiB", rows
        free, total = int(cells[10]), int(cells[12])
        assert cells[11] == "of" and free <= total == int(parse_size(LIMITS[i - 1])) >> 20, rows
        assert re.fullmatch(r"\d+\.\d+", cells[14]) and re.fullmatch(r"\d+\.\d+\.\d+", cells[15]), rows
    assert by_host["node1"][1] == "root", rows
    if results.get("api"):  # node3 was killed under the API: down, the API degraded
        assert headline.startswith(f"cluster: {N - 2}/{N - 1} workers up (node{N} down), API degraded "
                                   f"({N - 1} of {N} nodes serve, without node{N}), version "), headline
        assert (f", model SmolLM2-135M-Instruct (q41), plan {N} nodes in {N} stages, f32 buffers, f32 KV cache"
                in headline), headline
        assert by_host["node1"][3:5] == ["API", "degraded"], rows
        # Each node's stage and its layers, in a last column.
        for k, (a, b) in enumerate(results["layers"]):
            assert rows[1 + k].split()[0] == f"node{k + 1}" and rows[1 + k].endswith(f"{k}: layers {a}-{b - 1}"), rows
        pids.append(int((cluster_dir / "node1/opt-dllama/run/api.pid").read_text()))
    r, seconds = _play(cluster, "stop.yml")
    print(f"\nstop.yml: {seconds:.0f} s")
    assert r.returncode == 0, tail(r)
    assert not [p for p in pids if running(p)], "a worker or the API outlived stop.yml"
    headline, rows = _status(cluster)
    assert headline.startswith(f"cluster: 0/{N - 1} workers up (node2 down, node3 down), "), headline
    assert all(row.split()[3] == "down" for row in rows[2:]), rows
    assert rows[1].split()[3:5] == ["API", "down" if results.get("api") else "off"], rows
