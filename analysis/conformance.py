"""The conformance report (reports/conformance.json, written by `make conformance`) as Markdown: our decoder against
the authors' Medusa code, step by step and in tokens/s, for reports/conformance.md and the results document."""
from __future__ import annotations

TREE_NAMES = {"v0.1": "0.1, [1, 7, 6] (49 nodes)", "head63": "HEAD, mc_sim_7b_63 (63 nodes)"}

NOTE = ("tokens/s (prefill included) are medians over questions and repeats, the two decoders alternating question "
        "by question, their order swapped each time; the machine is shared and noisy, so only the ratio within a row "
        "means much. Baseline: our decoder without drafts, measured just before, not interleaved.")


def conformance_table(report: dict) -> str:
    lines = ["| case | tree | steps compared | identical | steps with accepted drafts | tokens/step | "
             "ours tok/s | official tok/s | ours / official | baseline tok/s |", "|---" * 10 + "|"]
    for name, case in report["cases"].items():
        for tree, row in case["trees"].items():
            tps = row["tokens_per_second"]
            same = "yes" if row["identical"] else f"no: {row['first_mismatch']}"
            lines.append(f"| {name} ({case['questions']} q x {case['new_tokens']} tok) | {TREE_NAMES[tree]} | "
                         f"{row['steps_compared']} | {same} | {row['steps_accepting_drafts']} | "
                         f"{row['mean_tokens_per_step']:.2f} | {tps['ours']:.2f} | {tps['official']:.2f} | "
                         f"{tps['ours'] / tps['official']:.2f}x | {case.get('baseline_tokens_per_second', 0):.2f} |")
    return "\n".join(lines) + "\n"


def conformance_markdown(report: dict) -> str:
    """reports/conformance.md."""
    return "\n".join(["# Our decoder against the authors' Medusa code", "",
                      f"`make conformance` ({report['machine']}, {report['threads']} threads, greedy; "
                      f"docs/conformance.md). {NOTE}", "", conformance_table(report)])


def conformance_section(report: dict) -> str:
    """The results document's section: the same table, under the official code's version."""
    return "\n".join([f"`make conformance` against {report.get('official', 'the official code')} "
                      f"({report['machine']}, {report['threads']} threads, greedy), the same exported heads, prompts "
                      f"and trees; `identical`: the same accepted drafts and tokens on every compared step. {NOTE}",
                      "", conformance_table(report)])
