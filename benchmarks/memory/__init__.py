"""Memory quality: formation (extraction, supersession) on synthetic, held-out and public sets; retrieval recall and the second stage; distillation into LoRA; the demo bot's answers."""
