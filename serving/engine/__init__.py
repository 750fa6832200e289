"""The engine: a paged KV pool shared by reference and one forward per step for every row.

- pages.py: the page pool (reference counts, a byte size) and resident items' shared pages
- table.py: one sequence's page table (shared pages, copy-on-write, its own pages from a reservation)
- sequence.py: a request's sequence over the pool, and its admission (wait for pages, then 429)
- runner.py: one forward per step, one attention call per layer over the pages
- sampler.py: every row's token with one host sync

The step scheduler (admission order, chunking under a token budget) is serving/backends/batcher.py, the
model thread serving/backends/model_loop.py.
"""
