"""Medusa-1 and Medusa-2 (docs/reference.md#heads): K heads on the base's last hidden state, head k guessing the token
k+2 ahead; one family, two recipes.

- family.py: the family (ResBlock heads, models/shared/families.py);
- proposer.py: how it drafts (every head once per tree on h_t);
- training.py: the modules of recipe kinds "medusa1" (frozen backbone) and "medusa2" (LoRA backbone trained jointly
  with the heads, after a heads-only stage) and Medusa2Recipe;
- joint_stage.py: what the joint stage is measured by (head 0 against the positions seen, the backbone's drift);
- formats.py: the authors' Medusa and vLLM's Medusa files.
"""
from models.methods.medusa.family import Medusa
from models.methods.medusa.formats import MEDUSA_FORMAT, VLLM_FORMAT
from models.methods.medusa.proposer import MedusaProposer
from models.methods.medusa.training import Medusa1Module, Medusa2Module
from models.shared.method import Method, RecipeKind

MEDUSA = Method(name="medusa", family=Medusa(), proposer=MedusaProposer,
                recipes=(RecipeKind("medusa1", Medusa1Module), RecipeKind("medusa2", Medusa2Module)),
                formats=(MEDUSA_FORMAT, VLLM_FORMAT))
