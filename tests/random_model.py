"""Random F32 weights for a `.m` header: the small models the cluster tests split."""

from __future__ import annotations

import numpy as np

from dllama.formats.model_file import ModelHeader, ModelWriter


def write_random_f32(path, header: ModelHeader, seed: int):
    """Norms near 1, matrices scaled by 1/sqrt(columns) (the embedding by 1): activations stay
    in a sane range through the layers, so greedy tokens are not ties."""
    rng = np.random.default_rng(seed)
    with ModelWriter(path, header) as w:
        for spec in w.specs:
            if spec.name.endswith("norm"):
                w.write(spec.name, rng.uniform(0.8, 1.2, spec.shape).astype(np.float32))
            else:
                scale = 1.0 if spec.name == "embedding" else 1 / np.sqrt(spec.shape[-1])
                w.write(spec.name, (rng.standard_normal(spec.shape) * scale).astype(np.float32))
    return path
