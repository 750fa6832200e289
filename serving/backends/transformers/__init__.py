"""The transformers backend: the embedded default engine's front (backend.py), its LoRA adapters
(adapters.py) and its block builds (builds.py), all run in serving/engine's steps."""
