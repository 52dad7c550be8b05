"""The recipes as this run trained them, read from the train stage's metrics (reports/metrics/train_<heads>.json),
so that what the results say about the run is the run's, not a hand-written memory of an earlier one.

    recipes_section(train)      # {heads: train metrics} -> markdown: the table and the rules' costs, "" without any

Beside each recipe it states what the profile's rules cost where the authors did more: the epochs (every family
trains as long as Medusa-1's recipe; a recipe that asks more is capped, and its head-0 curve says whether it was still
rising), and the published settings the project departs from for every run (PUBLISHED_DEPARTURES).
"""
from __future__ import annotations

# Published settings both profiles depart from, by heads name, each with its reason (docs/protocol.md, the recipe
# table): (what, the metric it is read from, the authors' value, why).
PUBLISHED_DEPARTURES = {
    "eagle3": ("depths unrolled", "unroll", 7, "a cost cut: each depth runs the layer over every position again"),
    "medusa1": ("heads", "num_heads", 3, "one head count for every head family (Medusa-2, Hydra and Hydra++ have 4)"),
}
RISING = 0.01        # head-0 val top-1 still rising: it gained at least this much in the last epoch trained


def loss_terms(recipe: dict) -> str:
    """The loss a recipe trained with, from its weights."""
    terms = []
    if recipe.get("lm_loss_weight"):
        terms.append(f"{recipe.get('lm_loss', 'ce').upper()} x {recipe['lm_loss_weight']:g}")
    if recipe.get("teacher_loss_weight"):
        terms.append(f"teacher x {recipe['teacher_loss_weight']:g}")
    if recipe.get("feature_loss_weight"):
        terms.append(f"feature x {recipe['feature_loss_weight']:g}")
    if recipe.get("medusa_lambda") is not None:
        terms.append(f"heads x {recipe['medusa_lambda']:g} ({recipe.get('lambda_schedule', 'constant')})")
    return ", ".join(terms) or "-"


def noise(recipe: dict) -> str:
    width, ref = recipe.get("feature_noise") or 0, recipe.get("noise_reference_length")
    if not width:
        return "-"
    return f"{width:g} x {ref} / T" if ref else f"{width:g} (fixed)"


def head0_curve(m: dict) -> list[float]:
    """Head-0 val top-1 after each epoch of the run's last stage (Medusa-2: the heads-only stage's epochs)."""
    by_stage = m.get("val_top1_head0_by_epoch") or {}
    stage = "fit" if "fit" in by_stage else next(iter(by_stage), None)
    return list(by_stage.get(stage) or [])


def recipe_row(name: str, m: dict) -> str:
    r, curve = m.get("recipe") or {}, head0_curve(m)
    own = m.get("recipe_epochs")
    epochs = f"{m.get('epochs')}" + (f" (recipe {own})" if own and own != m.get("epochs") else "")
    unroll = r.get("unroll")
    return (f"| {name} | {epochs} | {r.get('lr', float('nan')):g} | {loss_terms(r)} | {m.get('dropout', 0):g} | "
            f"{noise(r)} | {unroll if unroll and unroll > 1 else '-'} | "
            + (" -> ".join(f"{v:.3f}" for v in curve) or "-") + " |")


def rule_costs(train: dict[str, dict]) -> list[str]:
    """A sentence per recipe the epoch cap shortened, and per published setting the project departs from."""
    out = []
    for name, m in sorted(train.items()):
        own, epochs, curve = m.get("recipe_epochs"), m.get("epochs"), head0_curve(m)
        if own and epochs and own > epochs:
            rising = len(curve) > 1 and curve[-1] - curve[-2] >= RISING
            trend = f"still rising ({curve[-2]:.3f} -> {curve[-1]:.3f} in its last epoch)" if rising else \
                f"{curve[-1]:.3f} after its last" if curve else "no curve recorded"
            out.append(f"- {name}: its recipe asks {own} epochs, the equal-epochs rule trains {epochs}; head 0 "
                       f"{trend}" + (f", with dropout {m['dropout']:g}" if m.get("dropout") else "") + ".")
        if name in PUBLISHED_DEPARTURES:
            label, key, published, why = PUBLISHED_DEPARTURES[name]
            ours = (m.get("recipe") or {}).get("unroll") if key == "unroll" else len(m.get("val_top1") or {}) or None
            if ours is not None and ours != published:
                out.append(f"- {name}: {ours} {label}, the authors' {published}: {why}.")
    return out


def recipes_section(train: dict[str, dict]) -> str:
    """The table of the recipes as trained and what the rules cost them; "" without train metrics."""
    if not train:
        return ""
    lines = ["| heads | epochs | lr | loss | dropout | input noise | depths unrolled | head-0 val top-1 by epoch |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [recipe_row(name, m) for name, m in sorted(train.items())]
    costs = rule_costs(train)
    return "\n".join(lines) + "\n" + ("\nWhat the rules cost where the authors did more:\n\n" + "\n".join(costs) + "\n"
                                      if costs else "")
