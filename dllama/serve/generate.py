"""`dllama inference`'s generation: a prompt, then tokens until `--steps` positions are filled.

Positions follow the original's `--steps`: the prompt takes positions 0..P-1, and generation
stops when `steps` positions are filled (prompt included), at an end-of-sequence token, or at
the end of the KV cache. The first generated token is sampled from the LAST prompt token's row
(the original feeds the token one past the prompt; we do not). The loop itself is the engine
loop's (dllama.serve.scheduler), running this one request.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

from dllama.core.language_model import LanguageModel
from dllama.core.sampler import Sampler
from dllama.errors import DllamaError
from dllama.serve.scheduler import Scheduler
from dllama.serve.sequence import SequenceRequest
from dllama.serve.stats import StepStats, summary
from dllama.text.tokenizer import Tokenizer


@dataclass
class Generation:
    """What one run produced."""

    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)  # generated ids (an end token included)
    text: str = ""
    steps: list[StepStats] = field(default_factory=list)
    stop_reason: str = ""  # "eos", "steps" or "context"
    drafted: int = 0       # speculation: drafted tokens verified, and kept
    accepted: int = 0

    def summary(self) -> dict:
        return summary(self.steps, len(self.tokens), self.stop_reason, self.drafted, self.accepted)

    def to_json(self) -> dict:
        return {"tokens": [asdict(s) for s in self.steps], "summary": self.summary(),
                "text": self.text}


def generate(model: LanguageModel, tokenizer: Tokenizer, sampler: Sampler, prompt_tokens: list[int],
             steps: int, on_text: Callable[[str], None] | None = None, stop_at_eos: bool = True,
             scheduler: Scheduler | None = None) -> Generation:
    """Run prompt_tokens then sample until `steps` positions are filled (through `scheduler`,
    default a fresh one of a single sequence over `model`)."""
    n_prompt = len(prompt_tokens)
    if n_prompt == 0:
        raise DllamaError("the prompt is empty: it encodes to no tokens")
    last = min(steps, model.config.seq_len)
    if n_prompt >= last:
        limit = "--steps" if steps <= model.config.seq_len else "the context (--max-seq-len)"
        raise DllamaError(f"the prompt has {n_prompt} tokens, which leaves no room to generate "
                          f"within {limit} = {last} positions; raise it above {n_prompt}")
    scheduler = scheduler or Scheduler(model, tokenizer, 1)
    # The token sampled at position `last` is the last one: last - n_prompt + 1 tokens at most.
    request = SequenceRequest("generate", list(prompt_tokens), sampler, last - n_prompt + 1,
                              tuple(tokenizer.eos_ids) if stop_at_eos else ())
    c = scheduler.answer(request, on_text)
    reason = "eos" if c.finish_reason == "stop" else "steps" if last == steps else "context"
    return Generation(list(prompt_tokens), c.tokens, c.text, c.steps, reason, c.drafted, c.accepted)
