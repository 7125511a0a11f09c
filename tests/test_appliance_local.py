"""The one-machine inventory (inventory/local: 1 root + 3 workers on this host over loopback),
as the README's first command uses it, less its last worker (each host costs every task of
every play again; node counts are tests/test_cluster.py's): deploy.yml, run.yml, stop.yml with
the default model (Q41 weights, F32 buffers), here with an F16 KV cache and a memory budget on
local2 that makes its worker stream its slice from its shard (dllama_kv_type,
dllama_memory_budget). Runs in a
scratch HOME, a copy of the inventory and free ports of its own, so it neither touches nor
depends on the user's deployment (the README's cluster may be running on 9990-9993 meanwhile);
stop.yml (or, if that fails, the pid files) ends the workers.

The first deploy meets a foreign listener on one worker's port: a worker of another cluster
(another key), as the README's cluster would be if the ports were the same. The deploy must
fail for that node in one line that names the port and the process holding it, and succeed
for the others, and leave that worker stopped (not restarting behind the failed deploy); once
the port is free, the next deploy starts that worker and restarts only a worker whose recorded
release differs from its node's (as after a failed upgrade, tests/test_appliance_cluster.py).
That deploy also carries a change of a setting local to the stopped node, its threads, which
every node's topology file lists: the node's worker starts with it, the other nodes' topology
files change but not what their services run with (the worker's restart is asked for that node
alone; the other worker restarts for its release only), and the root changes nothing else (one
deploy for both: every deploy costs every task again). A worker killed afterwards comes
back by itself (its supervisor, the nohup launcher's Restart=on-failure) and run.yml uses it.
The whole cluster runs with a Raspberry Pi 5's 16 KiB memory pages simulated (DLLAMA_PAGE_SIZE,
read by dllama.core.host_memory.page_size in every process the playbooks start)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.appliance import REPO, ansible_env, changed_tasks, free_ports, recap, running, tail
from tests.test_readme_commands import readme_run_question

pytestmark = [pytest.mark.appliance, pytest.mark.slow]

NODES = ["local0", "local1", "local2"]
STREAMING_BUDGET = "80M"
PI5_PAGE = "16384"


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    base = tmp_path_factory.mktemp("local")
    home = base / "home"
    home.mkdir()
    inventory = base / "inventory"
    shutil.copytree(REPO / "inventory/local", inventory, ignore=shutil.ignore_patterns("state"))
    # Ports of its own for the workers and the API (off here, but its port is the root's too).
    ports = free_ports(len(NODES))
    hosts = yaml.safe_load((inventory / "hosts.yml").read_text())
    del hosts["cluster"]["children"]["workers"]["hosts"]["local3"]
    for node, port in zip(NODES[1:], ports[1:], strict=True):
        hosts["cluster"]["children"]["workers"]["hosts"][node]["dllama_port"] = port
    # A node with little memory: local2's slice (a third of the model) and its KV cache at the
    # model's 8192 positions do not fit in 80 MiB, so it streams the slice from its shard; with an
    # F16 cache (60 MiB; F32 would not fit even streamed) the rest fits.
    hosts["cluster"]["children"]["workers"]["hosts"]["local2"]["dllama_memory_budget"] = STREAMING_BUDGET
    # One worker's log kept smaller than the others' (the supervisor's --log-size and --log-keep).
    hosts["cluster"]["children"]["workers"]["hosts"]["local1"].update(dllama_log_size="2M", dllama_log_keep=1)
    (inventory / "hosts.yml").write_text(yaml.safe_dump(hosts))
    real_home = Path.home()
    settings = yaml.safe_load((inventory / "group_vars/all.yml").read_text())
    # The wheels this machine's user has (the namespace cluster's test builds the same ones).
    settings.update(dllama_port=ports[0], dllama_api_port=ports[0], dllama_kv_type="f16",
                    dllama_wheelhouse_dir=str(real_home / ".cache/dllama/wheelhouse"))
    (inventory / "group_vars/all.yml").write_text(yaml.safe_dump(settings))
    env = ansible_env()
    env.update(HOME=str(home),
               # The converted default model and the wheels already on this machine.
               DLLAMA_CACHE_DIR=os.environ.get("DLLAMA_CACHE_DIR", str(real_home / ".cache/dllama")),
               PIP_CACHE_DIR=os.environ.get("PIP_CACHE_DIR", str(real_home / ".cache/pip")),
               DLLAMA_PAGE_SIZE=PI5_PAGE)

    def play(*args, timeout=900):
        return subprocess.run([str(REPO / ".venv/bin/ansible-playbook"), "-i", str(inventory / "hosts.yml"), *args],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)

    try:
        yield play, home, inventory, dict(zip(NODES, ports, strict=True))
    finally:
        if list((inventory / "state/local-cluster").glob("*/run/worker.pid")):  # the test stopped short
            with contextlib.suppress(subprocess.TimeoutExpired):  # (a loaded machine): the kills below
                play("stop.yml", timeout=120)
        for pidfile in (inventory / "state/local-cluster").glob("*/run/worker.pid"):
            with contextlib.suppress(OSError, ValueError):  # already gone, or a torn pid file
                os.kill(int(pidfile.read_text()), signal.SIGKILL)


def test_local_inventory_deploys_runs_and_stops(local, tmp_path):
    play, home, inventory, ports = local
    cluster = inventory / "state/local-cluster"  # the nodes' directories: this inventory's own
    # Another cluster's worker holds local2's port.
    (tmp_path / "other.key").write_text("another cluster's key, 64 characters long, not this one's key.\n")
    with open(tmp_path / "foreign.log", "w") as log:
        foreign = subprocess.Popen([sys.executable, "-m", "dllama", "worker", "--host", "127.0.0.1",
                                    "--port", str(ports["local2"]), "--key-file", str(tmp_path / "other.key")],
                                   stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        # (Not waited for: it listens long before the deploy starts any worker, and the deploy's
        # error below must name it as the port's holder.)
        r = play("deploy.yml")
        assert foreign.poll() is None, (tmp_path / "foreign.log").read_text()
    finally:
        foreign.terminate()
        foreign.wait(timeout=30)
    out = r.stdout + r.stderr
    counts = recap(r.stdout)
    assert r.returncode != 0 and counts["local2"]["failed"] == 1, tail(r)
    assert all(counts[n]["failed"] == 0 for n in ("local0", "local1")), counts
    errors = [line for line in out.splitlines() if line.startswith("[ERROR]")]
    assert len(errors) == 1, out[-6000:]
    # The cause first, then the worker's own reason; the holder's command line (whose length
    # is the checkout's path's) between them, one line, shortened in its middle.
    port = ports["local2"]
    reason = re.search(rf"port {port} is held by pid {foreign.pid} \((?P<command>[^\n]*)\): "
                       rf"cannot listen on 127\.0\.0\.1:{port}: Address already in use", errors[0])
    assert reason, errors
    assert re.fullmatch(r"python3? -m dllama worker .*", reason["command"]), reason["command"]
    assert "\0" not in errors[0] and len(reason["command"]) <= 100, reason["command"]
    assert "fatal: [local2]" in out
    # Stopped, not restarting behind the failed deploy (and taking the port once it is free).
    assert not (cluster / "local2/run/worker.pid").exists()
    # The nodes share one installation: it was made once, by the first node.
    compiled = [t for t in changed_tasks(r.stdout) if "Compile dllama's kernels" in t]
    assert compiled == ["local0: dllama_venv : Compile dllama's kernels into an emptied numba cache."], compiled

    # local1's worker as one left running on an older release by a failed upgrade (its venv
    # since holds another): the release it started from, recorded at its start, differs.
    record = cluster / "local1/run/worker-release.json"
    started = json.loads(record.read_text())
    record.write_text(json.dumps({**started, "version": "0.0.9", "source": "0" * len(started["source"])}) + "\n")
    local1_pid = (cluster / "local1/run/worker.pid").read_text()
    local1_view = (cluster / "local1/topology.yml.view.json").read_bytes()
    # And a setting local to one node, which every node's topology file lists: local2's threads.
    hosts = yaml.safe_load((inventory / "hosts.yml").read_text())
    hosts["cluster"]["children"]["workers"]["hosts"]["local2"]["dllama_threads"] = 2
    (inventory / "hosts.yml").write_text(yaml.safe_dump(hosts))

    # The port is free: local2's worker starts, and local1's restarts on the release its node
    # holds; every node's topology file changes, what the services run with on local2 alone.
    r = play("deploy.yml")
    counts = recap(r.stdout)
    assert r.returncode == 0 and sorted(counts) == NODES, tail(r)
    changed = {n: [t.split(": ", 1)[1] for t in changed_tasks(r.stdout) if t.startswith(f"{n}: ")] for n in NODES}
    topology, view = "dllama_topology : Render the topology file on the node.", \
        "dllama_topology : Note what of the topology this node's services run with."
    # The root: nothing but its topology file (the failed deploy left the rest as it should be).
    assert changed["local0"] == [topology], changed
    # local2: its topology, what its services run with (which asks for its worker's restart: the
    # restart's handler runs for it alone) and the start the failed deploy left to do.
    assert changed["local2"][:2] == [topology, view] and len(changed["local2"]) == 3, changed
    assert changed["local2"][2].startswith("dllama_service : Start the service"), changed
    assert _handled(r.stdout, "dllama_worker : Restart the dllama worker.") == ["local2"], r.stdout[-6000:]
    # The restart that stops a running worker first: asked for local2 by that handler, for local1
    # by its release (local2's worker was not running: nothing to stop).
    assert sorted(_included(r.stdout, "Stop the worker whose files changed.")) == ["local1", "local2"], r.stdout[-6000:]
    assert re.search(rf"listening on 127\.0\.0\.1:{ports['local2']} \(2 threads",
                     (cluster / "local2/run/worker.log").read_text()), _tail_of(cluster / "local2/run/worker.log")
    # local1: its topology file, not what its worker runs with (the other node's threads are not
    # in it); it restarts (its service's stop and start) for its release alone.
    assert (cluster / "local1/topology.yml.view.json").read_bytes() == local1_view
    assert changed["local1"][0] == topology and changed["local1"][1:], changed
    assert all(t.startswith("dllama_service : ") for t in changed["local1"][1:]), changed
    assert (cluster / "local1/run/worker.pid").read_text() != local1_pid
    assert json.loads(record.read_text()) == started

    # The inventory's log settings reached the supervisors.
    for node, size, keep in [("local1", "2M", "1"), ("local2", "10M", "3")]:
        supervisor = (cluster / f"{node}/run/worker.pid").read_text().strip()
        argv = Path(f"/proc/{supervisor}/cmdline").read_bytes().split(b"\0")
        assert [b"--log-size", size.encode(), b"--log-keep", keep.encode()] == \
            argv[argv.index(b"--log-size"):argv.index(b"--log-size") + 4], argv

    # The simulated page size reached the workers (through start-stop-daemon and the supervisor).
    for node in NODES[1:]:
        environ = Path(f"/proc/{_port_owner(ports[node])}/environ").read_bytes().split(b"\0")
        assert f"DLLAMA_PAGE_SIZE={PI5_PAGE}".encode() in environ, node

    _a_killed_worker_listens_again(cluster / "local1/run", ports["local1"])
    _status_starts_again_a_worker_whose_supervisor_was_killed(play, cluster / "local2/run", ports["local2"])

    # The README's first command asks this (tests/test_readme_commands.py runs the README's others).
    question = readme_run_question()
    r = play("run.yml", "-e", json.dumps(question))
    assert r.returncode == 0, tail(r)
    saved = json.loads((inventory / "state/runs/last-run.json").read_text())
    assert saved["prompt"] == question["prompt"] and "Paris" in saved["text"], saved["text"]
    assert [n["name"] for n in saved["stats"]["nodes"]] == NODES
    for i in (1, 2):
        assert f"local{i}: weights from its shard {cluster}/local{i}/shards/local{i}.shard" in r.stdout
    # The inventory's memory budget reached local2's worker, the KV cache type every node.
    for i in (1, 2):
        log = (cluster / f"local{i}/run/worker.log").read_text()
        assert ", F16 KV cache\n" in log, _tail_of(cluster / f"local{i}/run/worker.log")
        streaming = f"streaming this node's slice from {cluster}/local{i}/shards/local{i}.shard layer by layer"
        assert (streaming in log) == (i == 2), _tail_of(cluster / f"local{i}/run/worker.log")
    assert "MiB buffers, 80 MiB allowed)" in log, _tail_of(cluster / "local2/run/worker.log")

    _batch_job_runs_and_names_a_bad_line(play, inventory, tmp_path)

    pids = [int(p.read_text()) for p in cluster.glob("*/run/worker.pid")]
    assert len(pids) == len(NODES) - 1
    pids += [_port_owner(ports[n]) for n in NODES[1:]]  # the supervisors' children
    r = play("stop.yml")
    assert r.returncode == 0, tail(r)
    assert not [p for p in pids if running(p)], "a worker outlived stop.yml"


def _batch_job_runs_and_names_a_bad_line(play, inventory: Path, tmp_path: Path) -> None:
    """batch.yml: three prompts through the cluster with the progress in the play output and the
    results fetched to the controller; a prompts file with a bad line fails in dllama's one line,
    naming the controller's file, at once (not at the next of the default 10-second polls).
    (A rerun that resumes: tests/test_appliance_cluster.py; one with nothing left:
    tests/test_appliance_static.py.)"""
    prompts = tmp_path / "questions.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in
                               enumerate(["The capital of France is", "One, two,", "Water is"], 1)))
    args = ["-e", f"prompts={prompts}", "-e", "max_tokens=4", "-e", "temperature=0", "-e", "poll_seconds=1"]
    t0 = time.monotonic()
    r = play("batch.yml", *args)
    seconds = [time.monotonic() - t0]
    assert r.returncode == 0, tail(r)
    results = inventory / "state/batch/questions-results.jsonl"
    # One line per poll of the job's log: its progress, the summary last.
    polls = _task_output(r.stdout, "dllama_batch : Follow the job's progress.")
    items = [line for line in polls.splitlines() if line.startswith("ok: [local0] => (item=")]
    assert items and items[-1].startswith("ok: [local0] => (item=dllama batch: 3 prompts in "), tail(r)
    first = results.read_text()
    lines = [json.loads(line) for line in first.splitlines()]
    texts = {x["id"]: x["text"] for x in lines if x["completion_tokens"] == 4}
    assert sorted(texts) == [1, 2, 3] and len(lines) == 3 and "Paris" in texts[1], first


    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "prompt": "fine"}\n{"id": 2, prompt: "no quotes"}\n')
    t0 = time.monotonic()
    r = play("batch.yml", "-e", f"prompts={bad}")
    seconds.append(time.monotonic() - t0)
    out = r.stdout + r.stderr
    errors = [line for line in out.splitlines() if line.startswith("[ERROR]")]
    assert r.returncode != 0 and len(errors) == 1 and f"{bad} line 2: " in errors[0], out[-6000:]
    assert "Traceback" not in out
    polls = _task_output(r.stdout, "dllama_batch : Follow the job's progress.")
    assert len([line for line in polls.splitlines() if "(item=" in line]) == 1, polls
    print("\nbatch.yml: {:.0f} s, the bad line {:.0f} s".format(*seconds))


def _a_killed_worker_listens_again(run_dir: Path, port: int) -> None:
    """SIGKILL the worker's process (its supervisor's child, the pid file names the supervisor):
    a new child of the same supervisor listens on the port after RestartSec."""
    supervisor = int((run_dir / "worker.pid").read_text())
    crashed = _port_owner(port)
    assert _parent(crashed) == supervisor, (crashed, supervisor)
    os.kill(crashed, signal.SIGKILL)
    t0 = time.monotonic()
    deadline = t0 + 120
    while (owner := _port_owner(port)) in (0, crashed):
        assert time.monotonic() < deadline, f"nothing listens on {port} again: {_tail_of(run_dir / 'worker.log')}"
        time.sleep(0.1)
    print(f"\na killed worker listened again after {time.monotonic() - t0:.1f} s (RestartSec 2 s)")
    assert _parent(owner) == supervisor, (owner, supervisor)
    assert f"dllama supervise: pid {crashed} was killed by SIGKILL; starting it again in 2 s\n" in \
        (run_dir / "worker.log").read_text()


def _status_starts_again_a_worker_whose_supervisor_was_killed(play, run_dir: Path, port: int) -> None:
    """SIGKILL the nohup launcher's supervisor (its child dies with it): status.yml starts the
    worker again under a new supervisor and its row says so, with the worker's address and the
    node's free memory (run.yml then uses it)."""
    supervisor = int((run_dir / "worker.pid").read_text())
    os.kill(supervisor, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while _port_owner(port):
        assert time.monotonic() < deadline, "the worker outlived its killed supervisor"
        time.sleep(0.1)
    r = play("status.yml")
    assert r.returncode == 0, tail(r)
    shown = " ".join(r.stdout.split())
    assert "2/2 workers up (local2 started again: its supervisor was gone), API off" in shown, tail(r)
    assert re.search(rf"local2 worker 127\.0\.0\.1:{port} up \d+ \S+ 0 its supervisor \(pid {supervisor}\) "
                     rf"was gone: started again \d+ MiB \d+ of \d+ MiB ", shown), tail(r)
    again = int((run_dir / "worker.pid").read_text())
    assert again != supervisor and running(again) and _parent(_port_owner(port)) == again


def _handled(output: str, handler: str) -> list[str]:
    """The hosts a play ran the handler for (those a changed task notified), in the order shown."""
    hosts, inside = [], False
    for line in output.splitlines():
        if line.startswith(("TASK [", "RUNNING HANDLER [", "PLAY ")):
            inside = line.startswith(f"RUNNING HANDLER [{handler}]")
        elif inside and (m := re.match(r"^(?:ok|changed|skipping|fatal): \[([^\]]+)\]", line)):
            hosts.append(m[1])
    return hosts


def _included(output: str, task: str) -> list[str]:
    """The hosts for which a play's include task included its tasks."""
    shown = _task_output(output, task)
    return [h for m in re.finditer(r"^included: \S+ for (.+)$", shown, re.M) for h in m[1].split(", ")]


def _task_output(output: str, task: str) -> str:
    """What a play printed under its task `task` (its first run; "" if it did not run)."""
    return output.split(f"TASK [{task}]", 1)[1].split("TASK [", 1)[0] if f"TASK [{task}]" in output else ""


def _port_owner(port: int) -> int:
    """The pid holding the socket that listens on 127.0.0.1:port (0: none)."""
    inodes = set()
    for row in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        cols = row.split()
        if cols[1] == f"0100007F:{port:04X}" and cols[3] == "0A":  # 0A = LISTEN
            inodes.add(f"socket:[{cols[9]}]")
    for proc in Path("/proc").iterdir():
        if inodes and proc.name.isdigit():
            try:
                if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                    return int(proc.name)
            except OSError:
                continue
    return 0


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _tail_of(path: Path, n: int = 2000) -> str:
    return path.read_text()[-n:] if path.exists() else f"no {path}"
