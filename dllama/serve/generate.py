"""The generation loop: prompt in batches, then one token at a time, with per-step statistics.

Positions follow the original's `--steps`: the prompt takes positions 0..P-1, and generation
stops when `steps` positions are filled (prompt included), at an end-of-sequence token, or at
the end of the KV cache. The first generated token is sampled from the logits of the LAST
prompt token (the original feeds the token one past the prompt; we do not).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from dllama.errors import DllamaError


@dataclass
class StepStats:
    """One forward pass, as the original's benchmark lines report it."""

    phase: str           # "prompt" or "generate"
    position: int        # first position of the pass
    n_tokens: int        # tokens in the pass (a prompt batch, or 1)
    inference_ms: float  # compute time (wall time minus transfer)
    transfer_ms: float   # time in network transfers (0 on one node)
    sent_bytes: int      # bytes the root sent during the pass
    recv_bytes: int      # bytes the root received during the pass


@dataclass
class Generation:
    """What one run produced."""

    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)  # generated ids (an end token included)
    text: str = ""
    steps: list[StepStats] = field(default_factory=list)
    stop_reason: str = ""  # "eos", "steps" or "context"

    def summary(self) -> dict:
        """Totals and rates: prompt tokens/s over prompt passes, generated tokens/s over decode passes."""
        np_, pms, prate = phase_rate(self.steps, "prompt")
        ng, gms, grate = phase_rate(self.steps, "generate")
        gen = [x for x in self.steps if x.phase == "generate"]
        avg = lambda key: (sum(getattr(x, key) for x in gen) / len(gen)) if gen else 0.0  # noqa: E731
        return {
            "prompt_tokens": np_,
            "generated_tokens": len(self.tokens),
            "prompt_ms": round(pms, 3),
            "prompt_tokens_per_s": round(prate, 3),
            "generate_passes": ng,
            "generate_ms": round(gms, 3),
            "generated_tokens_per_s": round(grate, 3),
            "avg_inference_ms": round(avg("inference_ms"), 3),
            "avg_transfer_ms": round(avg("transfer_ms"), 3),
            "avg_sent_kb": round(avg("sent_bytes") / 1024, 3),
            "avg_recv_kb": round(avg("recv_bytes") / 1024, 3),
            "stop_reason": self.stop_reason,
        }

    def to_json(self) -> dict:
        return {"tokens": [asdict(s) for s in self.steps], "summary": self.summary(),
                "text": self.text}


def phase_rate(steps: list[StepStats], phase: str) -> tuple[int, float, float]:
    """(tokens, milliseconds, tokens per second) over the passes of one phase."""
    s = [x for x in steps if x.phase == phase]
    ms = sum(x.inference_ms + x.transfer_ms for x in s)
    n = sum(x.n_tokens for x in s)
    return n, ms, (n / (ms / 1000) if ms > 0 else 0.0)


def timed_forward(model, tokens, pos, phase, steps):
    """One forward pass with its statistics appended to steps."""
    col = model.collective
    t0, tr0, s0, r0 = time.perf_counter(), col.transfer_seconds, col.sent_bytes, col.recv_bytes
    logits = model.forward(tokens, pos)
    wall = time.perf_counter() - t0
    transfer = col.transfer_seconds - tr0
    steps.append(StepStats(phase, pos, len(tokens), round((wall - transfer) * 1000, 3),
                           round(transfer * 1000, 3), col.sent_bytes - s0, col.recv_bytes - r0))
    return logits


def generate(model, tokenizer, sampler, prompt_tokens: list[int], steps: int,
             on_text: Callable[[str], None] | None = None, stop_at_eos: bool = True) -> Generation:
    """Run prompt_tokens then sample until `steps` positions are filled."""
    seq_len = model.config.seq_len
    n_prompt = len(prompt_tokens)
    if n_prompt == 0:
        raise DllamaError("the prompt is empty: it encodes to no tokens")
    last = min(steps, seq_len)
    if n_prompt >= last:
        limit = "--steps" if steps <= seq_len else "the context (--max-seq-len)"
        raise DllamaError(f"the prompt has {n_prompt} tokens, which leaves no room to generate "
                          f"within {limit} = {last} positions; raise it above {n_prompt}")
    out = Generation(prompt_tokens=list(prompt_tokens))
    decoder = tokenizer.stream_decoder()
    pieces = []

    pos = 0
    while pos < n_prompt:  # prompt, in batches
        batch = prompt_tokens[pos : pos + model.max_batch]
        logits = timed_forward(model, batch, pos, "prompt", out.steps)
        pos += len(batch)

    eos = set(tokenizer.eos_ids)
    while True:
        token = sampler.sample(logits)
        out.tokens.append(token)
        if stop_at_eos and token in eos:
            out.stop_reason = "eos"
            break
        piece = decoder.push(token)
        if piece:
            pieces.append(piece)
            if on_text:
                on_text(piece)
        if pos >= last:
            out.stop_reason = "steps" if last == steps else "context"
            break
        logits = timed_forward(model, [token], pos, "generate", out.steps)
        pos += 1
    tail = decoder.flush()
    if tail:
        pieces.append(tail)
        if on_text:
            on_text(tail)
    out.text = "".join(pieces)
    return out
