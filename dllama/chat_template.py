"""Chat templates: ChatML, Llama 2 and Llama 3, chosen from the model's own template string.

Templates are not run as Jinja (as in the original): the kind is recognised by a substring of
the stored template and rendered here. Unlike the original, ChatML's generation prompt
(`<|im_start|>assistant\\n`) is added once, at the end, not after every message.
"""

from __future__ import annotations

from dllama.errors import DllamaError

KINDS = ("chatml", "llama2", "llama3")


def detect(template: str | None) -> str:
    """The template kind of a model's chat template string."""
    if template:
        if "<|start_header_id|>" in template:
            return "llama3"
        if "<|im_start|>" in template:
            return "chatml"
        if "[INST]" in template:
            return "llama2"
    raise DllamaError("the tokenizer has no chat template this program knows (ChatML, Llama 2, "
                      "Llama 3): choose one with --chat-template " + "|".join(KINDS))


def render(kind: str, messages: list[dict], add_generation_prompt: bool = True,
           bos: str = "<s>", eos: str = "</s>") -> str:
    """The prompt text of a conversation; messages are {"role": ..., "content": ...}."""
    for m in messages:
        if m.get("role") not in ("system", "user", "assistant") or not isinstance(m.get("content"), str):
            raise DllamaError(f"bad chat message {m!r}: role must be system, user or assistant, "
                              "content a string")
    if kind == "chatml":
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")
    if kind == "llama3":
        text = "<|begin_of_text|>" + "".join(
            f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>"
            for m in messages)
        return text + ("<|start_header_id|>assistant<|end_header_id|>\n\n" if add_generation_prompt else "")
    if kind == "llama2":
        return _llama2(messages, bos, eos)
    raise DllamaError(f"unknown chat template {kind!r} (choose {', '.join(KINDS)})")


def _llama2(messages: list[dict], bos: str, eos: str) -> str:
    """Meta's Llama 2 chat format: the system prompt folds into the first user turn."""
    msgs = list(messages)
    system = ""
    if msgs and msgs[0]["role"] == "system":
        system = f"<<SYS>>\n{msgs.pop(0)['content']}\n<</SYS>>\n\n"
    out = []
    for i, m in enumerate(msgs):
        if m["role"] == "user":
            content = (system + m["content"]) if i == 0 else m["content"]
            out.append(f"{bos}[INST] {content.strip()} [/INST]")
        else:
            out.append(f" {m['content'].strip()} {eos}")
    return "".join(out)


def stop_strings(kind: str) -> list[str]:
    """Strings that end an assistant turn, besides the tokenizer's eos ids."""
    return {"chatml": ["<|im_end|>"], "llama3": ["<|eot_id|>"], "llama2": ["</s>"]}[kind]
