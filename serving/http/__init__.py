"""The HTTP surface: the FastAPI app and its routes, the wire formats, auth, limits, idempotency, metrics
and the one place exceptions become OpenAI-style error JSON. Knows the chat path and the backends only
through their interfaces (serving/chat, serving/backends/base.py)."""
