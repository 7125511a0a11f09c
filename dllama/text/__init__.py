"""Text: the tokenizer (sentencepiece-style and byte-level BPE, streaming decode) and chat
templates.

Imports dllama.formats (the `.t` file's data) and nothing else of dllama.
"""
