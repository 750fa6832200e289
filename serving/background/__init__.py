"""What the server runs beside its requests: start-up (model load, plan restore), memory formation and the
parametric tier's distillation, each off the request path."""
