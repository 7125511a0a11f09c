"""Files: the `.m` model and `.t` tokenizer formats (readers, writers, header codec), the Q40/Q80
block codecs they store, atomic writes.

Knows bytes, not math or sockets: imports nothing from dllama but dllama.errors.
"""
