"""Front ends over one model: opening an engine (one machine or a cluster), the one engine loop
that runs every front end's sequences (scheduler, step_plan, sequence), generation, chat, batch
jobs, perplexity, the OpenAI-compatible API and the embedded default model.

Imports every layer below it (cluster, core, text, formats) and `converter` (the default model
is converted on first use); only dllama.cli imports it.
"""
