"""Memory formation: atomic facts from the user's log turns (`base.make_extractor`: "rules" or "openai"),
relative dates resolved (`dates`), and consolidation against current memories (`consolidate`).

Pure parts only: the conversation log, the store and the background worker live elsewhere.
"""
