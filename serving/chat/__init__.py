"""The chat path: a request's plan and search laid out as prompt ids (prepare.py), the backend's stream
turned into OpenAI JSON or SSE (service.py), and which of OpenAI's parameters are served (openai_params.py).
Knows nothing of routes or of how a backend runs its steps."""
