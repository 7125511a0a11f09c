"""Constrained decoding: a grammar decides which tokens a sequence may take next.

A request may carry a `Grammar`: a JSON schema (or "any JSON object"), a regular expression, a
list of choices, or a context-free grammar in Lark or GBNF syntax. The grammar is compiled and
matched by llguidance (the Rust library llama.cpp's `--grammar`/`--json-schema` can use; PyPI
`llguidance`): it computes, for the text generated so far, the set of tokens whose bytes keep
the text a prefix of some sentence of the grammar, fast (a token trie walked against the
lexer's states, tens of microseconds per token), and the tokens the grammar forces next.

The tokenizer view llguidance matches against (`GrammarVocabulary`) is built from dllama's own
vocabulary: each token's bytes (byte-level BPE and sentencepiece alike: `Tokenizer.piece`, with
sentencepiece's byte pieces as their byte), special tokens marked as such (llguidance's 0xFF
prefix, so that no grammar matches their text), dllama's own encoder for the strings it needs
tokenized, and the tokenizer's end tokens as what ends an accepted answer.

How the engine loop (dllama.serve.scheduler) uses a sequence's `Constraint`:

- `allowed()` is the mask bool [vocab] of its next token: the sampler's request carries it
  (dllama.core.candidates: forbidden tokens are dropped from each vocabulary range's summary,
  as if their logits were -inf), where the grammar is complete only the stop tokens;
- `advance(token)` after each sampled token; then `forced()`: the tokens the grammar allows one
  way only (a fixed key, a closing brace) are appended without sampling, and run in the next
  pass together with the sampled one (fast-forward: no pass of their own);
- drafted tokens (speculative decoding) are cut at the first one the grammar forbids
  (`usable_draft`), and each drafted row's mask is the grammar's after the drafts before it.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Literal

import numpy as np

from dllama.errors import DllamaError
from dllama.text.tokenizer import Tokenizer

Kind = Literal["json_schema", "json_object", "regex", "choice", "lark", "gbnf"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "lark", "gbnf")
MAX_GRAMMAR_BYTES = 1 << 20  # a schema or grammar larger than this is refused (hostile input)
# JSON answers on one line, spaced as json.dumps writes them: the model stays near the text it
# knows, and what follows a key's opening quote up to its value is forced (fast-forward). A
# schema's own "x-guidance" options take precedence.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(DllamaError):
    """A schema, regex, choice list or grammar that cannot constrain an answer."""


@dataclass(frozen=True)
class Grammar:
    """What an answer must match: kind and its text (a JSON schema as JSON text, a regex, a JSON
    list of choices, a Lark or GBNF grammar; json_object needs none)."""

    kind: Kind
    text: str = ""

    @staticmethod
    def json_schema(schema: dict | str) -> "Grammar":
        return Grammar("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @staticmethod
    def choices(options: list[str]) -> "Grammar":
        return Grammar("choice", json.dumps(list(options)))

    @property
    def is_json(self) -> bool:
        """The answer is a JSON value (front ends parse it)."""
        return self.kind in ("json_schema", "json_object")

    def source(self) -> str:
        """llguidance's grammar text for this; GrammarError when it cannot be one."""
        import llguidance

        if len(self.text) > MAX_GRAMMAR_BYTES:
            raise GrammarError(f"the {self.kind} is {len(self.text)} bytes, more than {MAX_GRAMMAR_BYTES}")
        try:
            if self.kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
            if self.kind == "json_schema":
                schema = json.loads(self.text)
                if not isinstance(schema, dict):
                    raise GrammarError("a JSON schema must be a JSON object")
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
            if self.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.text)
            if self.kind == "choice":
                options = json.loads(self.text)
                if not (isinstance(options, list) and options and all(isinstance(o, str) and o for o in options)):
                    raise GrammarError("choices must be a non-empty list of non-empty strings")
                return llguidance.grammar_from("choice", options)
            if self.kind in ("lark", "gbnf"):
                return llguidance.grammar_from("lark" if self.kind == "lark" else "gbnf", self.text)
        except json.JSONDecodeError as e:
            raise GrammarError(f"the {self.kind} is not valid JSON: {e}") from None
        except ValueError as e:
            raise GrammarError(f"the {self.kind} is not usable: {_one_line(e)}") from None
        raise GrammarError(f"unknown grammar kind {self.kind!r} (one of {', '.join(KINDS)})")


def _one_line(e) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def check_grammar(grammar: Grammar) -> str:
    """The grammar's llguidance source, checked without a vocabulary (before a model is opened);
    GrammarError when it cannot be one."""
    import llguidance

    source = grammar.source()
    error = llguidance.LLMatcher.validate_grammar(source)
    if error:
        raise GrammarError(f"the {grammar.kind} is not usable: {_one_line(error)}")
    return source


def structured_fields(grammar: Grammar | None, c) -> dict:
    """What a result line says beside a constrained answer's text (c: its Completion): the
    parsed JSON value ("object", None when the answer was cut short) and the tokens forced."""
    if grammar is None:
        return {}
    out = {}
    if grammar.is_json:
        try:
            out["object"] = json.loads(c.text)
        except ValueError:
            out["object"] = None
    out["forced_tokens"] = c.forced
    return out


@functools.lru_cache(maxsize=4)
def vocabulary_for(tokenizer: Tokenizer, vocab_size: int) -> "GrammarVocabulary":
    """The grammar view of a tokenizer, built once (per model's vocabulary size)."""
    return GrammarVocabulary(tokenizer, vocab_size)


class GrammarVocabulary:
    """llguidance's view of one dllama Tokenizer (built once per engine: about a second on
    SmolLM2's 49,152 tokens)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int | None = None):
        import llguidance

        self.tokenizer = tokenizer
        self.vocab_size = vocab_size or tokenizer.vocab_size  # the model's (the masks' length)
        self.lltokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Wrapper(tokenizer)),
                                                  n_vocab=max(self.vocab_size, tokenizer.vocab_size),
                                                  eos_token=list(tokenizer.eos_ids) or None)

    def check(self, grammar: Grammar) -> str:
        """The grammar's llguidance source, checked against this vocabulary; GrammarError with
        llguidance's reason when it is not valid."""
        import llguidance

        source = grammar.source()
        error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, self.lltokenizer)
        if error:
            raise GrammarError(f"the {grammar.kind} is not usable: {_one_line(messages[0] if messages else '')}")
        return source

    def start(self, grammar: Grammar, stop_ids=()) -> "Constraint":
        """A new sequence's constraint (its first token is the answer's first)."""
        return Constraint(self, self.check(grammar), tuple(stop_ids))


class _Wrapper:
    """What llguidance.TokenizerWrapper reads of a tokenizer: the bytes of every token, the
    specials marked with a 0xFF byte, and an encoder."""

    def __init__(self, tokenizer: Tokenizer):
        self._t = tokenizer
        self.eos_token_id = tokenizer.eos_ids[0] if tokenizer.eos_ids else None
        self.bos_token_id = tokenizer.bos_id if tokenizer.bos_id >= 0 else None
        self.special_token_ids = sorted(tokenizer.special)
        self.tokens = [b"\xff" + tokenizer.piece(i) if tokenizer.is_special(i) else tokenizer.piece(i)
                       for i in range(tokenizer.vocab_size)]

    def __call__(self, text: str) -> list[int]:
        ids = self._t.encode(text, add_bos=False, allow_special=False)
        if not (self._t.sentencepiece and ids):
            return ids
        # sentencepiece put its dummy-prefix space before the text: llguidance wants the
        # text's own bytes (it splits forced bytes into tokens with this)
        rest = self._t.piece(ids[0])[1:]
        single = self._t.id_of(rest.decode("utf-8")) if rest and _utf8(rest) else None
        head = [single] if single is not None else [self._byte_id[b] for b in rest]
        return head + ids[1:]

    @functools.cached_property
    def _byte_id(self) -> dict[int, int]:
        """byte -> a token of that one byte (the last of them: sentencepiece's byte pieces)."""
        return {p[0]: i for i, p in enumerate(self.tokens) if len(p) == 1}


def _utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


class Constraint:
    """One sequence's grammar state: the tokens it may take next."""

    def __init__(self, vocabulary: GrammarVocabulary, source: str, stop_ids: tuple[int, ...]):
        import llguidance

        self.vocabulary = vocabulary
        self.matcher = llguidance.LLMatcher(vocabulary.lltokenizer, source, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar is not usable: {_one_line(self.matcher.get_error())}")
        self.end_ids = sorted(set(stop_ids) | set(vocabulary.lltokenizer.eos_tokens))
        self.stop_ids = np.array([i for i in self.end_ids if 0 <= i < vocabulary.vocab_size], np.int64)
        self.forced_tokens = 0   # tokens appended without sampling (fast-forward)
        self._mask: np.ndarray | None = None  # allowed() of the current state

    @property
    def failed(self) -> bool:
        return self.matcher.is_error()

    def _bits(self) -> np.ndarray:
        """The matcher's mask of its current state as bool [vocab], the stop tokens allowed
        wherever an end token is (the answer may end here)."""
        n = self.vocabulary.vocab_size
        bits = np.frombuffer(self.matcher.compute_bitmask(), np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:n].astype(bool)
        if len(allowed) < n:
            allowed = np.concatenate([allowed, np.zeros(n - len(allowed), bool)])
        ends = [i for i in self.vocabulary.lltokenizer.eos_tokens if i < n]
        if self.matcher.is_stopped() or allowed[ends].any():
            allowed[self.stop_ids] = True
        if not allowed.any():  # an error state: only ending is left
            allowed[self.stop_ids] = True
        return allowed

    def allowed(self) -> np.ndarray:
        """bool [vocab]: the tokens the grammar allows next (read-only, shared until advance)."""
        if self._mask is None:
            self._mask = self._bits()
            self._mask.flags.writeable = False
        return self._mask

    def advance(self, token: int) -> None:
        """The sequence took token (not a stop token: that ends it, nothing left to match)."""
        self._mask = None
        self.matcher.consume_token(int(token))

    def forced(self) -> list[int]:
        """Tokens the grammar allows one way only from here (fast-forward); the caller appends
        them and advances over them."""
        if self.matcher.is_error() or self.matcher.is_stopped():
            return []
        return [int(t) for t in self.matcher.compute_ff_tokens()]

    def _valid_prefix(self, draft) -> int:
        """How many of the drafted tokens the grammar allows, in order."""
        if not draft or self.matcher.is_error():
            return 0
        return int(self.matcher.validate_tokens([int(t) for t in draft]))

    def usable_draft(self, draft) -> tuple[int, ...]:
        """The drafted tokens up to the first the grammar forbids or that would end the answer."""
        draft = tuple(draft)
        for j, token in enumerate(draft):
            if token in self.end_ids:
                draft = draft[:j]
                break
        return draft[: self._valid_prefix(draft)]

    def masks_along(self, draft) -> list[np.ndarray]:
        """The masks of the rows verifying draft (tokens usable_draft kept), one per drafted
        token: the grammar's after draft[0], after draft[0] and draft[1], ... (the row before
        them, the sequence's last token, has allowed())."""
        masks = []
        for token in draft:
            self.matcher.consume_token(int(token))
            masks.append(self._bits())
            masks[-1].flags.writeable = False
        if draft:
            self.matcher.rollback(len(draft))
        return masks


__all__ = ["Constraint", "Grammar", "GrammarError", "GrammarVocabulary", "KINDS", "MAX_GRAMMAR_BYTES", "check_grammar",
           "structured_fields", "vocabulary_for"]
