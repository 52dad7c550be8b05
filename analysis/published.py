"""Published numbers (docs/reference.md#published-numbers) as data, each cell with its model, hardware and source.

    from analysis.published import PUBLISHED, published_cells
    published_cells(table="hydra", model="Vicuna-7B")   # -> [PublishedCell(...), ...]

Method keys match ours: medusa1, medusa2, hydra, hydra_pp, pld, eagle, eagle2, eagle3, sps, dflash, lookahead, rest.
In the Hydra paper, on Spec-Bench and in the EAGLE-3 paper the "Medusa" column is Medusa-1-style heads on the
frozen base (key medusa1); sps is speculative sampling with a small draft model (Spec-Bench's 68M one).

Tables: medusa, hydra, specbench (the earlier Spec-Bench leaderboard, in the Hydra table), specbench_2025 (the
leaderboard at commit fd2c1cd) and eagle3 (the EAGLE-3 paper), the last two in the EAGLE table, and dflash (the
DFlash paper: its claims row and its projection row).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

MEDUSA_SOURCE = "Medusa paper/repo (Cai et al., ICML 2024)"
HYDRA_SOURCE = "Hydra paper (Ankner et al., COLM 2024)"
SPECBENCH_SOURCE = "Spec-Bench (Xia et al.)"
SPECBENCH_2025_SOURCE = "Spec-Bench leaderboard, commit fd2c1cd, April 2025 (Xia et al.)"
EAGLE3_SOURCE = "EAGLE-3 paper (Li et al., arXiv 2503.01840)"
DFLASH_SOURCE = "DFlash paper (Chen et al., arXiv 2602.06036)"
# The sources name the A100 for Medusa and Spec-Bench; the Hydra and EAGLE-3 papers' figures come with no device.
A100, HYDRA_HW, EAGLE3_HW, H200 = "A100", "GPU", "GPU", "H200"
# What each table's cells are labelled with beside the model and hardware (else "paper").
SOURCE_TAGS = {"specbench": "Spec-Bench", "specbench_2025": "Spec-Bench fd2c1cd"}


@dataclass(frozen=True)
class PublishedCell:
    table: str          # medusa | hydra | specbench | specbench_2025 | eagle3 | dflash
    model: str          # base model, e.g. Vicuna-7B
    method: str         # medusa1 | medusa2 | hydra | hydra_pp | pld | eagle | eagle2 | eagle3 | sps | ...
    metric: str         # speedup | accept_length
    value: float
    hardware: str
    source: str

    @property
    def label(self) -> str:
        """Where the number came from, as printed beside it: "Vicuna-7B, A100 (paper)"."""
        return f"{self.model}, {self.hardware} ({SOURCE_TAGS.get(self.table, 'paper')})"

    def as_dict(self) -> dict:
        return {**asdict(self), "label": self.label}


def _cells(table, source, hardware, rows):
    """rows: {model: {method: (speedup, accept_length or None)}} -> list of cells."""
    out = []
    for model, methods in rows.items():
        for method, (speedup, accept) in methods.items():
            out.append(PublishedCell(table, model, method, "speedup", speedup, hardware, source))
            if accept is not None:
                out.append(PublishedCell(table, model, method, "accept_length", accept, hardware, source))
    return out


PUBLISHED: list[PublishedCell] = [
    # Medusa: speedup over autoregressive, MT-Bench, batch 1, A100; Medusa-1 Vicuna-7B accept length ~2.57.
    *_cells("medusa", MEDUSA_SOURCE, A100, {
        "Vicuna-7B": {"medusa1": (2.18, 2.57), "medusa2": (2.83, None)},
        "Vicuna-13B": {"medusa1": (2.33, None), "medusa2": (2.83, None)},
        "Vicuna-33B": {"medusa2": (2.35, None)},
        "Zephyr-7B": {"medusa2": (2.66, None)},
    }),
    # Hydra: speedup / mean acceptance length, MT-Bench, greedy, batch 1, 63-node tree.
    *_cells("hydra", HYDRA_SOURCE, HYDRA_HW, {
        "Vicuna-7B": {"medusa1": (2.13, 2.58), "hydra": (2.36, 3.04), "hydra_pp": (2.70, 3.70)},
        "Vicuna-13B": {"medusa1": (1.97, 2.60), "hydra": (2.17, 3.06), "hydra_pp": (2.50, 3.72)},
        "Vicuna-33B": {"medusa1": (1.93, 2.55), "hydra": (2.15, 2.95), "hydra_pp": (2.53, 3.62)},
    }),
    # Spec-Bench, Vicuna-7B, A100, MT-Bench: speedup / mean accepted tokens.
    *_cells("specbench", SPECBENCH_SOURCE, A100, {
        "Vicuna-7B": {"eagle2": (2.84, 4.34), "eagle": (2.45, 3.58), "hydra": (2.43, 3.26),
                      "medusa1": (1.97, 2.31), "pld": (1.60, 1.75), "lookahead": (1.47, 1.64)},
    }),
    # Spec-Bench leaderboard at commit fd2c1cd (A100 80 GB, greedy): speedup / mean accepted tokens. Same accepted
    # lengths as the earlier version above, lower speedups; SpS drafts with a 68M model.
    *_cells("specbench_2025", SPECBENCH_2025_SOURCE, A100, {
        "Vicuna-7B": {"eagle2": (2.36, 4.34), "eagle": (2.10, 3.58), "hydra": (2.07, 3.26), "medusa1": (1.71, 2.31),
                      "sps": (1.52, 2.28), "pld": (1.66, 1.75), "rest": (1.48, 1.82), "lookahead": (1.34, 1.64)},
        "Vicuna-13B": {"eagle3": (3.02, 5.71), "eagle2": (2.46, 4.43)},
    }),
    # EAGLE-3 paper, greedy: speedup / mean accepted tokens (its "Medusa" is Medusa-1).
    *_cells("eagle3", EAGLE3_SOURCE, EAGLE3_HW, {
        "Vicuna-13B": {"eagle3": (5.58, 6.65), "eagle2": (4.26, 4.83), "eagle": (3.07, 3.98), "medusa1": (2.07, 2.59)},
        "LLaMA-3.1-8B": {"eagle3": (4.40, 6.13)},
    }),
    # DFlash paper, MT-Bench, greedy, H200: DFlash's block of 16 against EAGLE-3 on a 16-token tree.
    *_cells("dflash", DFLASH_SOURCE, H200, {
        "Qwen3-8B": {"dflash": (2.75, 4.24), "eagle3": (1.63, 2.83)},
    }),
]


def published_cells(table: str | None = None, model: str | None = None, method: str | None = None,
                    metric: str | None = None) -> list[PublishedCell]:
    """Cells matching every given field (None matches all)."""
    want = {"table": table, "model": model, "method": method, "metric": metric}
    return [c for c in PUBLISHED if all(v is None or getattr(c, k) == v for k, v in want.items())]


def published_value(table: str, model: str, method: str, metric: str = "speedup") -> PublishedCell | None:
    cells = published_cells(table, model, method, metric)
    return cells[0] if cells else None


def published_models(table: str) -> list[str]:
    """Base models of a table, in the papers' order."""
    return list(dict.fromkeys(c.model for c in published_cells(table)))
