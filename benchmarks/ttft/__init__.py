"""Time to first token: KV injection against a full prefill (MemOS's grid), on vLLM, over HTTP, per conversation turn; exactness of injection; shared knowledge blocks; prompt layout time."""
