"""scheduler: decides which memories live in which tier; imports kvmem, never serving."""
