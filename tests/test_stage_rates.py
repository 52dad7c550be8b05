"""Each stage's rate per unit of its work, from the stage metrics (analysis/stage_rates.py): the measured column
of the cost model in docs/cost.md."""
from __future__ import annotations

from analysis.stage_rates import stage_rate_rows, stage_rates_table


def run(wall: float) -> dict:
    return {"run": {"commit": "a", "wall_time_s": wall}}


METRICS = {
    "prepare": {"records_read": 1000, "wall_time_s": 20.0},
    "distill": {"self": {"new_tokens": 3000, "generation_s": 30.0}, "relabel": {"tokens": 500, "relabel_s": 5.0},
                "train": {"tokens": 9000}, "val": {"tokens": 1000}, **run(40.0)},
    # this stage built the hidden-state cache (900 s); the next read it back (1.5 s)
    "train_medusa1": {"cache_time_s": 900.0, "fit_time_s": 100.0, "epochs": 2, "train_targets_head0": 5000,
                      "train_positions_per_s": {"fit": 100.0}, **run(1000.0)},
    "train_hydra": {"cache_time_s": 1.5, "fit_time_s": 50.0, "epochs": 2, "train_targets_head0": 5000,
                    "train_positions_per_s": {"fit": 200.0}, **run(52.0)},
    # the baseline on 10 questions, two trees on 10 and one on 2, one turn each
    "evaluate_hydra": {"num_questions": 10, "max_new_tokens": 128, "lossless_checked_turns": 22,
                       "methods": {"a": {"questions": 10}, "b": {"questions": 10}, "c": {"questions": 2}}, **run(320.0)},
    "batch_hydra": {"tokens_per_s": {"hydra": {"2": 1.0, "4": 1.0}, "hydra_pld": {"2": 1.0, "4": 1.0}}, **run(400.0)},
}


def test_every_stage_gets_its_unit_amount_and_rate_in_pipeline_order():
    rows = stage_rate_rows(METRICS, plain_step_s=0.1)
    assert [r[0] for r in rows] == ["prepare", "distill", "distill", "train@medusa1", "train@medusa1", "train@hydra",
                                    "evaluate@hydra", "batch@hydra"]
    assert rows[0][2:] == ["1,000", "20", "50 records/s"]
    assert rows[1][4] == "100 tokens/s" and rows[2][4] == "100 tokens/s"
    assert rows[3][1:] == ["hidden states cached (tokens)", "10,000", "900", "11 tokens/s"]   # train + val tokens
    assert rows[4][2:] == ["10,000", "100", "fit 100 positions/s"]            # positions x epochs
    assert rows[5][1].startswith("training positions")                        # a cache read back is not a rate
    assert rows[6][1:] == ["answers of up to 128 new tokens", "32", "320", "10.0 s an answer, 100 plain steps"]
    assert rows[7][2:] == ["4", "400", "100 s a cell"]


def test_a_two_turn_protocol_counts_every_turn_and_nothing_without_times_gives_no_table():
    two_turns = {"evaluate_hydra": {**METRICS["evaluate_hydra"], "lossless_checked_turns": 44}}
    assert stage_rate_rows(two_turns)[0][2] == "64" and "plain steps" not in stage_rate_rows(two_turns)[0][4]
    assert stage_rates_table({"prepare": {"records_read": 5}}) == ""
    assert stage_rates_table(METRICS).startswith("| stage | unit of work | amount | seconds | rate |\n|---|")
