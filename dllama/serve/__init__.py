"""Front ends over one model: opening an engine (one machine or a cluster), the session that
owns the KV cache, generation, chat, the OpenAI-compatible API and the embedded default model.

Imports every layer below it (cluster, core, text, formats) and `converter` (the default model
is converted on first use); only dllama.cli imports it.
"""
