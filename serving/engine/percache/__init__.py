"""The per-request-cache path: each request decodes over a transformers `DynamicCache` of its own.

What the paged engine (serving/engine, runner.py) cannot run decodes here, one batched forward per step
all the same: `kvmem serve --kv-pool-mb 0` (kept as the baseline the engine's figures are measured
against), models whose attention the engine does not run (`runner.supports`: layers other than full or
sliding-window attention, attention not called through transformers' interface) and requests under LoRA
adapters on layers other than linear (GPT-2's Conv1D included) and embedding ones.

- batch.py: `Sequence` (a request's generation state: lifecycle, sampling, chunked prefill, stats; the
  engine's PagedSequence is one too) and the ragged decode step over per-request caches
- packed.py: a step's prefill chunks and decode rows in one forward over per-request caches
- grow.py: a request's cache grows in place (its first forward copies an injected block into a buffer)
"""
