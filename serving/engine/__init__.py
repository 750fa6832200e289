"""The engine: a paged KV pool shared by reference and one forward per step for every row.

- pages.py: the page pool (reference counts, a byte size, making room by eviction)
- shared_pages.py: resident items' pages, read by reference (a knowledge parent's by its children)
- prefix_cache.py, residency.py: finished requests' pages by token hash; who keeps what, quotas, what goes first
- waiting.py: requests waiting for pages at admission, first come first served
- table.py: one sequence's page table (shared pages, copy-on-write, its own pages as it grows, preemption)
- sequence.py: a request's sequence over the pool, and its admission (400 if never, wait for pages, then 429)
- runner.py: one forward per step, one attention computation per layer over the pages
- plan.py: a step's plan (where each row's K/V lives, what it attends over), read by every layer
- graphs.py: on a GPU, pure decode steps replayed as CUDA graphs over static buffers (bucketed shapes)
- sampler.py: every row's token with one host sync
- lora.py: requests under different LoRA adapters and none in one forward
- batcher.py: the step scheduler (prefill chunks under the token budget, every decode row, preemption)
- model_loop.py: the one thread that runs the model (requests' steps, block builds)
- detok.py, stops.py: a request's incremental detokenizer and stop-string matcher
- sessions.py: live sessions' page tables, kept between a conversation's turns (bounded, per user)
- errors.py: what the engine raises to the layers above it (PoolFull, PoolTooSmall)

Every request of the transformers backend runs here: one decode path. (The per-request-cache design it
replaced is kept in benchmarks/engine/percache/ as the baseline of the engine's figures, never served.)
"""
