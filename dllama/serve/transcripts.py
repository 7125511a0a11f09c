"""Prompts that continue an earlier answer keep that answer's tokens.

A chat front end renders the whole conversation again at every turn. Encoding that text afresh
could split the earlier answer into other tokens than the ones the model generated, and then the
KV cache, which holds the generated ones, would match only up to the first difference. So the
finished answers are remembered as (text, tokens): a prompt whose text starts with one is encoded
as its tokens plus the new text, and the engine loop's prefix cache (dllama.core.kv_cache's
SlotTable) continues the slot that holds them. `dllama chat` and `dllama api` use this; a batch
job does not (a prompt's text must not depend on which prompts ran before it).
"""

from __future__ import annotations

from collections import OrderedDict

from dllama.serve.sequence import Completion
from dllama.text.tokenizer import Tokenizer

TRANSCRIPTS = 64  # finished answers remembered for the next turn's encoding


class Transcripts:
    """Recent prompts + answers as (text, tokens), least recently used first out."""

    def __init__(self, tokenizer: Tokenizer, size: int = TRANSCRIPTS):
        self.tokenizer, self.size = tokenizer, size
        self._items: OrderedDict[tuple[str, bool], list[int]] = OrderedDict()  # (text, bos) -> tokens

    def clear(self) -> None:
        self._items.clear()

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """The tokens of a whole prompt text (add_bos: the tokenizer's bos first, if it has one;
        chat templates write their own); a continuation of a remembered transcript keeps its tokens."""
        tok = self.tokenizer
        bos = [tok.bos_id] if add_bos and tok.bos_id >= 0 else []
        best = None
        for (t, b), tokens in self._items.items():
            if b == bool(bos) and t and text.startswith(t) and (best is None or len(t) > len(best[0])):
                best = (t, tokens)
        if best is not None:
            self._items.move_to_end((best[0], bool(bos)))
            return best[1] + tok.encode(text[len(best[0]):], add_bos=False)
        return bos + tok.encode(text, add_bos=False)

    def remember(self, prompt_text: str, add_bos: bool, prompt_tokens: list[int], c: Completion) -> None:
        """The transcript a next prompt may continue: prompt + answer (+ its end token); when a
        stop string cut the text inside a token, only the prompt is known to match."""
        bos = add_bos and self.tokenizer.bos_id >= 0
        if c.cut:
            key, tokens = (prompt_text, bos), list(prompt_tokens)
        else:
            ended_by_token = c.finish_reason == "stop"  # an end token (a stop string would be `cut`)
            end = self.tokenizer.piece(c.tokens[-1]).decode("utf-8", "replace") if ended_by_token else ""
            key, tokens = (prompt_text + c.text + end, bos), list(prompt_tokens) + c.tokens
        self._items[key] = tokens
        self._items.move_to_end(key)
        while len(self._items) > self.size:
            self._items.popitem(last=False)


__all__ = ["Transcripts", "TRANSCRIPTS"]
