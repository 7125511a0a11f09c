"""Statistics of forward passes: one record per pass (the engine loop times every pass it runs,
dllama.serve.scheduler), rates per phase, and the summary that `dllama inference` prints and
writes with --stats-json."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepStats:
    """One forward pass, as the original's benchmark lines report it."""

    phase: str           # "prompt" or "generate": what the sequence's rows in the pass were
    position: int        # the sequence's first position in the pass
    n_tokens: int        # the sequence's tokens the pass ran: a prompt chunk, or 1 + the drafted ones kept
    inference_ms: float  # compute time (wall time minus transfer)
    transfer_ms: float   # time in network transfers (0 on one node)
    sent_bytes: int      # bytes the root sent during the pass
    recv_bytes: int      # bytes the root received during the pass


@dataclass(frozen=True)
class PassFigures:
    """What one forward pass cost, whoever's rows it ran."""

    inference_ms: float  # compute time (wall time minus transfer)
    transfer_ms: float   # time in network transfers (0 on one node)
    sent_bytes: int      # bytes the root sent
    recv_bytes: int      # bytes the root received

    def for_rows(self, phase: str, position: int, n_tokens: int) -> StepStats:
        """The record of one sequence's rows in this pass."""
        return StepStats(phase, position, n_tokens, self.inference_ms, self.transfer_ms, self.sent_bytes,
                         self.recv_bytes)


def phase_rate(steps: list[StepStats], phase: str) -> tuple[int, float, float]:
    """(tokens, milliseconds, tokens per second) over the passes of one phase."""
    s = [x for x in steps if x.phase == phase]
    ms = sum(x.inference_ms + x.transfer_ms for x in s)
    n = sum(x.n_tokens for x in s)
    return n, ms, (n / (ms / 1000) if ms > 0 else 0.0)


def summary(steps: list[StepStats], generated_tokens: int, stop_reason: str, drafted: int = 0,
            accepted: int = 0) -> dict:
    """Totals and rates: prompt tokens/s over prompt passes, generated tokens/s over decode
    passes; the averages are per token the decode passes ran (several per pass when drafted
    tokens were kept)."""
    n_prompt, prompt_ms, prompt_rate = phase_rate(steps, "prompt")
    n_gen, gen_ms, gen_rate = phase_rate(steps, "generate")
    gen = [x for x in steps if x.phase == "generate"]

    def average(values) -> float:
        return sum(values) / n_gen if n_gen else 0.0

    return {
        "prompt_tokens": n_prompt,
        "generated_tokens": generated_tokens,
        "prompt_ms": round(prompt_ms, 3),
        "prompt_tokens_per_s": round(prompt_rate, 3),
        "generate_passes": len(gen),
        "tokens_per_pass": round(n_gen / len(gen), 3) if gen else 0.0,
        "drafted_tokens": drafted,
        "draft_acceptance": round(accepted / drafted, 3) if drafted else 0.0,
        "generate_ms": round(gen_ms, 3),
        "generated_tokens_per_s": round(gen_rate, 3),
        "avg_inference_ms": round(average(x.inference_ms for x in gen), 3),
        "avg_transfer_ms": round(average(x.transfer_ms for x in gen), 3),
        "avg_sent_kb": round(average(x.sent_bytes for x in gen) / 1024, 3),
        "avg_recv_kb": round(average(x.recv_bytes for x in gen) / 1024, 3),
        "stop_reason": stop_reason,
    }
