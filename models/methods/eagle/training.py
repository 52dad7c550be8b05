"""EAGLE-1's and EAGLE-3's training: the autoregressive drafters' module (models/shared/autoregressive/training.py,
its loss terms chosen by the recipe: EAGLE-1 a feature loss and a teacher loss on the first depth with noisy inputs,
EAGLE-3 a teacher loss on every unrolled depth), registered under their recipe kinds."""
from __future__ import annotations

from models.shared.autoregressive.training import AutoregressiveFitModule
from models.shared.recipes import AutoregressiveRecipe
from models.shared.training import register_recipe

register_recipe("eagle", AutoregressiveRecipe)(AutoregressiveFitModule)
register_recipe("eagle3", AutoregressiveRecipe)(AutoregressiveFitModule)
