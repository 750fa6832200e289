"""The vLLM backend: vLLM's engine in this process (backend.py, its thread engine.py), fed our token ids,
with our KV connector (connector.py) loading stored blocks into its paged cache. vLLM is imported only
inside these modules."""
