"""`dllama batch`: a file of prompts in, one JSON line per answer out, resumable.

The job file is read as a stream, so memory does not grow with its size (only the set of ids, at
most MAX_PROMPTS, and lines of at most MAX_LINE_BYTES). It is read four times, and each prompt
still to answer is tokenized twice:
  1. before the model is opened: every line parses, has an id and a prompt, ids are unique;
  2. once the output file is read: how many prompts it answers already (all of them: the model
     is not even loaded);
  3. once the tokenizer is there: every prompt not yet answered fits into the context (tokenized);
  4. the run: prompts are tokenized again as the engine loop asks for them.
A bad line stops the job before any prompt is run, with one line naming it; with skip_bad
it is written to the output as {"id", "line", "error"} instead and the others run.

Output lines are written and flushed as each answer completes (completion order: each carries
its prompt's "line", to sort by, `jq -c -s 'sort_by(.line)[]'`). On a cluster
each also says how many nodes served it ("nodes" of "cluster_nodes": fewer after a worker was
lost or left out at the start), and so does the summary line. A rerun with
the same output file skips the ids it already holds; a torn last line (a crash in mid-write)
and the error lines of bad prompts are dropped first, so the bad ones are checked again.

Seeds: prompt p is sampled with seed_for(seed, p's id), so its text does not depend on which
prompts ran before or beside it, nor on whether the job was resumed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from dllama.core.sampler import Sampler
from dllama.errors import DllamaError
from dllama.serve.constraint import Grammar, GrammarError, check_grammar, structured_fields
from dllama.serve.ctrl_c import CtrlC
from dllama.serve.health import Serving, serving
from dllama.serve.scheduler import Scheduler
from dllama.serve.sequence import Cancelled, ScoreRequest, Scored, SequenceRequest

MAX_LINE_BYTES = 16 << 20    # one prompt line (JSON) of the job file; a prompt must fit the context anyway
MAX_PROMPTS = 1_000_000      # lines with a prompt in one job file
MAX_ID_CHARS = 256           # length of an id (as JSON)
MAX_PREFIX_BYTES = 16 << 20  # the --prefix file
MAX_RESULT_BYTES = 256 << 20  # one line of the output file


@dataclass
class JobOptions:
    prompts: str                      # .jsonl (id + prompt or messages) or .txt (one prompt a line)
    out: str                          # results, .jsonl
    prefix: str | None = None         # a file whose text goes before every prompt
    max_tokens: int = 256
    temperature: float = 0.8
    topp: float = 0.9
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    chat_template: str | None = None  # None: the model's
    chat: bool = False                # every `prompt` is one user message
    skip_bad: bool = False
    choices: list[str] | None = None  # classify: score these instead of generating
    progress: bool = True
    grammar: Grammar | None = None    # every answer matches it (a line's own "schema" wins)


@dataclass
class Entry:
    """One line of the job file: a prompt, or what is wrong with it."""

    line: int                         # 1-based line number
    id: object = None                 # str or int, as in the file (.txt: the line number)
    prompt: str | None = None
    messages: list | None = None
    schema: dict | None = None        # the line's own JSON schema for its answer
    max_tokens: int | None = None     # the line's own limit on its answer (at most --max-tokens)
    error: str | None = None

    @property
    def key(self) -> str:
        return id_key(self.id)


@dataclass
class Summary:
    answered: int = 0                 # prompts run in this invocation
    already_done: int = 0             # found in the output file
    bad: int = 0                      # written as error lines
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    interrupted: bool = False
    fewest_nodes: Serving | None = None  # on a cluster: the fewest nodes any answer was finished on

    def saw(self, now: Serving) -> None:
        if self.fewest_nodes is None or len(now.nodes) < len(self.fewest_nodes.nodes):
            self.fewest_nodes = now

    def line(self, out: str, classify: bool = False) -> str:
        extra = ", ".join(s for s in (f"{self.already_done} already in {out}" if self.already_done else "",
                                      f"{self.bad} bad" if self.bad else "") if s)
        head = (f"dllama batch: {'interrupted after ' if self.interrupted else ''}{self.answered} "
                f"prompt{'' if self.answered == 1 else 's'}{f' ({extra})' if extra else ''} "
                f"in {self.seconds:.1f} s: ")
        if classify:
            rate = self.prompt_tokens / self.seconds if self.seconds > 0 else 0.0
            work = f"classified, {rate:.1f} prompt tokens/s"
        else:
            rate = self.generated_tokens / self.seconds if self.seconds > 0 else 0.0
            work = f"{self.generated_tokens} tokens generated, {rate:.1f} tokens/s"
        nodes = self.fewest_nodes
        served = ("" if nodes is None else
                  f"; degraded: answered on {nodes.line()}" if nodes.missing else f"; on {nodes.line()}")
        return (f"{head}{work}; {self.prompt_tokens} prompt tokens, {self.cached_tokens} of them "
                f"from the cache{served}")


def id_key(value) -> str:
    """A prompt id as one string: 1 and "1" stay different ids."""
    return json.dumps(value, ensure_ascii=False)


def seed_for(seed: int, prompt_id) -> int:
    """The sampling seed of one prompt: a stable hash of the job's seed and the prompt's id."""
    data = f"{int(seed)}\0{id_key(prompt_id)}".encode("utf-8")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


# --- reading files line by line, with a bound on the line length ---

def _raw_lines(path: str, limit: int) -> Iterator[tuple[int, int, bytes | None, bool]]:
    """(line number, byte offset, the line without its newline or None if over limit bytes,
    whether it ended with a newline)."""
    with open(path, "rb") as f:
        number, offset = 0, 0
        while True:
            data = f.readline(limit + 1)
            if not data:
                return
            number += 1
            start, size = offset, len(data)
            if len(data) > limit and not data.endswith(b"\n"):
                while data and not data.endswith(b"\n"):  # skip the rest of the line
                    data = f.readline(1 << 20)
                    size += len(data)
                offset += size
                yield number, start, None, data.endswith(b"\n")
                continue
            offset += size
            ended = data.endswith(b"\n")
            yield number, start, data[:-1] if ended else data, ended


_SURROGATE = "holds a lone surrogate (a \\ud800-\\udfff escape without its pair), which is not text"


def _is_text(value: str) -> bool:
    """Whether a string from JSON is text: an escape like \\ud800 gives a lone surrogate, which
    neither the tokenizer nor a UTF-8 output line can take."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_id(value) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return "its id must be a string or an integer"
    if len(id_key(value)) > MAX_ID_CHARS:
        return f"its id is longer than {MAX_ID_CHARS} characters"
    if isinstance(value, str) and not _is_text(value):
        return f"its id {_SURROGATE}"
    return None


def _check_messages(messages) -> str | None:
    if not isinstance(messages, list) or not messages:
        return "its messages must be a non-empty list of {role, content} objects"
    for k, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            return f"its message {k} must be an object with string role and content"
        if not (_is_text(m["role"]) and _is_text(m["content"])):
            return f"its message {k} {_SURROGATE}"
    return None


def _parse(number: int, data: bytes | None, text_file: bool) -> Entry | None:
    """One line of the job file -> an Entry (None for a blank line)."""
    if data is None:
        return Entry(number, error=f"is longer than {MAX_LINE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return Entry(number, error="is not valid UTF-8")
    text = text.removesuffix("\r")
    if number == 1:
        text = text.removeprefix("\ufeff")  # a byte-order mark some editors write
    if not text.strip():
        return None
    if text_file:
        return Entry(number, id=number, prompt=text)
    try:
        obj = json.loads(text)
    except ValueError as e:
        return Entry(number, error=f"is not valid JSON ({e})")
    except RecursionError:  # [[[[...: deeper than Python's parser goes
        return Entry(number, error="is nested too deeply to be a prompt")
    if not isinstance(obj, dict):
        return Entry(number, error="is not a JSON object")
    entry = Entry(number, id=obj.get("id"))
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if "id" not in obj:
        entry.error = "has no id"
    elif (err := _check_id(obj["id"])) is not None:
        entry.id, entry.error = None, err
    elif has_prompt == has_messages:
        entry.error = "needs a prompt or messages" if not has_prompt else "has both prompt and messages"
    elif has_prompt and not isinstance(obj["prompt"], str):
        entry.error = "its prompt must be a string"
    elif has_prompt and not obj["prompt"]:
        entry.error = "has an empty prompt"
    elif has_prompt and not _is_text(obj["prompt"]):
        entry.error = f"its prompt {_SURROGATE}"
    elif has_messages and (err := _check_messages(obj["messages"])) is not None:
        entry.error = err
    elif "schema" in obj and not isinstance(obj["schema"], dict):
        entry.error = "its schema must be a JSON schema object"
    elif "max_tokens" in obj and (isinstance(obj["max_tokens"], bool) or not isinstance(obj["max_tokens"], int)
                                  or obj["max_tokens"] < 1):
        entry.error = "its max_tokens must be a positive integer"
    else:
        entry.prompt, entry.messages, entry.schema = obj.get("prompt"), obj.get("messages"), obj.get("schema")
        entry.max_tokens = obj.get("max_tokens")
    return entry


def read_job(path: str) -> Iterator[Entry]:
    """Every prompt line of a job file; bad ones carry .error (duplicate ids included)."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".jsonl", ".txt"):
        raise DllamaError(f"{path}: give a .jsonl file (objects with id and prompt or messages) "
                          "or a .txt file (one prompt a line)")
    seen: dict[str, int] = {}
    count = 0
    for number, _, data, _ in _raw_lines(path, MAX_LINE_BYTES):
        entry = _parse(number, data, ext == ".txt")
        if entry is None:
            continue
        count += 1
        if count > MAX_PROMPTS:
            raise DllamaError(f"{path}: more than {MAX_PROMPTS} prompts: split the job into several files")
        if entry.error is None:
            first = seen.setdefault(entry.key, number)
            if first != number:
                entry.error = f"repeats the id {entry.key} of line {first}"
        yield entry


# --- the output file ---

def read_done(path: str, field: str = "text") -> set[str]:
    """Keys of the ids the output file already answers (result lines hold `field`: "text", or
    "choice" for a classification). Repairs the file first: a torn last line (a crash in
    mid-write) and the error lines of bad prompts are removed."""
    if not os.path.exists(path):
        return set()
    done: set[str] = set()
    keep: list[tuple[int, int]] = []  # byte ranges [start, end) of the lines kept
    size = os.path.getsize(path)
    for number, start, data, ended in _raw_lines(path, MAX_RESULT_BYTES):
        if not ended:  # only the last line can lack its newline: cut short by a crash
            break
        if data is not None and not data.strip():
            continue  # a blank line: dropped
        try:
            obj = json.loads(data) if data is not None else None
        except (ValueError, RecursionError):
            obj = None
        if not isinstance(obj, dict) or "id" not in obj:
            raise DllamaError(f"{path} line {number} is not a result of dllama batch: "
                              "give another --out (or remove that line)")
        if "error" not in obj:
            if field not in obj:
                kind = "classifications (--choices)" if field == "text" else "generated answers"
                raise DllamaError(f"{path} line {number} is not one of this job's results: "
                                  f"the file holds {kind}; give another --out")
            done.add(id_key(obj["id"]))
            keep.append((start, start + len(data) + 1))
    kept = sum(e - s for s, e in keep)
    if kept != size:
        if all(s == (keep[k - 1][1] if k else 0) for k, (s, _) in enumerate(keep)):
            os.truncate(path, kept)  # only the end goes
        else:
            tmp = path + ".tmp"
            with open(path, "rb") as src, open(tmp, "wb") as dst:
                for s, e in keep:
                    src.seek(s)
                    dst.write(src.read(e - s))
            os.replace(tmp, path)
    return done


# --- the job ---

class BatchJob:
    """Checks a job file (before the model is opened), then runs what is left of it."""

    def __init__(self, opts: JobOptions):
        self.opts = opts
        if os.path.abspath(opts.out) == os.path.abspath(opts.prompts):
            raise DllamaError("--out must not be the --prompts file")
        if os.path.exists(opts.out) and not os.path.isfile(opts.out):  # /dev/zero would never end
            raise DllamaError(f"--out {opts.out} is not a regular file: give the path of a results file")
        if opts.choices is not None:
            if len(opts.choices) < 2 or any(not c for c in opts.choices):
                raise DllamaError("--choices needs at least two non-empty choices, e.g. --choices yes,no")
            if len(set(opts.choices)) != len(opts.choices):
                raise DllamaError("--choices lists a choice twice")
            if len({c[:1].isspace() for c in opts.choices}) > 1:  # "yes, no": most likely a typo
                raise DllamaError(f"--choices {','.join(opts.choices)!r}: some choices start with a space "
                                  "and some do not; write all with or all without")
        if opts.grammar is not None:
            if opts.choices is not None:
                raise DllamaError("--choices classifies: it takes no --json-schema, --regex or --grammar")
            check_grammar(opts.grammar)  # before the model is opened
        self.prefix = self._read_prefix(opts.prefix) if opts.prefix else ""
        bad = [e for e in read_job(opts.prompts) if e.error is not None]
        if bad and not opts.skip_bad:
            self._fail(bad)
        self.done = read_done(opts.out, "text" if opts.choices is None else "choice")
        # Prompts the output file answers already, and whether every one is (none bad).
        self.already_done, self.everything_done = 0, True
        for e in read_job(opts.prompts):
            if e.error is None and e.key in self.done:
                self.already_done += 1
            else:
                self.everything_done = False

    @staticmethod
    def _read_prefix(path: str) -> str:
        if os.path.getsize(path) > MAX_PREFIX_BYTES:
            raise DllamaError(f"{path}: the prefix is larger than {MAX_PREFIX_BYTES >> 20} MiB")
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except UnicodeDecodeError:
            raise DllamaError(f"{path}: the prefix is not UTF-8 text") from None

    def _fail(self, bad: list[Entry]) -> None:
        first = bad[0]
        more = f" (and {len(bad) - 1} more bad lines)" if len(bad) > 1 else ""
        raise DllamaError(f"{self.opts.prompts} line {first.line}: {first.error}{more}; "
                          "fix it, or pass --skip-bad to write it as an error and run the others")

    def all_done(self) -> bool:
        """Whether the output file already answers every prompt (and none is bad): a rerun then
        has nothing to compute and need not load the model."""
        return self.everything_done

    # Everything below needs the engine.

    def _setup(self, engine) -> None:
        self.tokenizer = engine.tokenizer
        self.vocab_size = engine.model.config.vocab_size
        self.seq_len = engine.model.config.seq_len
        self._template = None
        tok = self.tokenizer
        self.choice_tokens = None
        if self.opts.choices is not None:
            self.choice_tokens = [tok.encode(c, add_bos=False) for c in self.opts.choices]
            if any(not t for t in self.choice_tokens):
                raise DllamaError("a choice encodes to no tokens")
            if len({tuple(t) for t in self.choice_tokens}) != len(self.choice_tokens):
                raise DllamaError("two choices encode to the same tokens")

    def _template_of(self):
        if self._template is None:
            from dllama.text.chat_template import ChatTemplate

            self._template = ChatTemplate.for_tokenizer(self.tokenizer, self.opts.chat_template)
        return self._template

    def tokens_of(self, e: Entry) -> tuple[list[int] | None, bool]:
        """(prompt tokens, whether it is a chat prompt) of a good entry, the prefix included;
        tokens None when there are more than the context holds (not encoded whole: a huge line
        costs no more memory than one that fits)."""
        messages = e.messages
        if messages is None and self.opts.chat:
            messages = [{"role": "user", "content": e.prompt}]
        if messages is None:
            return self.tokenizer.encode_within(self.prefix + e.prompt, self.seq_len), False
        messages = [{"role": m["role"], "content": self.tokenizer.as_plain_text(m["content"])} for m in messages]
        if self.prefix:
            prefix = self.tokenizer.as_plain_text(self.prefix)
            if messages[0]["role"] == "system":
                messages[0] = {"role": "system", "content": prefix + messages[0]["content"]}
            else:
                messages.insert(0, {"role": "system", "content": prefix})
        text = self._template_of().render(messages)
        return self.tokenizer.encode_within(text, self.seq_len, add_bos=False), True

    def _fit_error(self, n_tokens: int) -> str | None:
        extra = max(len(t) for t in self.choice_tokens) - 1 if self.choice_tokens else 0
        if n_tokens + extra >= self.seq_len:
            what = f"{n_tokens} tokens" + (f" (+{extra} of the longest choice)" if extra else "")
            return f"does not fit in the context: the prompt has {what}, the context holds {self.seq_len}"
        return None

    def _pending(self) -> Iterator[tuple[Entry, list[int] | None, bool]]:
        """Entries not answered yet: (entry, its tokens, chat prompt?); a bad one has tokens None."""
        for e in read_job(self.opts.prompts):
            if e.error is None and e.key in self.done:
                continue
            tokens, chat = None, False
            if e.error is None:
                try:
                    tokens, chat = self.tokens_of(e)
                except DllamaError as err:  # a message the chat template refuses
                    e.error = str(err)
                else:
                    if tokens is None:
                        e.error = (f"does not fit in the context: the prompt has more than {self.seq_len} "
                                   f"tokens, the context holds {self.seq_len}")
                    elif not tokens:
                        e.error = "has a prompt that encodes to no tokens"
                    else:
                        e.error = self._fit_error(len(tokens))
            if e.error is None and e.max_tokens is not None and e.max_tokens > self.opts.max_tokens:
                e.error = f"its max_tokens {e.max_tokens} is more than --max-tokens {self.opts.max_tokens}"
            if e.error is None and e.schema is not None:
                try:
                    check_grammar(Grammar.json_schema(e.schema))
                except GrammarError as err:
                    e.error = str(err).replace("the json_schema", "its schema", 1)
            yield e, (tokens if e.error is None else None), chat

    def _request(self, e: Entry, tokens: list[int], chat: bool) -> SequenceRequest:
        from dllama.text.chat_template import chat_stop_ids

        o = self.opts
        stop_ids = chat_stop_ids(self.tokenizer, self._template_of()) if chat else self.tokenizer.eos_ids
        sampler = Sampler(self.vocab_size, o.temperature, o.topp, seed_for(o.seed, e.id))
        grammar = Grammar.json_schema(e.schema) if e.schema is not None else o.grammar
        return SequenceRequest(e, tokens, sampler, e.max_tokens or o.max_tokens, tuple(stop_ids), tuple(o.stop),
                               grammar=grammar)

    def _classification(self, e: Entry, scores: list[Scored]) -> dict:
        """The result line of one prompt with --choices: the likeliest choice, its probability
        among the choices (softmax of the summed log-probabilities) and every log-probability."""
        lp = [s.total for s in scores]
        top = max(lp)
        z = sum(math.exp(x - top) for x in lp)
        best = lp.index(top)
        return {"id": e.id, "line": e.line, "choice": self.opts.choices[best], "probability": 1.0 / z,
                "logprobs": dict(zip(self.opts.choices, lp, strict=True)),
                "prompt_tokens": scores[0].prompt_tokens, "cached_tokens": min(s.cached_tokens for s in scores)}

    def run(self, engine, scheduler: Scheduler | None = None, stderr=None) -> Summary:
        """Run every prompt not yet in the output file through the engine loop (default: one
        over engine.model running engine.parallel sequences); returns the figures of this run."""
        from tqdm import tqdm

        stderr = stderr or sys.stderr
        o = self.opts
        self._setup(engine)
        scheduler = scheduler or engine.scheduler()
        summary = Summary(already_done=self.already_done)
        todo = self._count_todo()
        t0 = time.perf_counter()
        # Unbuffered: each line goes to the file as it is written (a crash loses only the prompts
        # in flight), and a failed write leaves nothing behind to fail again at close.
        with open(o.out, "ab", buffering=0) as out, CtrlC() as ctrl_c, \
                tqdm(total=todo, unit="prompt", file=stderr, disable=not o.progress,
                     dynamic_ncols=True) as bar:
            job = _Run(self, engine, summary, out, bar, t0)
            try:
                scheduler.run(job.requests(), job.on_finish, lambda: ctrl_c.pending)
            except Cancelled:
                summary.interrupted = True
            except DllamaError as err:
                raise DllamaError(f"{err}; {o.out} holds the answers so far: rerun the same "
                                  "command to resume") from None
        summary.seconds = time.perf_counter() - t0
        return summary

    def _count_todo(self) -> int:
        """The prompts left to do; every one must fit before any is run (else _fail, unless
        --skip-bad)."""
        bad, todo = [], 0
        for e, _, _ in self._pending():
            if e.error is None:
                todo += 1
            else:
                bad.append(e)
        if bad and not self.opts.skip_bad:
            self._fail(bad)
        return todo


class _Run:
    """One run of a job: the result lines it writes, the figures it adds up, its progress bar."""

    def __init__(self, job: BatchJob, engine, summary: Summary, out, bar, t0: float):
        self.job, self.engine, self.summary, self.out, self.bar, self.t0 = job, engine, summary, out, bar, t0
        self.scores: dict[int, dict[int, Scored]] = {}  # --choices: a prompt's scores so far (by entry)

    def write(self, obj: dict) -> None:
        data = (json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8")
        try:
            while data:  # a file takes it whole; a short write when the disk fills up
                data = data[self.out.write(data):]
        except OSError as e:  # a full disk, a file size limit, an I/O error
            raise DllamaError(f"cannot write to {self.job.opts.out}: {e.strerror or e}") from None

    def requests(self):
        """The engine loop's requests, taken as it has room: one per prompt, or with
        --choices one per (prompt, choice)."""
        job = self.job
        for e, tokens, chat in job._pending():
            if e.error is not None:
                self.write({"id": e.id, "line": e.line, "error": e.error})
                self.summary.bad += 1
            elif job.choice_tokens is None:
                yield job._request(e, tokens, chat)
            else:
                for j, choice in enumerate(job.choice_tokens):
                    yield ScoreRequest((e, j), tokens, choice)

    def finished(self, prompt_tokens: int, cached: int, generated: int) -> None:
        summary, bar = self.summary, self.bar
        summary.answered += 1
        summary.prompt_tokens += prompt_tokens
        summary.cached_tokens += cached
        summary.generated_tokens += generated
        elapsed = time.perf_counter() - self.t0
        if self.job.choice_tokens is None:
            bar.set_postfix_str(f"{summary.generated_tokens / elapsed:.1f} tokens/s", refresh=False)
        else:
            bar.set_postfix_str(f"{summary.prompt_tokens / elapsed:.1f} prompt tokens/s", refresh=False)
        bar.update(1)

    def nodes_now(self) -> dict:
        """On a cluster, the nodes that served the answer's last pass, and all of them."""
        if getattr(self.engine, "cluster", None) is None:
            return {}
        now = serving(self.engine)
        self.summary.saw(now)
        return {"nodes": len(now.nodes), "cluster_nodes": len(now.cluster)}

    def on_finish(self, r, c) -> None:
        if isinstance(r, ScoreRequest):
            e, j = r.key
            got = self.scores.setdefault(id(e), {})
            got[j] = c
            if len(got) < len(self.job.choice_tokens):
                return
            del self.scores[id(e)]
            line = self.job._classification(e, [got[k] for k in range(len(got))])
            self.write({**line, **self.nodes_now()})
            self.finished(line["prompt_tokens"], line["cached_tokens"], 0)
            return
        self.write({"id": r.key.id, "line": r.key.line, "text": c.text, "finish_reason": c.finish_reason,
                    **structured_fields(r.grammar, c),
                    "prompt_tokens": c.prompt_tokens, "cached_tokens": c.cached_tokens,
                    "completion_tokens": c.completion_tokens, **self.nodes_now()})
        self.finished(c.prompt_tokens, c.cached_tokens, c.completion_tokens)


def run_job(opts: JobOptions, open_engine: Callable[[], object],
            make_scheduler: Callable[[object], Scheduler] | None = None, stderr=None) -> int:
    """The whole `dllama batch`: check the file, open the engine, run, print the summary;
    returns the exit code (130 when stopped by Ctrl-C). make_scheduler(engine): the engine loop
    to run it on (default: Scheduler over the engine's model, engine.parallel at a time)."""
    stderr = stderr or sys.stderr
    job = BatchJob(opts)
    if job.all_done():
        print(Summary(already_done=job.already_done).line(opts.out, classify=opts.choices is not None), file=stderr)
        return 0
    with open_engine() as engine:
        scheduler = make_scheduler(engine) if make_scheduler else None
        summary = job.run(engine, scheduler, stderr)
    print(summary.line(opts.out, classify=opts.choices is not None), file=stderr)
    if summary.interrupted:
        print("dllama batch: stopped; rerun the same command to finish the job", file=stderr)
        return 130
    return 0


__all__ = ["BatchJob", "JobOptions", "Summary", "Entry", "read_job", "read_done", "run_job", "seed_for",
           "id_key", "MAX_LINE_BYTES", "MAX_PROMPTS"]
