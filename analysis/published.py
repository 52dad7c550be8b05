"""Published numbers (docs/reference.md#published-numbers) as data, each cell with its model, hardware and source.

    from analysis.published import PUBLISHED, published_cells
    published_cells(table="hydra", model="Vicuna-7B")   # -> [PublishedCell(...), ...]

Method keys match ours: medusa1, medusa2, hydra, hydra_pp, pld, eagle, eagle2, lookahead.
In the Hydra paper the "Medusa" column is Medusa-1-style heads on the frozen base (key medusa1).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

MEDUSA_SOURCE = "Medusa paper/repo (Cai et al., ICML 2024)"
HYDRA_SOURCE = "Hydra paper (Ankner et al., COLM 2024)"
SPECBENCH_SOURCE = "Spec-Bench (Xia et al.)"
# The sources name the A100 for Medusa and Spec-Bench; the Hydra paper names no device for its table.
A100, HYDRA_HW = "A100", "GPU"


@dataclass(frozen=True)
class PublishedCell:
    table: str          # medusa | hydra | specbench
    model: str          # base model, e.g. Vicuna-7B
    method: str         # medusa1 | medusa2 | hydra | hydra_pp | pld | ...
    metric: str         # speedup | accept_length
    value: float
    hardware: str
    source: str

    @property
    def label(self) -> str:
        """Where the number came from, as printed beside it: "Vicuna-7B, A100 (paper)"."""
        return f"{self.model}, {self.hardware} ({'Spec-Bench' if self.table == 'specbench' else 'paper'})"

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
