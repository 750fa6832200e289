"""The parametric tier's distillation: a user's stable memories into a LoRA adapter version.

`selection` (which facts: policy), `data` (per-fact training and gate prompts), `train` (prompt distillation),
`gates` (held-out recall and damage), `job` (one user's run: `distill_user`, and `DistillThread`, the server's
background runner), `cli` (`kvmem distill`). Nothing is imported here: the CLI's `--help` never loads torch.
"""
