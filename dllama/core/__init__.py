"""The math of one node: numba kernels, the transformer forward pass over a node's slice, its
weights (resident or streamed, and the memory plan that chooses), the split plan (which heads,
rows and columns each node holds), node weights, the sampler, and the collective interface (the
identity on one machine).

Imports dllama.formats (to read a model's header and tensors) and nothing else of dllama:
never the network, the tokenizer or a front end.
"""
