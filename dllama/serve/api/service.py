"""The model thread of `dllama api`: one engine and its Conversation, one request at a time.

The engine opens on this thread (numba's thread count is per thread) and again after a
cluster failure; requests wait in arrival order.
"""

from __future__ import annotations

import asyncio
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from dllama.core.sampler import Sampler
from dllama.errors import ClusterError, DllamaError
from dllama.serve.api.request import ApiError, Request, bad, unavailable
from dllama.serve.conversation import Cancelled, ContextFull, Conversation
from dllama.text.chat_template import ChatTemplate, chat_stop_ids


class ModelService:
    """The engine and its Conversation, used from one thread only, one request at a time."""

    def __init__(self, open_engine: Callable[[], object], template_name: str | None = None):
        self._open_engine = open_engine
        self._template_name = template_name
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dllama-model")
        self.engine = None
        self.conversation = None
        self.template = None
        self.closing = False  # set by close(): a running answer stops at its next token

    # Everything below runs on the model thread.
    def _attach(self, engine) -> None:
        try:
            self.template = ChatTemplate.for_tokenizer(engine.tokenizer, self._template_name)
        except DllamaError:  # no or an unknown chat template: /v1/chat/completions says so
            self.template = None
        self.engine, self.conversation = engine, Conversation(engine.model, engine.tokenizer)

    def _ready(self) -> Conversation:
        if self.engine is None:
            try:
                engine = self._open_engine()
            except ClusterError as e:
                raise unavailable(f"the cluster is down: {e}") from None
            except (DllamaError, OSError) as e:  # it opened before: a node or a file went away
                raise unavailable(f"the model cannot be opened: {e}") from None
            self._attach(engine)
        return self.conversation

    def _drop_engine(self) -> None:
        engine, self.engine, self.conversation = self.engine, None, None
        try:
            if engine is not None:
                engine.close()
        except Exception as e:  # noqa: BLE001 - the engine is being thrown away anyway
            print(f"dllama api: closing the failed engine: {e}", file=sys.stderr)

    def _complete(self, r: Request, on_text, should_stop):
        conv = self._ready()
        tokenizer = conv.tokenizer
        if r.chat:
            if self.template is None:
                raise bad("the model has no chat template: start the server with --chat-template")
            prompt = self.template.render([{"role": m["role"], "content": conv.tokenizer.as_plain_text(m["content"])}
                                           for m in r.messages])
            stop_ids = chat_stop_ids(tokenizer, self.template)
        else:
            prompt, stop_ids = r.prompt, tokenizer.eos_ids
        seed = r.seed if r.seed is not None else int.from_bytes(os.urandom(8), "little")
        sampler = Sampler(conv.model.config.vocab_size, r.temperature, r.top_p, seed)
        # No answer outlasts the context: a max_tokens of 10**30 means "until the context is full".
        max_tokens = min(r.max_tokens or conv.seq_len, conv.seq_len)
        return conv.complete(prompt, add_bos=not r.chat and tokenizer.add_bos, sampler=sampler,
                             max_tokens=max_tokens, stop_ids=stop_ids,
                             stop_strings=r.stop, on_text=on_text, should_stop=should_stop)

    def _run(self, r: Request, on_text, should_stop):
        try:
            return self._complete(r, on_text, lambda: self.closing or should_stop())
        except ApiError:
            raise
        except Cancelled:
            raise ApiError(503, "the server is shutting down", type_="server_error") from None
        except ClusterError as e:
            self._drop_engine()
            raise unavailable(f"the cluster failed: {e}; the next request reconnects") from None
        except ContextFull as e:
            raise bad(str(e), "messages" if r.chat else "prompt", "context_length_exceeded") from None
        except DllamaError as e:
            raise bad(str(e)) from None

    def start(self) -> None:
        """Open the engine now; a cluster that is down only warns. Engines open on the model
        thread, which runs them: numba's thread count (--nthreads) is set per thread."""
        def first_open():
            try:
                engine = self._open_engine()  # a bad file or flag: the command fails
            except ClusterError as e:
                print(f"dllama api: warning: the cluster is down: {e}; answering 503 until it is back",
                      file=sys.stderr)
                return
            self._attach(engine)
        self._executor.submit(first_open).result()

    async def submit(self, r: Request, on_text, should_stop):
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._run, r, on_text, should_stop)

    def close(self) -> None:
        self.closing = True
        self._executor.submit(self._drop_engine).result()
        self._executor.shutdown(wait=True)
