"""Every head method's proposer, registered with the engine by family name: import this module where heads decode
(the engine looks proposers up and never imports a method; training does not need them).

    import models.heads.drafting  # noqa: F401
    drafter = heads_drafter(heads, tree)
"""
from models.heads import autoregressive_proposer, proposers  # noqa: F401  (their @register_proposer)
