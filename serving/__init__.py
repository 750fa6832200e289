"""serving: the OpenAI-compatible endpoint; imports kvmem and scheduler, nothing imports serving."""
