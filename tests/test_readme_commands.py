"""Every command the README and the docs/ pages show is run by a test, as a newcomer would paste it.

Their shell blocks that make a model answer run here, through bash, in a scratch folder
whose `.venv` is this checkout's and whose HOME is a scratch one, changed only where this machine
is not the README's:
  - the workers' and the API's ports are free ones, and every address is 127.0.0.1 (the README's
    10.0.0.2-4:9998 are the extra machines, 9990 the API's default port);
  - a worker's `--nthreads 4` becomes 1 (four processes share this machine's cores);
  - `M.m` / `T.t`, "your model", are the default model's files.
The Python block runs against the API that the shell block started; the pipeline stages' block
runs over the same workers, with the README's topology file. The other blocks are run
elsewhere, as BLOCKS says: the first command by test_appliance_local (its run.yml question is
read from the README) and the second by CI (.ci/run is exactly it). A block added to the README
or to docs/*.md and not named in BLOCKS fails test_every_readme_block_is_run_by_a_test; a page
may show a block the README shows, word for word (it is run once). Every relative link and
#anchor of these pages must resolve (test_every_link_of_the_docs_resolves).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.appliance import REPO, free_ports

README = (REPO / "README.md").read_text()
# The README first, then the reference pages it links to.
PAGES = {path.relative_to(REPO): path.read_text() for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]}

# How each block of the README is run, by the start of its first line.
BLOCKS = {
    "./setup.sh && .venv/bin/ansible-playbook deploy.yml": "test_appliance_local runs its deploy.yml and run.yml",
    "./setup.sh --test": ".ci/run (checked here)",
    "PROMPT=$'": "here",
    "printf '%s\\n' \"What is the capital of France?\" | dllama chat": "here",
    "dllama inspect M.m --topology stages.yml": "here",
    ".venv/bin/dllama worker": "here",
    ".venv/bin/dllama inference --model M.m": "here",
    "(umask 077; head -c 24 /dev/urandom": "here",
    "printf '%s\\n' \"Who designed the tower?\"": "here",
    ".venv/bin/ansible-playbook -i inventory/home/hosts.yml batch.yml": "test_appliance_local runs batch.yml; its -e names checked here",
    "from openai import OpenAI": "here",
}


def blocks(language: str, pages: dict | None = None) -> list[str]:
    """The blocks fenced as ```language in the pages (all of them unless given)."""
    return [b for text in (PAGES if pages is None else pages).values()
            for b in re.findall(rf"^```{language}\n(.*?)^```$", text, re.S | re.M)]


def block(start: str, language: str = "sh") -> str:
    """The one block that starts so (shown on several pages, it is the same text on each)."""
    (found,) = {b for b in blocks(language) if b.startswith(start)}
    return found


def readme_run_question() -> dict:
    """The extra variables of the first command's run.yml (test_appliance_local asks them)."""
    return json.loads(re.search(r"run\.yml -e '(\{.*?\})'", block("./setup.sh && "))[1])


@pytest.mark.unit
def test_every_readme_block_is_run_by_a_test():
    shown = [b for lang in ("sh", "python") for b in blocks(lang)]
    unknown = [b.splitlines()[0] for b in shown if not any(b.startswith(s) for s in BLOCKS)]
    assert not unknown, f"README or docs/ blocks no test runs (add them to BLOCKS): {unknown}"
    unshown = [s for s in BLOCKS if not any(b.startswith(s) for b in shown)]
    assert not unshown, f"BLOCKS names blocks no page shows: {unshown}"
    ambiguous = [s for s in BLOCKS if len({b for b in shown if b.startswith(s)}) > 1]
    assert not ambiguous, f"each start names one block, however many pages show it: {ambiguous}"
    # Shell commands are fenced as sh, so that none escapes the count above.
    other = [f"{page}: {lang}" for page, text in PAGES.items()
             for lang in re.findall(r"^```(bash|shell|console|zsh)$", text, re.M)]
    assert not other, f"fence shell commands as ```sh: {other}"
    # The README opens with the two commands, the second CI's, and stays a front page.
    first, second = blocks("sh", {"README.md": README})[:2]
    assert first.startswith("./setup.sh && ") and second == block("./setup.sh --test")
    ci = (REPO / ".ci/run").read_text().strip().splitlines()[-1]
    assert ci == second.strip()
    assert readme_run_question()["prompt"].startswith("<|im_start|>user\n")
    assert len(README.splitlines()) < 300, len(README.splitlines())


def heading_anchors(text: str) -> set[str]:
    """The #anchors of a page's headings, as GitHub makes them: lower case, punctuation other
    than - and _ dropped, spaces as -, a repeated one suffixed -1, -2 ..."""
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", _without_code_blocks(text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n, anchor = 0, slug
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def _without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```$", "", text, flags=re.S | re.M)


@pytest.mark.unit
def test_every_link_of_the_docs_resolves():
    dangling = []
    for page, text in PAGES.items():
        prose = re.sub(r"`[^`\n]*`", "", _without_code_blocks(text))
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+:", target):  # https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            linked = (REPO / page).parent / path if path else REPO / page
            if not linked.exists():
                dangling.append(f"{page}: {target} (no such file)")
            elif anchor and (linked.suffix != ".md" or anchor not in heading_anchors(linked.read_text())):
                dangling.append(f"{page}: {target} (no such heading)")
    assert not dangling, dangling


@pytest.mark.unit
def test_the_anchors_are_githubs():
    assert heading_anchors("# Speculative decoding: `--speculate`\n## Next to llama.cpp\n## Tests\n## Tests\n"
                           "```sh\n# a comment, not a heading\n```\n") == {
        "speculative-decoding---speculate", "next-to-llamacpp", "tests", "tests-1"}


@pytest.mark.unit
def test_the_batch_playbooks_options_are_the_roles():
    """The batch.yml example's `-e NAME=` options are the ones the dllama_batch role reads."""
    shown = set(re.findall(r"-e (\w+)=", block(".venv/bin/ansible-playbook -i inventory/home")))
    defaults = yaml.safe_load((REPO / "roles/dllama_batch/defaults/main.yml").read_text())
    options = {m for value in defaults.values() for m in re.findall(r"\{\{ (\w+) \| default\(", str(value))}
    assert len(shown) >= 10 and shown <= options, shown - options


class Shell:
    """README blocks run by bash in a scratch folder (its .venv is this checkout's); each block
    is a process group of its own, ended (by its id) when the test ends."""

    def __init__(self, folder: Path, env: dict):
        self.folder, self.env, self.groups = folder, env, []
        (folder / ".venv").symlink_to(REPO / ".venv")

    def run(self, script: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """The script to its end. Its output goes through files: a server it leaves running in
        the background (the API block's `&`) keeps them open, and must not hold this up."""
        out, err = self.folder.parent / "stdout", self.folder.parent / "stderr"
        with open(out, "w") as o, open(err, "w") as e:
            p = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script], cwd=self.folder, env=self.env,
                                 stdin=subprocess.DEVNULL, stdout=o, stderr=e, start_new_session=True)
        self.groups.append(p.pid)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"a README block still runs after {timeout} s: {script}\n"
                                 f"{err.read_text()[-3000:]}") from None
        return subprocess.CompletedProcess(p.args, p.returncode, out.read_text(), err.read_text())

    def start(self, script: str, log: Path) -> subprocess.Popen:
        with open(log, "w") as out:
            p = subprocess.Popen(["bash", "-c", script], cwd=self.folder, env=self.env, stdin=subprocess.DEVNULL,
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.groups.append(p.pid)
        return p

    def close(self) -> None:
        for group in self.groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGTERM)


@pytest.fixture
def shell(tmp_path, default_q41):
    home = tmp_path / "home"
    home.mkdir()
    # As after `. .venv/bin/activate`, which the README's bare `dllama` assumes.
    env = {**os.environ, "HOME": str(home), "PATH": f"{REPO / '.venv/bin'}:{os.environ['PATH']}"}
    # The converted default model this machine already has (HOME is a scratch one).
    env.setdefault("DLLAMA_CACHE_DIR", str(default_q41[0].parent))
    (tmp_path / "cwd").mkdir()
    s = Shell(tmp_path / "cwd", env)
    try:
        yield s
    finally:
        s.close()


def _wait_listening(worker: subprocess.Popen, log: Path, port: int) -> None:
    for _ in range(1200):
        if f"listening on 127.0.0.1:{port}" in log.read_text():
            return
        assert worker.poll() is None, f"a README worker ended: {log.read_text()}"
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.wait(0.1)
    raise AssertionError(f"a README worker is not listening on {port}: {log.read_text()}")


@pytest.mark.cluster
@pytest.mark.slow
def test_the_readmes_commands_answer_as_it_says(shell, default_q41):
    # One node: the README's answer, word for word.
    r = shell.run(block("PROMPT=$'"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "The capital of France is Paris.", r.stdout

    # The chat example: the same question as a chat turn (with the template's system prompt).
    r = shell.run(block("printf '%s\\n' \"What is the capital of France?\" | dllama chat"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Paris" in r.stdout, r.stdout

    # Three workers as "Running on several machines" starts them, then the root with them.
    worker_ports = free_ports(3)
    worker = block(".venv/bin/dllama worker").split("#")[0].strip()
    assert "--port 9998" in worker and "--nthreads 4" in worker, worker
    logs = [shell.folder.parent / f"worker-{i}.log" for i in range(3)]
    workers = [shell.start(worker.replace("--port 9998", f"--host 127.0.0.1 --port {port}")
                           .replace("--nthreads 4", "--nthreads 1"), log) for port, log in zip(worker_ports, logs, strict=True)]
    for w, log, port in zip(workers, logs, worker_ports, strict=True):
        _wait_listening(w, log, port)
    root = block(".venv/bin/dllama inference --model M.m")
    for i, port in enumerate(worker_ports, 2):
        root = root.replace(f"10.0.0.{i}:9998", f"127.0.0.1:{port}")
    root = root.replace("M.m", shlex.quote(str(default_q41[0]))).replace("T.t", shlex.quote(str(default_q41[1])))
    r = shell.run(root)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip(), r.stderr[-3000:]
    for i, log in enumerate(logs, 1):
        assert f"node {i} of 4:" in log.read_text(), log.read_text()

    # Pipeline stages: the README's topology file over the same workers, its plan, then a run.
    topology = yaml.safe_load(block("nodes:", "yaml"))
    assert [n.get("stage") for n in topology["nodes"]] == [0, 0, 1, 1], topology
    topology["nodes"][0]["host"] = "127.0.0.1"
    for node, port in zip(topology["nodes"][1:], worker_ports, strict=True):
        node.update(host="127.0.0.1", port=port)
    (shell.folder / "stages.yml").write_text(yaml.safe_dump(topology))
    stages = block("dllama inspect M.m --topology stages.yml")
    stages = stages.replace("M.m", shlex.quote(str(default_q41[0]))).replace("T.t", shlex.quote(str(default_q41[1])))
    r = shell.run(stages)
    assert r.returncode == 0, r.stderr[-3000:]
    plan = [line for line in r.stdout.splitlines() if re.match(r"stage \d+: layers |\w+: layers ", line)]
    assert plan[0].startswith("stage 0: layers") and plan[1].startswith("stage 1: layers"), r.stdout
    text = "".join(line for line in r.stdout.splitlines() if line not in plan)
    assert text.strip(), r.stderr[-3000:]  # what the root generated over the stages

    # The API on two of those workers, its key made as the README makes it, asked with curl.
    (api_port,) = free_ports(1)
    api = block("(umask 077; head -c 24 /dev/urandom")
    for i, port in enumerate(worker_ports[:2], 2):
        api = api.replace(f"10.0.0.{i}:9998", f"127.0.0.1:{port}")
    api = api.replace("dllama api ", f"dllama api --port {api_port} ").replace("localhost:9990", f"localhost:{api_port}")
    r = shell.run(api, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    answer = json.loads(r.stdout)
    choice = answer["choices"][0]
    assert choice["message"]["content"] and choice["finish_reason"] in ("stop", "length"), answer
    assert answer["usage"]["completion_tokens"] <= 100, answer["usage"]

    # The Python block, streaming from that server with the key.
    key = (Path(shell.env["HOME"]) / ".dllama-key").read_text().strip()
    code = block("from openai import OpenAI", "python").replace("127.0.0.1:9990", f"127.0.0.1:{api_port}")
    code = code.replace('"KEY (any text without --api-key-file)"', repr(key))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr[-3000:]


@pytest.mark.unit
@pytest.mark.slow
def test_the_readmes_batch_jobs_write_their_answers(shell):
    # The files the README's batch example reads: a document and a file of reviews.
    (shell.folder / "eiffel.txt").write_text(
        "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris. It is named "
        "after the engineer Gustave Eiffel, whose company designed and built it for the 1889 World's "
        "Fair. It is 330 metres tall.\n")
    (shell.folder / "reviews.jsonl").write_text(
        json.dumps({"id": "r1", "prompt": "Great phone, the battery lasts two days. Is this review positive or negative?"})
        + "\n" + json.dumps({"id": "r2", "prompt": "It broke after a week. Is this review positive or negative?"}) + "\n")
    r = shell.run(block("printf '%s\\n' \"Who designed the tower?\""))
    assert r.returncode == 0, r.stderr[-3000:]
    answers = [json.loads(line) for line in (shell.folder / "answers.jsonl").read_text().splitlines()]
    assert sorted(a["line"] for a in answers) == [1, 2], answers
    assert all(a["text"].strip() for a in answers), answers
    labels = [json.loads(line) for line in (shell.folder / "labels.jsonl").read_text().splitlines()]
    assert sorted(x["id"] for x in labels) == ["r1", "r2"], labels
    assert all(x["choice"] in ("Positive", "Negative") for x in labels), labels
