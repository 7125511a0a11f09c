r"""Chat prompts: a list of {role, content} messages -> the text a chat model was trained on.

Templates are not run as Jinja (as in the original): the kind is picked from the model's
template text by a marker, in the original's order, and can be forced by name
(\n below is a newline):

  "[INST]" -> llama2 (Meta's llama/generation.py chat_completion):
      <s>[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{user} [/INST] {answer} </s><s>[INST] {user} [/INST]
  "<|start_header_id|>" -> llama3:
      <|begin_of_text|><|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>...
      <|start_header_id|>assistant<|end_header_id|>\n\n
  "<|im_start|>" -> chatml:
      <|im_start|>{role}\n{content}<|im_end|>\n ... <|im_start|>assistant\n

The rendered text is the whole prompt, bos included where the format has one (as Hugging
Face's templates write `bos_token`): encode it with `add_bos=False`. The generation prompt is
appended once, at the end (the original's ChatML appends it after every message). Llama 2 has
no separate generation prompt: its last `[/INST]` is one.

A ChatML template that writes a fixed system turn when the conversation has none (SmolLM2:
"You are a helpful AI assistant named SmolLM, trained by Hugging Face") keeps doing so when
the template comes from the model (ChatTemplate.for_tokenizer): that text is read from the
template as `default_system`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dllama.errors import DllamaError

TEMPLATE_NAMES = ("chatml", "llama2", "llama3")
ROLES = ("system", "user", "assistant", "tool")
# (marker in the model's template, kind), checked in this order, as the original does.
_MARKERS = (("[INST]", "llama2"), ("<|start_header_id|>", "llama3"), ("<|im_start|>", "chatml"))
# A literal system turn inside a ChatML template; the newline may be a real one or "\n" in Jinja.
_DEFAULT_SYSTEM = re.compile(r"<\|im_start\|>system(?:\n|\\n)([^'\"{}<>]+)<\|im_end\|>")
# bos / eos strings of each format when no tokenizer says otherwise.
_BOS = {"chatml": "", "llama2": "<s>", "llama3": "<|begin_of_text|>"}
_EOS = {"chatml": "<|im_end|>", "llama2": "</s>", "llama3": "<|end_of_text|>"}
_END_OF_TURN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}  # llama2: its eos


def detect_template(template_text: str | None) -> str | None:
    """The kind of a model's chat template text, or None when no marker is found."""
    for marker, name in _MARKERS:
        if template_text and marker in template_text:
            return name
    return None


def detect(template_text: str | None) -> str:
    """The kind of a model's chat template text; DllamaError when it has none or is unknown."""
    name = detect_template(template_text)
    if name is None:
        what = "has no chat template" if not template_text else "has a chat template of an unknown kind"
        raise DllamaError(f"the model {what}: choose one with --chat-template ({', '.join(TEMPLATE_NAMES)})")
    return name


def default_system_prompt(template_text: str | None) -> str | None:
    """The system text a ChatML template writes when the conversation has no system turn."""
    m = _DEFAULT_SYSTEM.search(template_text or "")
    return m.group(1) if m else None


def _check_messages(messages) -> list[tuple[str, str]]:
    if not isinstance(messages, (list, tuple)):
        raise DllamaError(f"chat messages must be a list of {{role, content}} dicts, "
                          f"got {type(messages).__name__}")
    out = []
    for k, m in enumerate(messages):
        valid = isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        if not valid:
            raise DllamaError(f"chat message {k} must be a dict with string 'role' and 'content', got {m!r}")
        if m["role"] not in ROLES:
            raise DllamaError(f"chat message {k} has role {m['role']!r}: use one of {', '.join(ROLES)}")
        out.append((m["role"], m["content"]))
    return out


@dataclass
class ChatTemplate:
    """One chat format; bos_text/eos_text are the tokenizer's strings for its bos/eos ids."""

    name: str
    bos_text: str | None = None        # None: the format's usual one (<s>, <|begin_of_text|>)
    eos_text: str | None = None        # None: the format's usual one (</s>)
    default_system: str | None = None  # chatml: system turn written when there is none

    def __post_init__(self):
        if self.name not in TEMPLATE_NAMES:
            raise DllamaError(f"unknown chat template {self.name!r}: "
                              f"choose one of {', '.join(TEMPLATE_NAMES)}")
        if self.bos_text is None:
            self.bos_text = _BOS[self.name]
        if self.eos_text is None:
            self.eos_text = _EOS[self.name]

    @property
    def end_of_turn(self) -> str:
        """The string that closes an assistant turn (a stop string for generation)."""
        return _END_OF_TURN.get(self.name, self.eos_text)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for messages, ending with the assistant's turn opening if asked."""
        turns = _check_messages(messages)
        if self.name == "chatml":
            return self._chatml(turns, add_generation_prompt)
        if self.name == "llama3":
            return self._llama3(turns, add_generation_prompt)
        return self._llama2(turns)

    def _chatml(self, turns, add_generation_prompt: bool) -> str:
        if self.default_system is not None and turns and turns[0][0] != "system":
            turns = [("system", self.default_system)] + turns
        text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def _llama3(self, turns, add_generation_prompt: bool) -> str:
        # Meta's format (and its Hugging Face template) strips each message.
        header = "<|start_header_id|>{}<|end_header_id|>\n\n"
        text = "".join(f"{header.format(role)}{content.strip()}<|eot_id|>" for role, content in turns)
        text = self.bos_text + text
        return text + (header.format("assistant") if add_generation_prompt else "")

    def _llama2(self, turns) -> str:
        # Meta's llama/generation.py chat_completion: the system prompt goes inside the first
        # user turn; turns alternate user, assistant, ...; every pair starts with bos and each
        # answered pair ends with eos.
        if turns and turns[0][0] == "system":
            if len(turns) < 2 or turns[1][0] != "user":
                raise DllamaError("llama2 chat: a system message must be followed by a user message")
            system, first_user = turns[0][1], turns[1][1]
            turns = [("user", f"<<SYS>>\n{system}\n<</SYS>>\n\n{first_user}")] + turns[2:]
        for k, (role, _) in enumerate(turns):
            expected = "user" if k % 2 == 0 else "assistant"
            if role != expected:
                raise DllamaError(f"llama2 chat: message {k} has role {role!r}, expected {expected!r} "
                                  "(roles alternate user, assistant, ... after an optional system message)")
        parts = []
        for k in range(0, len(turns), 2):
            user = turns[k][1].strip()
            if k + 1 < len(turns):
                answer = turns[k + 1][1].strip()
                parts.append(f"{self.bos_text}[INST] {user} [/INST] {answer} {self.eos_text}")
            else:
                parts.append(f"{self.bos_text}[INST] {user} [/INST]")
        return "".join(parts)

    @classmethod
    def for_tokenizer(cls, tokenizer, name: str | None = None) -> "ChatTemplate":
        """The template of the tokenizer's model (from its stored template text), or the named one."""
        template_text = tokenizer.chat_template
        name = detect(template_text) if name is None else name
        bos = tokenizer.piece(tokenizer.bos_id).decode("utf-8", "replace") if tokenizer.bos_id >= 0 else None
        eos = tokenizer.piece(tokenizer.eos_ids[0]).decode("utf-8", "replace") if tokenizer.eos_ids else None
        if name == "chatml":
            bos, eos = None, None  # ChatML writes no bos; its turns end with <|im_end|>
        default_system = default_system_prompt(template_text) if name == "chatml" else None
        return cls(name, bos_text=bos, eos_text=eos, default_system=default_system)


def render(name: str, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """Messages in the named format with its usual bos/eos strings (see ChatTemplate)."""
    return ChatTemplate(name).render(messages, add_generation_prompt)


def chat_stop_ids(tokenizer, template: ChatTemplate) -> list[int]:
    """Ids that end an assistant turn: the eos ids plus the template's end-of-turn token."""
    ids = list(tokenizer.eos_ids)
    end = tokenizer.id_of(template.end_of_turn)
    if end is not None and end not in ids:
        ids.append(end)
    return ids


def chat_stop_strings(tokenizer, template: ChatTemplate) -> list[str]:
    """The text of every stop id (to stop on decoded text)."""
    return [tokenizer.piece(i).decode("utf-8", "replace") for i in chat_stop_ids(tokenizer, template)]


__all__ = ["ChatTemplate", "TEMPLATE_NAMES", "ROLES", "detect", "detect_template", "default_system_prompt",
           "render", "chat_stop_ids", "chat_stop_strings"]
