"""The drafting methods, one package each; importing this package registers every one of them with the shared
machinery (models/shared/: the family registry, recipe kinds, format registry). The engine imports no method; the
shared base imports none either (it imports this package by name when asked for a family, recipe kind or format not
registered yet). Their proposers are registered by models/methods/drafting.py, which decoding code imports (training
never drafts).

    medusa/        Medusa-1 and Medusa-2 (the joint LoRA stage)
    hydra/         Hydra and Hydra++ (its prefix layer: HydraPPHeads)
    eagle/         EAGLE-1 and EAGLE-3 (their layers, the "eagle" drafter kind, their formats)
    draft_model/   a small draft model (SpS)

A method's package holds its family (what its module is: a HeadFamily and, when it owns more than heads, a DraftHeads
subclass), its recipe kinds (a HeadsModule registered with register_recipe, its recipe dataclass when it has own
fields), its formats, and in drafting.py its proposer registration. Adding one: README.md#adding-a-method.
"""
# registrations, in the order the registries list them (formats: medusa, vllm, hydra, eagle, eagle3, speculators)
from models.methods import medusa  # noqa: F401
from models.methods import hydra  # noqa: F401
from models.methods import eagle  # noqa: F401
from models.methods import draft_model  # noqa: F401
