"""All of the tables of a run, and a table as Markdown or LaTeX.

    tables = build_tables(summary, calibrations, single_runs)      # {"medusa": Table, "hydra": ..., ...}
    text, tex = to_markdown(tables["hydra"]), to_latex(tables["hydra"])
"""
from __future__ import annotations

from analysis.calibration_tables import calibration_table, tree_choice_table
from analysis.tables import Table, category_table, eagle_table, hydra_table, medusa_table, speed_table


def build_tables(summary: dict, calibrations: dict[str, dict] | None = None,
                 single_runs: dict[str, dict] | None = None) -> dict[str, Table]:
    """single_runs: {tag: reports/metrics/evaluate_<tag>.json} of the runs of one method each (the EAGLE table)."""
    tables = {"medusa": medusa_table(summary), "hydra": hydra_table(summary),
              "eagle": eagle_table(summary, single_runs), "speed": speed_table(summary),
              "category": category_table(summary)}
    choice = tree_choice_table(summary, calibrations)
    if choice is not None:
        tables["tree_choice"] = choice
    cal = calibration_table(summary, calibrations or {})
    if cal is not None:
        tables["calibration"] = cal
    return tables


def to_markdown(table: Table) -> str:
    lines = [f"### {table.title}", "", "| " + " | ".join(table.columns) + " |",
             "|" + "|".join("---" for _ in table.columns) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in table.rows]
    lines += [""] + [f"_{n}_" for n in table.notes]
    return "\n".join(lines) + "\n"


LATEX_ESCAPES = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                 "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


def latex_escape(text: str) -> str:
    out = "".join(LATEX_ESCAPES.get(ch, ch) for ch in text)
    return out.replace("±", r"$\pm$").replace("++", "{+}{+}")


def to_latex(table: Table) -> str:
    spec = "ll" + "r" * (len(table.columns) - 2)
    lines = [r"\begin{table}[t]", r"\centering", r"\small", f"\\caption{{{latex_escape(table.title)}}}",
             f"\\label{{tab:{table.name}}}", f"\\begin{{tabular}}{{{spec}}}", r"\toprule",
             " & ".join(latex_escape(c) for c in table.columns) + r" \\", r"\midrule"]
    lines += [" & ".join(latex_escape(c) for c in row) + r" \\" for row in table.rows]
    lines += [r"\bottomrule", r"\end{tabular}"]
    lines += [f"\\par\\footnotesize {latex_escape(n)}" for n in table.notes]
    lines += [r"\end{table}"]
    return "\n".join(lines) + "\n"
