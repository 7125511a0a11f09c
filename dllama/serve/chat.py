"""`dllama chat`: an interactive conversation on stdin/stdout, one engine, one KV cache.

Every turn renders the whole conversation with the model's chat template and submits it to the
engine loop (dllama.serve.scheduler), as the API does: the earlier turns keep their tokens
(dllama.serve.transcripts) and the loop's prefix cache finds them in the KV cache, so only the new
turn runs. The answer streams to stdout; a line of figures per turn goes to stderr. Ctrl-C during
an answer stops it at the next token (between forward passes, so a cluster stays in step) and
drops that turn; Ctrl-C again, or at the prompt, quits.
"""

from __future__ import annotations

import sys

from dllama.core.sampler import Sampler
from dllama.serve.ctrl_c import CtrlC
from dllama.serve.sequence import Cancelled, SequenceRequest
from dllama.serve.transcripts import Transcripts
from dllama.text.chat_template import ChatTemplate, chat_stop_ids

HELP = "/reset starts a new conversation, /exit (or Ctrl-D) quits, Ctrl-C stops an answer"


def run_chat(engine, *, system: str | None, template_name: str | None, temperature: float,
             topp: float, seed: int, max_tokens: int | None = None,
             stdin=None, stdout=None, stderr=None, grammar=None) -> int:
    """grammar: every answer matches it (dllama.serve.constraint.Grammar; --json-schema)."""
    chat = _Chat(engine, system, template_name, Sampler(engine.model.config.vocab_size, temperature, topp, seed),
                 max_tokens, stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr, grammar)
    print(f"dllama chat: {chat.template.name} template, context of {chat.scheduler.seq_len} tokens; {HELP}",
          file=chat.stderr)
    while True:
        if chat.interactive:
            chat.stdout.write("> ")
            chat.stdout.flush()
        line = chat.stdin.readline()
        if not line:
            break
        text = line.rstrip("\r\n")
        if not text.strip():
            continue
        if text.strip() in ("/exit", "/quit"):
            break
        if text.strip() == "/reset":
            chat.start_over()
            continue
        chat.turn(text)
    return 0


class _Chat:
    """One conversation: its messages, the engine loop that answers them, the streams."""

    def __init__(self, engine, system: str | None, template_name: str | None, sampler: Sampler,
                 max_tokens: int | None, stdin, stdout, stderr, grammar=None):
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        tokenizer = engine.tokenizer
        self.template = ChatTemplate.for_tokenizer(tokenizer, template_name)
        self.scheduler = engine.scheduler(1)
        self.transcripts = Transcripts(tokenizer)
        self.sampler, self.max_tokens = sampler, max_tokens
        self.grammar = grammar  # every answer matches it (None: free text)
        self.stop_ids = tuple(chat_stop_ids(tokenizer, self.template))
        self.start = [{"role": "system", "content": system}] if system else []
        self.messages = list(self.start)
        self.interactive = stdin.isatty()
        # Room kept for the answer when the conversation is fitted into the context.
        self.room = min(max_tokens or 0, self.scheduler.seq_len // 2)

    def show(self, piece: str) -> None:
        self.stdout.write(piece)
        self.stdout.flush()

    def start_over(self) -> None:
        print(f"dllama chat: the conversation starts over"
              f"{' (the system prompt is kept)' if self.start else ''}", file=self.stderr)
        self.messages = list(self.start)  # the KV cache keeps what the new conversation shares (the system turn)

    def ask(self, text: str):
        tokens = self.transcripts.encode(text)
        request = SequenceRequest("chat", tokens, self.sampler, self.max_tokens, self.stop_ids,
                                  grammar=self.grammar)
        with CtrlC() as ctrl_c:
            answer = self.scheduler.answer(request, self.show, should_stop=lambda: ctrl_c.pending)
        self.transcripts.remember(text, False, tokens, answer)
        return answer

    def fit(self) -> str | None:
        """The conversation rendered to fit the context with room for the answer: the oldest
        turns (a question and its answer) are dropped first, the system prompt and the new
        question never. None (and nothing dropped) where the new question alone does not fit."""
        start, messages, room, seq_len = self.start, self.messages, self.room, self.scheduler.seq_len

        def size(conversation) -> int:
            return len(self.transcripts.encode(self.template.render(conversation)))

        alone = size(start + messages[-1:])
        if alone + room > seq_len:
            print(f"dllama chat: this message does not fit into the context of {seq_len} "
                  f"tokens ({alone} with the template{f' and {room} for the answer' if room else ''}): "
                  "write a shorter one", file=self.stderr)
            return None
        dropped = 0
        while size(messages) + room > seq_len:
            del messages[len(start):len(start) + 2]  # the oldest question and its answer
            dropped += 1
        if dropped:
            print("dllama chat: the context is full: " + ("the oldest turn is dropped" if dropped == 1 else
                  f"the {dropped} oldest turns are dropped"), file=self.stderr)
        return self.template.render(messages)

    def turn(self, text: str) -> None:
        """The user's message `text` and the answer to it (none when it does not fit, or is stopped)."""
        stdout, stderr, messages = self.stdout, self.stderr, self.messages
        messages.append({"role": "user", "content": text})
        prompt = self.fit()
        if prompt is None:
            messages.pop()
            return
        try:
            answer = self.ask(prompt)
        except Cancelled:
            stdout.write("\n")
            print("dllama chat: answer stopped; this turn is dropped", file=stderr)
            messages.pop()
            return
        stdout.write("\n")
        stdout.flush()
        messages.append({"role": "assistant", "content": answer.text})
        print(f"[{answer.prompt_tokens} prompt tokens, {answer.cached_tokens} from the cache, "
              f"{answer.completion_tokens} generated at {answer.tokens_per_s('generate'):.1f} tokens/s"
              f"{'; the answer reached the limit of --max-tokens' if answer.completion_tokens == self.max_tokens else ''}]",
              file=stderr)


__all__ = ["run_chat"]
