"""The drafters, one module each, and their protocol (base.py; a proposer's: proposer.py). make_drafter, the kinds a
spec may name and the names callers use are in models/engine/drafting.py: this package's __init__ imports nothing, so
that a method's proposer, which needs the protocol only, does not bring in every drafter."""
