"""The per-request-cache design the engine (serving/engine) replaced, kept only as the baseline its figures are
measured against (engine_bench, batch_decode, batch_agreement); the server never runs it.

Each request decodes over a transformers `DynamicCache` of its own, whose first forward copies an injected
block into a buffer; a step's decode rows run as one forward with ragged attention (each row over its own
cache), and prefill chunks can be packed into that forward.

- batch.py: `Sequence` (a request's generation state over its own cache) and the ragged decode step
- packed.py: a step's prefill chunks and decode rows in one forward over per-request caches
- grow.py: a request's cache grows in place (its first forward copies an injected block into a buffer)
"""
