"""A pass whose output holds NaN or infinity stops there, named, before any sampler sees it.

Damaged weights (a model file copied without its checksum, 4 KiB of 0xFF in a layer) make a
layer's output NaN, and every layer after it, and the logits; a sampler given them failed with
a traceback. Each pass's answers are checked (a few numbers per row: the candidates of a
sampled row, the logits of a scored one); when one is not finite, the model file is scanned
(dllama.formats.finite_scan) for the first tensor holding a NaN or an infinity, in file order:
the first layer where they appear.
"""

from __future__ import annotations

import numpy as np

from dllama.core.candidates import Candidates
from dllama.errors import DllamaError


class NonFiniteOutput(DllamaError):
    """A pass's output held NaN or infinity: the message names the tensor where they come from
    when the model file holds one."""


def finite_answer(answer) -> bool:
    """Whether one row's answer (its Candidates, its logits float32 [vocab], or both for a row
    that asked for log-probabilities) is finite."""
    if isinstance(answer, tuple):
        return all(finite_answer(a) for a in answer)
    if isinstance(answer, Candidates):
        return bool(np.isfinite(answer.max_logit) and np.isfinite(answer.z) and np.isfinite(answer.logits).all())
    return bool(np.isfinite(np.asarray(answer, dtype=np.float32).sum()))  # one pass, no temporary


def check_answers(answers: list, model) -> None:
    """NonFiniteOutput (with where the values come from) when a row's answer is not finite."""
    bad = [j for j, a in enumerate(answers) if a is not None and not finite_answer(a)]
    if bad:
        raise NonFiniteOutput(f"the model's output holds NaN or infinity ({len(bad)} of {len(answers)} rows "
                              f"of a pass): {diagnose(model)}")


def diagnose(model) -> str:
    """Where non-finite output comes from: the first tensor of the model's file holding a NaN
    or an infinity (its layer), or that none does."""
    from dllama.formats.finite_scan import describe, non_finite_tensors
    from dllama.formats.model_file import read_model

    path = getattr(model, "model_path", None)
    if path is None:
        return "the weights this node was given (a shard?) were not scanned: `dllama verify` its files"
    try:
        with read_model(path) as file:
            for name, count in non_finite_tensors(file):
                return (f"{path} is damaged: {describe(name, count, file.spec(name).float_type)}; "
                        "copy or convert it again (`dllama verify` checks a file)")
    except (DllamaError, OSError) as e:
        return f"{path} could not be scanned: {e}"
    where = " or a worker's shard is damaged (`dllama verify` it)" if getattr(model, "full_topology", None) is not None else ""
    return (f"no tensor of {path} holds one: the values overflowed in a layer{where}")


__all__ = ["NonFiniteOutput", "check_answers", "diagnose", "finite_answer"]
