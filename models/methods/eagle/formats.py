"""The EAGLE formats, listed by the EAGLE methods (models/methods/eagle/__init__.py): `eagle` (the authors' EAGLE-1
code), `eagle3` (vLLM's and SGLang's EAGLE-3 loaders) and `speculators` (the speculators library's EAGLE-3 checkpoint,
written only)."""
from __future__ import annotations

from models.methods.eagle.eagle3_format import read_eagle3, write_eagle3
from models.methods.eagle.eagle_format import read_eagle, write_eagle
from models.methods.eagle.speculators_format import write_speculators
from models.shared.formats import Format

EAGLE_FORMAT = Format("eagle", ("eagle",), write_eagle, read_eagle)
EAGLE3_FORMAT = Format("eagle3", ("eagle3",), write_eagle3, read_eagle3)
SPECULATORS_FORMAT = Format("speculators", ("eagle3",), write_speculators,
                            why_not="speculators 0.9 has no layout for them")
