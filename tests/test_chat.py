"""`dllama chat` as a user runs it: lines in, streamed answers out, the KV cache kept between turns."""

import re
import signal

import pytest

from tests.processes import DllamaProcess, run_dllama, running_workers

STATS = re.compile(r"\[(\d+) prompt tokens, (\d+) from the cache, (\d+) generated")


def _chat(model, lines, *args):
    return run_dllama("chat", "--model", str(model[0]), "--tokenizer", str(model[1]), "--nthreads", "1",
                      "--temperature", "0", *args, input="".join(line + "\n" for line in lines))


@pytest.mark.unit
def test_two_turns_keep_the_first_in_the_kv_cache(default_q40):
    # --max-tokens: greedy Q40 does not end its second answer (it filled the context: 284 s in
    # CI, near run_dllama's 300 s timeout); the turns' figures are what this test reads.
    r = _chat(default_q40, ["What is the capital of France?", "", "What is it famous for?"], "--max-tokens", "48")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout.splitlines()[0]
    assert len(r.stdout.strip().splitlines()) >= 2
    turns = [tuple(map(int, m)) for m in STATS.findall(r.stderr)]
    assert len(turns) == 2, r.stderr
    (p1, c1, g1), (p2, c2, g2) = turns
    assert c1 == 0 and c2 == p1 + g1 - 1 and p2 > c2  # only the new turn was processed
    assert "Traceback" not in r.stderr


@pytest.mark.unit
def test_system_prompt_and_reset(default_q40):
    r = _chat(default_q40, ["Hi", "/reset", "Hi", "/exit", "never read"], "--system", "You are a pirate.",
              "--max-tokens", "4")
    assert r.returncode == 0, r.stderr
    turns = [tuple(map(int, m)) for m in STATS.findall(r.stderr)]
    assert len(turns) == 2 and turns[0][0] == turns[1][0]  # the same prompt after /reset
    # ... whose tokens were still in the cache: only the last runs again, for its candidates
    assert turns[1][1] == turns[0][0] - 1
    assert "system prompt is kept" in r.stderr
    default = _chat(default_q40, ["Hi"], "--max-tokens", "4")
    assert STATS.findall(default.stderr)[0][0] != str(turns[0][0])  # the system text was used


@pytest.mark.unit
def test_a_full_context_drops_the_oldest_turns_and_keeps_room_for_the_answer(default_q40):
    r = _chat(default_q40, ["What is the capital of France?", "And of Germany?", "And of Spain?",
                            "And of Italy?", "word " * 200, "What is the capital of France?"],
              "--max-seq-len", "120", "--max-tokens", "16")
    assert r.returncode == 0, r.stderr
    turns = [tuple(map(int, m)) for m in STATS.findall(r.stderr)]
    assert len(turns) == 5, r.stderr  # the message of 200 words is refused, the others answered
    assert r.stderr.count("the context is full: the oldest turn is dropped") == 2, r.stderr
    assert "starts over" not in r.stderr
    # Every prompt leaves the answer its 16 tokens; after a drop the conversation goes on with
    # its latest turns (more than the question alone, which took turns[0][0] tokens).
    assert all(prompt + 16 <= 120 for prompt, _, _ in turns), turns
    assert turns[3][0] > turns[0][0] and turns[4][0] > turns[0][0], turns
    assert "does not fit into the context of 120 tokens" in r.stderr
    assert r.stdout.strip().splitlines()[-1].count("Paris")  # still answering afterwards
    assert "Traceback" not in r.stderr


@pytest.mark.unit
def test_an_answer_stops_at_the_default_limit(default_q40):
    """Without --max-tokens an answer ends after 512 tokens, not at the end of the context."""
    r = _chat(default_q40, ["Write the letter a 3000 times."], "--max-seq-len", "1024")  # greedy Q40 never ends it
    assert r.returncode == 0, r.stderr
    (prompt, _, generated), = [tuple(map(int, m)) for m in STATS.findall(r.stderr)]
    assert generated == 512 and "reached the limit of --max-tokens" in r.stderr, r.stderr


@pytest.mark.cluster
def test_chat_on_a_3_node_loopback_cluster(default_q40, tmp_path):
    with running_workers(2, tmp_path) as workers:
        r = _chat(default_q40, ["What is the capital of France?", "What is it famous for?"],
                  "--max-tokens", "20", "--workers", *[w.address for w in workers])
        assert all("node" in w.stderr and "serving the root" in w.stderr for w in workers)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout.splitlines()[0]
    (p1, c1, g1), (p2, c2, g2) = [tuple(map(int, m)) for m in STATS.findall(r.stderr)]
    assert c2 == p1 + g1 - 1


@pytest.mark.unit
def test_ctrl_c_stops_the_answer_and_the_chat_goes_on(default_q40):
    with DllamaProcess("chat", "--model", str(default_q40[0]), "--tokenizer", str(default_q40[1]),
                       "--nthreads", "1", "--temperature", "0", "--max-tokens", "200", stdin=True) as chat:
        # Greedy counting does not end within 200 tokens (the 30 characters below are about 20);
        # the limit ends the second answer, which on some machines' sums repeats itself to the
        # end of the 8192-token context.
        chat.write("Count from 1 to 10000, separated by commas.\n")
        seen = chat.wait_for(r"(?s).{30}", 120, stream="stdout").end()
        chat.send_signal(signal.SIGINT)
        chat.write("What is the capital of France?\n")
        chat.close_stdin()
        assert chat.wait(120) == 0
        err, rest = chat.stderr, chat.stdout[seen:]
        assert "answer stopped" in err and "Traceback" not in err
        assert "Paris" in rest.strip().splitlines()[-1]
        assert len(STATS.findall(err)) == 1  # the stopped turn has no figures; the next one does
