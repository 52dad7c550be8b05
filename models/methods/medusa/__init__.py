"""Medusa-1 and Medusa-2 (docs/reference.md#heads): K heads on the base's last hidden state, head k guessing the token
k+2 ahead.

- family.py: the family (ResBlock heads, models/shared/families.py);
- training.py: recipe kinds "medusa1" (frozen backbone) and "medusa2" (LoRA backbone trained jointly with the heads,
  after a heads-only stage) and Medusa2Recipe;
- joint_stage.py: what the joint stage is measured by (head 0 against the positions seen, the backbone's drift);
- formats.py: the authors' Medusa and vLLM's Medusa files (models/shared/formats.py registry);
- drafting.py: its proposer registration (imported by models/methods/drafting.py).
"""
from models.methods.medusa import family, formats, joint_stage, training  # noqa: F401  (registrations)
