"""The conversation log: chat turns kept apart from memories (turns.py, log.py), and formation's writes
that turn them into memories and supersede old ones (formed.py), each mixed into MemoryStore."""
