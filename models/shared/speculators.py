"""What the speculators library's checkpoints (0.9) share across methods (EAGLE-3's in models/methods/eagle/
speculators_format.py, DFlash's in models/methods/dflash/speculators_format.py): the version their config classes
follow, the taps its loader takes, and the verifier it loads.
"""
from __future__ import annotations

from pathlib import Path

from models.base import model_name

SPECULATORS_VERSION = "0.9.0"          # the library whose config classes the writers follow (make interop)


def check_taps(taps: tuple[int, ...], num_layers: int) -> None:
    """speculators' loader takes distinct hidden-states indices in [0, L]: refuse others, naming them."""
    if len(set(taps)) != len(taps) or min(taps) < 0 or max(taps) > num_layers:
        raise ValueError(f"taps {list(taps)} on a {num_layers}-layer base: speculators' loader takes distinct "
                         f"hidden-states indices in [0, {num_layers}] (a base of fewer than 7 layers repeats one; "
                         "export it with format=eagle3)")


def verifier_of(base_model) -> dict:
    """speculators_config.verifier: the base by name, or by absolute path when the name is a local folder (vLLM
    and the library load the verifier from it)."""
    name = model_name(base_model)
    path = Path(name)
    architectures = list(getattr(base_model.config, "architectures", None) or [type(base_model).__name__])
    return {"name_or_path": str(path.resolve()) if path.is_dir() else name, "architectures": architectures}
