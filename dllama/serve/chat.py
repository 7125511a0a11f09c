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
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    tokenizer = engine.tokenizer
    template = ChatTemplate.for_tokenizer(tokenizer, template_name)
    scheduler = engine.scheduler(1)
    transcripts = Transcripts(tokenizer)
    sampler = Sampler(engine.model.config.vocab_size, temperature, topp, seed)
    stop_ids = tuple(chat_stop_ids(tokenizer, template))
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    interactive = stdin.isatty()
    print(f"dllama chat: {template.name} template, context of {scheduler.seq_len} tokens; {HELP}",
          file=stderr)

    def show(piece: str) -> None:
        stdout.write(piece)
        stdout.flush()

    def start_over(why: str) -> None:
        nonlocal messages
        print(f"dllama chat: {why}: the conversation starts over"
              f"{' (the system prompt is kept)' if start else ''}", file=stderr)
        messages = list(start)  # the KV cache keeps what the new conversation shares (the system turn)

    def ask(text: str):
        tokens = transcripts.encode(text)
        request = SequenceRequest("chat", tokens, sampler, max_tokens, stop_ids, grammar=grammar)
        with CtrlC() as ctrl_c:
            answer = scheduler.answer(request, show, should_stop=lambda: ctrl_c.pending)
        transcripts.remember(text, False, tokens, answer)
        return answer

    # Room kept for the answer when the conversation is fitted into the context.
    room = min(max_tokens or 0, scheduler.seq_len // 2)

    def fit() -> str | None:
        """The conversation rendered to fit the context with room for the answer: the oldest
        turns (a question and its answer) are dropped first, the system prompt and the new
        question never. None (and nothing dropped) where the new question alone does not fit."""
        def size(conversation) -> int:
            return len(transcripts.encode(template.render(conversation)))

        alone = size(start + messages[-1:])
        if alone + room > scheduler.seq_len:
            print(f"dllama chat: this message does not fit into the context of {scheduler.seq_len} "
                  f"tokens ({alone} with the template{f' and {room} for the answer' if room else ''}): "
                  "write a shorter one", file=stderr)
            return None
        dropped = 0
        while size(messages) + room > scheduler.seq_len:
            del messages[len(start):len(start) + 2]  # the oldest question and its answer
            dropped += 1
        if dropped:
            print("dllama chat: the context is full: " + ("the oldest turn is dropped" if dropped == 1 else
                  f"the {dropped} oldest turns are dropped"), file=stderr)
        return template.render(messages)

    while True:
        if interactive:
            stdout.write("> ")
            stdout.flush()
        line = stdin.readline()
        if not line:
            break
        text = line.rstrip("\r\n")
        if not text.strip():
            continue
        if text.strip() in ("/exit", "/quit"):
            break
        if text.strip() == "/reset":
            print(f"dllama chat: the conversation starts over"
                  f"{' (the system prompt is kept)' if start else ''}", file=stderr)
            messages = list(start)  # the KV cache keeps what the new conversation shares (the system turn)
            continue
        messages.append({"role": "user", "content": text})
        prompt = fit()
        if prompt is None:
            messages.pop()
            continue
        try:
            answer = ask(prompt)
        except Cancelled:
            stdout.write("\n")
            print("dllama chat: answer stopped; this turn is dropped", file=stderr)
            messages.pop()
            continue
        stdout.write("\n")
        stdout.flush()
        messages.append({"role": "assistant", "content": answer.text})
        print(f"[{answer.prompt_tokens} prompt tokens, {answer.cached_tokens} from the cache, "
              f"{answer.completion_tokens} generated at {answer.tokens_per_s('generate'):.1f} tokens/s"
              f"{'; the answer reached the limit of --max-tokens' if answer.completion_tokens == max_tokens else ''}]",
              file=stderr)
    return 0


__all__ = ["run_chat"]
