"""pytest tests/test_recipes_run.py: the results' account of the recipes as the run trained them comes from the train
stage's metrics (analysis/recipes_run.py), and so does what the profile's rules cost them."""
from __future__ import annotations

from analysis.recipes_run import recipes_section


def train_metrics(recipe: dict, curve: list[float], epochs: int = 2, recipe_epochs: int = 2, dropout: float = 0.0,
                  heads: int = 4) -> dict:
    return {"recipe": recipe, "val_top1_head0_by_epoch": {"fit": curve}, "epochs": epochs,
            "recipe_epochs": recipe_epochs, "dropout": dropout,
            "val_top1": {f"head{k}": 0.3 for k in range(heads)}}


def test_the_table_and_the_rules_costs_come_from_the_metrics():
    train = {
        "hydra_pp": train_metrics({"lr": 1e-3, "teacher_loss_weight": 1.0}, [0.291, 0.355], recipe_epochs=10,
                                  dropout=0.2),
        "eagle": train_metrics({"lr": 1e-3, "teacher_loss_weight": 0.1, "feature_loss_weight": 1.0,
                                "feature_noise": 0.2, "noise_reference_length": 512}, [0.400, 0.405],
                               recipe_epochs=20),
        "eagle3": train_metrics({"lr": 1e-3, "teacher_loss_weight": 1.0, "unroll": 5}, [0.33, 0.39]),
        "medusa1": train_metrics({"lr": 1e-3, "lm_loss_weight": 1.0}, [0.32, 0.34]),
        "hydra": train_metrics({"lr": 1e-3, "lm_loss_weight": 1.0}, [0.40, 0.43], heads=3),
    }
    text = recipes_section(train)
    assert "| hydra_pp | 2 (recipe 10) | 0.001 | teacher x 1 | 0.2 | - | - | 0.291 -> 0.355 |" in text
    assert "| eagle | 2 (recipe 20) | 0.001 | teacher x 0.1, feature x 1 | 0 | 0.2 x 512 / T | - |" in text
    assert "| eagle3 | 2 | 0.001 | teacher x 1 | 0 | - | 5 | 0.330 -> 0.390 |" in text
    assert ("hydra_pp: its recipe asks 10 epochs, the equal-epochs rule trains 2; head 0 still rising "
            "(0.291 -> 0.355 in its last epoch), with dropout 0.2.") in text
    assert "eagle: its recipe asks 20 epochs, the equal-epochs rule trains 2; head 0 0.405 after its last." in text
    assert "eagle3: 5 depths unrolled, the authors' 7" in text and "medusa1: 4 heads, the authors' 3" in text
    assert "hydra:" not in text.split("did more:")[1]               # its recipe's own count, no departure


def test_no_train_metrics_no_section_and_a_fixed_noise_says_so():
    assert recipes_section({}) == ""
    text = recipes_section({"eagle": train_metrics({"lr": 1e-3, "feature_noise": 0.2}, [])})
    assert "| 0.2 (fixed) |" in text and "did more" not in text
