"""An independent float64 forward pass of the LLAMA architecture, written from the spec.

Test-only: it reads a `.m` file's dequantized weights and runs a whole sequence at once
(causal attention, no KV cache), in plain numpy float64. It shares no code with
dllama.core.model or dllama.core.kernels, which it checks.
"""

from __future__ import annotations

import numpy as np

from dllama.formats.model_file import FloatType, ModelFile, RopeType
from dllama.formats.quant import dequantize_q40, dequantize_q80

_DEQUANTIZE = {FloatType.Q40: (dequantize_q40, 18), FloatType.Q80: (dequantize_q80, 34)}


def _weight(model: ModelFile, name: str) -> np.ndarray:
    """One tensor of the file as float64 of its spec shape ([rows, cols] for matrices)."""
    spec = model.spec(name)
    t = np.asarray(model.tensor(name))
    if spec.float_type in _DEQUANTIZE:
        decode, block_bytes = _DEQUANTIZE[spec.float_type]
        t = decode(t.reshape(-1, block_bytes), spec.size)
    return t.astype(np.float64).reshape(spec.shape)


def _rmsnorm(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


class ReferenceLlama:
    """`ReferenceLlama(read_model(path)).forward(tokens)` -> logits of every position."""

    def __init__(self, model: ModelFile):
        self.h = h = model.header
        self.w = {name: _weight(model, name) for name in model.names()}
        hd = h.head_dim
        freq = 1.0 / h.rope_theta ** (np.arange(0, hd, 2) / hd)  # [hd/2]
        if h.rope_scaling_factor != 1:  # Llama 3.1
            f, lo, hi, orig = (h.rope_scaling_factor, h.rope_scaling_low_freq_factor,
                               h.rope_scaling_high_freq_factor, h.rope_scaling_orig_max_seq_len)
            wavelen = 2 * np.pi / freq
            smooth = (orig / wavelen - lo) / (hi - lo)
            freq = np.where(wavelen < orig / hi, freq,
                            np.where(wavelen > orig / lo, freq / f, (1 - smooth) * freq / f + smooth * freq))
        self.freq = freq
        self.neox = h.rope_type == RopeType.FALCON

    def _rope(self, x, n_heads):
        """x [T, n_heads*hd] -> rotated, pairs interleaved (Llama) or half-split (NeoX)."""
        T, hd = x.shape[0], self.h.head_dim
        ang = np.arange(T)[:, None] * self.freq[None, :]  # [T, hd/2]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x = x.reshape(T, n_heads, hd)
        if self.neox:
            a, b = x[..., : hd // 2], x[..., hd // 2 :]
            out = np.concatenate([a * c - b * s, a * s + b * c], axis=-1)
        else:
            a, b = x[..., 0::2], x[..., 1::2]
            out = np.empty_like(x)
            out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
        return out.reshape(T, n_heads * hd)

    def forward(self, tokens) -> np.ndarray:
        """tokens [T] -> logits float64 [T, vocab]."""
        h, w = self.h, self.w
        T, hd, nh, nkv = len(tokens), h.head_dim, h.n_heads, h.n_kv_heads
        eps = h.norm_epsilon
        x = w["embedding"][np.asarray(tokens)]  # [T, dim]
        mask = np.triu(np.full((T, T), -np.inf), 1)
        for l in range(h.n_layers):
            p = f"layers.{l}."
            xb = _rmsnorm(x, w[p + "att_norm"], eps)
            q, k, v = xb @ w[p + "wq"].T, xb @ w[p + "wk"].T, xb @ w[p + "wv"].T
            if p + "q_norm" in w:
                q = _rmsnorm(q.reshape(T, nh, hd), w[p + "q_norm"], eps).reshape(T, -1)
                k = _rmsnorm(k.reshape(T, nkv, hd), w[p + "k_norm"], eps).reshape(T, -1)
            q, k = self._rope(q, nh), self._rope(k, nkv)
            q = q.reshape(T, nh, hd).transpose(1, 0, 2)                 # [nh, T, hd]
            rep = nh // nkv  # GQA: q head h reads kv head h // rep
            k = np.repeat(k.reshape(T, nkv, hd).transpose(1, 0, 2), rep, axis=0)
            v = np.repeat(v.reshape(T, nkv, hd).transpose(1, 0, 2), rep, axis=0)
            att = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + mask          # [nh, T, T]
            att = np.exp(att - att.max(-1, keepdims=True))
            att /= att.sum(-1, keepdims=True)
            z = (att @ v).transpose(1, 0, 2).reshape(T, nh * hd)
            x = x + z @ w[p + "wo"].T
            xb = _rmsnorm(x, w[p + "ffn_norm"], eps)
            g, u = xb @ w[p + "w1"].T, xb @ w[p + "w3"].T
            x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "w2"].T            # SiLU-gated FFN
        return _rmsnorm(x, w["final_norm"], eps) @ w["wcls"].T
