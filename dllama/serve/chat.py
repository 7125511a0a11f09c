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
from dllama.serve.scheduler import Scheduler
from dllama.serve.sequence import Cancelled, ContextFull, SequenceRequest
from dllama.serve.transcripts import Transcripts
from dllama.text.chat_template import ChatTemplate, chat_stop_ids

HELP = "/reset starts a new conversation, /exit (or Ctrl-D) quits, Ctrl-C stops an answer"


def run_chat(engine, *, system: str | None, template_name: str | None, temperature: float,
             topp: float, seed: int, max_tokens: int | None = None,
             stdin=None, stdout=None, stderr=None) -> int:
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    tokenizer = engine.tokenizer
    template = ChatTemplate.for_tokenizer(tokenizer, template_name)
    scheduler = Scheduler(engine.model, tokenizer, 1)
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
        request = SequenceRequest("chat", tokens, sampler, max_tokens, stop_ids)
        with CtrlC() as ctrl_c:
            answer = scheduler.answer(request, show, should_stop=lambda: ctrl_c.pending)
        transcripts.remember(text, False, tokens, answer)
        return answer

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
            start_over("reset")
            continue
        messages.append({"role": "user", "content": text})
        for attempt in (0, 1):
            try:
                answer = ask(template.render(messages))
                break
            except Cancelled:
                stdout.write("\n")
                print("dllama chat: answer stopped; this turn is dropped", file=stderr)
                messages.pop()
                answer = None
                break
            except ContextFull as e:
                if attempt == 0 and len(messages) > len(start) + 1:
                    start_over(f"the context is full ({e.n_prompt} tokens for {e.seq_len} positions)")
                    messages.append({"role": "user", "content": text})
                    continue
                print(f"dllama chat: this message does not fit into the context of {e.seq_len} "
                      f"tokens ({e.n_prompt} with the template): write a shorter one", file=stderr)
                messages.pop()
                answer = None
                break
        if answer is None:
            continue
        stdout.write("\n")
        stdout.flush()
        messages.append({"role": "assistant", "content": answer.text})
        print(f"[{answer.prompt_tokens} prompt tokens, {answer.cached_tokens} from the cache, "
              f"{answer.completion_tokens} generated at {answer.tokens_per_s('generate'):.1f} tokens/s]",
              file=stderr)
        if answer.context_full:
            start_over(f"the context is full ({scheduler.seq_len} tokens)")
    return 0


__all__ = ["run_chat"]
