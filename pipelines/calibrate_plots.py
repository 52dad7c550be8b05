"""The calibrate stage's plots: the verify latency profile, and per heads the rank-accuracy heatmap and the predicted
tokens/s of every tree and chain (pipelines/calibrate.py writes them beside calibration.json)."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def plot_latency(record: dict, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(record["sizes"], [1e3 * s for s in record["seconds"]], marker="o", label="decoder forward")
    ax.plot(record["sizes"], [1e3 * s for s in record["forward_lm_head_s"]], marker=".", ls="--",
            label="forward + LM head on every token")
    ax.legend(fontsize=7)
    ax.set_xlabel("tokens verified (tree nodes + root)")
    ax.set_ylabel(f"verify step, ms ({record['statistic']} of {record['repeats']})")
    ax.set_title(f"{record['model']} on {record['machine']['processor']} ({record['machine']['torch_threads']} threads)",
                 fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_calibration(result: dict, folder: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc = np.array(result["acc"])
    fig, ax = plt.subplots(figsize=(6, 0.6 * acc.shape[0] + 1.5))
    im = ax.imshow(acc, cmap="viridis", aspect="auto", vmin=0)
    for (d, r), v in np.ndenumerate(acc):
        ax.text(r, d, f"{v:.2f}", ha="center", va="center", fontsize=7, color="w" if v < acc.max() / 2 else "k")
    ax.set_xticks(range(acc.shape[1]))
    ax.set_yticks(range(acc.shape[0]), [f"{d + 1} (n={n})" for d, n in enumerate(result["acc_counts"])])
    ax.set_xlabel("rank r")
    ax.set_ylabel("depth d")
    ax.set_title(f"{result['heads']}: P(rank r is the base's token | path above acceptable)", fontsize=9)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    heatmap = folder / "acc_heatmap.png"
    fig.savefig(heatmap, dpi=120)
    plt.close(fig)

    rows = result["budgets"]
    fig, ax1 = plt.subplots(figsize=(6, 4))
    b = [r["budget"] for r in rows]
    ax1.plot(b, [r["predicted_tokens_per_s"] for r in rows], marker="o", color="C0", label="predicted tokens/s")
    chains = result.get("chains", [])
    ax1.plot([r["budget"] for r in chains], [r["predicted_tokens_per_s"] for r in chains], marker="s", ls="--",
             color="C4", label="predicted tokens/s, chains")
    ax1.axhline(result["baseline_tokens_per_s"], color="C0", ls=":", label="autoregressive baseline")
    ax1.scatter([result["chosen_budget"]], [result["chosen"]["predicted_tokens_per_s"]], s=120, facecolors="none",
                edgecolors="C3", label="chosen")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("tree nodes (budget)")
    ax1.set_ylabel("tokens / s")
    ax2 = ax1.twinx()
    ax2.plot(b, [r["predicted_accept_length"] for r in rows], marker=".", color="C1", label="predicted accept length")
    ax2.plot(b, [r["replay_accept_length"] for r in rows], marker="x", ls="--", color="C2", label="replayed accept length")
    ax2.set_ylabel("tokens / step")
    lines = ax1.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax1.legend(lines, [ln.get_label() for ln in lines], fontsize=7, loc="lower right")
    m = result["machine"]
    ax1.set_title(f"{result['heads']} on {m.get('gpu', m['processor'])}, {m['torch_threads']} threads", fontsize=9)
    fig.tight_layout()
    speed = folder / "tokens_per_s.png"
    fig.savefig(speed, dpi=120)
    plt.close(fig)
    return [heatmap, speed]
