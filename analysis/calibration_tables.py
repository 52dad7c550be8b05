"""The calibration's tables: predicted against replayed and measured accepted lengths per tree, and the calibrated
tree's speedup beside the fixed trees' (analysis/tables.py holds the papers' tables and the helpers both use).

    rows = calibration_rows(summary, load_calibrations("results/calibrate"))     # also plotted (analysis/plots.py)
    table = calibration_table(summary, calibrations);  choice = tree_choice_table(summary, calibrations)
"""
from __future__ import annotations

from analysis.tables import Table, find_method, fmt_speedup, method_trees, ours_label, subset_notes


def calibration_rows(summary: dict, calibrations: dict[str, dict]) -> list[dict]:
    """Predicted vs measured mean accepted tokens per step, per heads and tree.

    One row per greedy tree of calibration.json's "budgets", per chain of its "chains" and per fixed tree of its
    "fixed_trees".
    predicted: the formula from acc[d][r] (pipelines.calibrate); replayed: the held-out greedy
    continuations replayed through the tree as decoding walks it; measured: MT-Bench (pipelines.evaluate),
    for the fixed trees by name and for the chosen budget as tree=optimal; None where not evaluated."""
    rows = []
    for heads, cal in calibrations.items():
        budgets = cal.get("budgets", [])
        items = [(f"budget {b}", b, e) for b, e in budgets.items()] if isinstance(budgets, dict) else \
                [(f"budget {e.get('budget')}", e.get("budget"), e) for e in budgets]
        items += [(f"chain {e.get('budget')}", e.get("budget"), e) for e in cal.get("chains", [])]
        items += [(name, e.get("budget"), e) for name, e in cal.get("fixed_trees", {}).items()]
        for label, nodes, entry in items:
            if not isinstance(entry, dict) or entry.get("predicted_accept_length") is None:
                continue
            shape = label.split(" ")[0] if label.split(" ")[0] in ("budget", "chain") else None
            fixed = shape is None
            chosen = not fixed and cal.get("chosen_budget") is not None and int(nodes) == int(cal["chosen_budget"]) \
                and (cal.get("chosen_shape", "tree") == "chain") == (shape == "chain")
            m = find_method(summary, heads, label if fixed else "optimal") if fixed or chosen else None
            if m is not None and not fixed and m.get("tree_nodes") not in (None, int(nodes)):
                m = None           # the evaluated optimal tree came from another calibration
            replay = entry.get("replay_accept_length")
            rows.append({"heads": heads, "tree": label, "budget": int(nodes), "chosen": chosen,
                         "predicted": float(entry["predicted_accept_length"]),
                         "replayed": None if replay is None else float(replay),
                         "measured": m["accept_length"]["mean"] if m else None,
                         "measured_tree": m["tree"] if m else None})
    return sorted(rows, key=lambda r: (r["heads"], r["budget"], r["tree"]))


def error_text(pred: float, meas: float | None) -> str:
    if meas is None or not meas:
        return "-"
    return f"{pred - meas:+.2f} ({100 * (pred - meas) / meas:+.0f}%)"


def calibration_table(summary: dict, calibrations: dict[str, dict]) -> Table | None:
    rows = calibration_rows(summary, calibrations)
    if not rows:
        return None
    t = Table("calibration", "Calibrated trees: predicted vs measured mean accepted tokens per step",
              ["Heads", "Tree", "Nodes", "Predicted", "Replayed (held-out)", "Measured (MT-Bench)",
               "Error vs replayed", "Error vs measured"])
    for r in rows:
        tree = r["tree"] + (" (chosen: tree=optimal)" if r["chosen"] else "")
        fmt = lambda v: "-" if v is None else f"{v:.2f}"   # noqa: E731
        t.rows.append([r["heads"], tree, str(r["budget"]), fmt(r["predicted"]), fmt(r["replayed"]), fmt(r["measured"]),
                       error_text(r["predicted"], r["replayed"]), error_text(r["predicted"], r["measured"])])
    t.notes.append("Predicted: sum over tree paths of the product of acc[d][r] (pipelines.calibrate, held-out "
                   "distilled prompts). Replayed: the same held-out continuations walked step by step as decoding "
                   f"does. Measured: {ours_label(summary)}. Error = predicted - other.")
    return t


def tree_choice_table(summary: dict, calibrations: dict[str, dict] | None = None) -> Table | None:
    """Speedup of the calibrated tree beside the fixed trees, per heads (issue: is optimal the fastest?)."""
    # cut per step (tree=cut), grown per step (dynamic_optimal) or by a lookup branch (optimal_pld): not fixed
    cut = {m["tree"] for m in summary["methods"].values()
           if m["kind"] == "heads" and (m.get("cut_by_cost") or m.get("lookup_branch") or m.get("grown"))}
    fixed = [t for t in method_trees(summary) if t != "optimal" and t not in cut]
    cut = [t for t in method_trees(summary) if t in cut]
    heads_names = list(dict.fromkeys(m["heads"] for m in summary["methods"].values()
                                     if m["kind"] == "heads" and m.get("tree") == "optimal"))
    if not heads_names:
        return None
    t = Table("tree_choice", "Tree choice: the calibrated tree (tree=optimal) beside the fixed trees, speedup (ours)",
              ["Heads", *fixed, "optimal", *cut, "Optimal nodes", "Predicted (calibrate)", "Optimal vs best fixed"])
    for heads in heads_names:
        opt = find_method(summary, heads, "optimal")
        ms = {tree: find_method(summary, heads, tree) for tree in [*fixed, *cut]}
        best = max((ms[tree]["speedup"]["mean"] for tree in fixed
                    if ms[tree] and ms[tree]["speedup"].get("mean") is not None), default=None)
        o = opt["speedup"].get("mean")
        verdict = "-" if best is None or o is None else f"{o / best:.2f}x " + ("(at least as fast)" if o >= best else "(slower)")
        pred = (calibrations or {}).get(heads, {}).get("chosen", {}).get("predicted_speedup")
        t.rows.append([heads, *[fmt_speedup(ms[tree]["speedup"] if ms[tree] else None) for tree in fixed],
                       fmt_speedup(opt["speedup"]),
                       *[fmt_speedup(ms[tree]["speedup"] if ms[tree] else None) for tree in cut],
                       str(opt.get("tree_nodes") or "-"),
                       "-" if pred is None else f"{pred:.2f}x", verdict])
    t.notes.append(f"{ours_label(summary)}; the trees were calibrated for this model on this machine "
                   "(results/calibrate/<heads>/optimal_tree.json).")
    t.notes += subset_notes(summary)
    return t
