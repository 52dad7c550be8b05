"""What a results document says about the run that made it: the commit, the CPU and its flags, the dates and each
stage's wall time, from the run record every stage writes into its metrics (pipelines.common.run_record)."""
from __future__ import annotations

from analysis.run_record import provenance_lines, stage_times_table
from models.hardware import cpu_flags
from pipelines.common import run_record

AMX = "processor\t: 0\nmodel name\t: Intel Xeon\nflags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 amx_tile amx_bf16\n"


def record(commit, wall, cpu="AMD EPYC", date="2026-11-26T15:00:00Z"):
    return {"run": {"commit": commit, "cpu": cpu, "cpu_flags": ["avx2", "avx512_bf16"], "cpu_count": 2,
                    "date": date, "wall_time_s": wall}}


def test_a_stage_records_its_commit_machine_and_date():
    r = run_record()
    assert len(r["commit"]) == 40 or r["commit"] == "unknown"
    assert r["cpu"] and r["cpu_count"] >= 1 and r["date"].endswith("Z") and r["wall_time_s"] is None  # no stage ran
    assert cpu_flags(AMX) == ["avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"]
    assert cpu_flags("flags\t: fpu sse2\n") == []


def test_one_commit_is_named_once_and_two_are_named_stage_by_stage():
    one = {"prepare": record("a" * 40, 60), "train_hydra": record("a" * 40, 600), "evaluate_hydra": record("a" * 40, 1200)}
    line = provenance_lines(one)[0]
    assert line.startswith(f"Commit {'a' * 12}; CPU AMD EPYC, 2 cores, flags avx2 avx512_bf16; run from") and "3 stages" in line
    mixed = {**one, "calibrate_hydra": record("b" * 40, 30, date="2026-11-27T10:00:00Z")}
    line = provenance_lines(mixed)[0]
    assert line.startswith("Commits: ") and f"{'b' * 12} (calibrate@hydra)" in line and "to 2026-11-27T10:00:00Z" in line
    assert "predate" in provenance_lines({"prepare": {"wall_time_s": 5}})[0]


def test_stage_times_cover_every_stage_in_pipeline_order_with_their_sum():
    metrics = {"evaluate_hydra": record("a", 1200), "prepare": {"wall_time_s": 60.0}, "calibrate_hydra": record("a", 90),
               "train_hydra": record("a", 600), "references": record("a", 900)}
    rows = [line.split(" | ")[0].strip("| ") for line in stage_times_table(metrics).splitlines()[2:]]
    assert rows == ["prepare", "train@hydra", "calibrate@hydra", "references", "evaluate@hydra", "all of the above"]
    assert stage_times_table(metrics).splitlines()[-1] == "| all of the above | 47 min 30 s | 2,850 |"
    # in plain steps: the seconds over the machine's plain step, so that a run on another CPU compares with this one
    assert stage_times_table(metrics, 0.075).splitlines()[-1] == "| all of the above | 47 min 30 s | 2,850 | 38,000 |"


def test_a_resumed_stage_says_how_many_invocations_its_time_sums_and_calibrate_latency_has_its_row():
    from analysis.run_record import run_markdown

    resumed = record("a", 5400)
    resumed["run"]["invocations"] = 3
    metrics = {"train_hydra": record("a", 600), "evaluate_hydra": resumed, "batch_hydra": record("a", 1800)}
    latency = {"model": "m", "baseline_step_s": 0.1, "run": {"commit": "a", "wall_time_s": 60.0}}
    text = run_markdown({}, metrics, latency)
    table = text.split("| stage |")[1].splitlines()[2:]
    rows = [line.split(" | ")[0].strip("| ") for line in table if line.startswith("| ")]
    assert rows[:-1] == ["train@hydra", "calibrate_latency", "evaluate@hydra (3 invocations)", "batch@hydra"]
    assert "| all of the above | 2 h 11 min | 7,860 | 78,600 |" in text


def test_the_stages_time_is_judged_against_three_hours_at_a_20_ms_plain_step_in_plain_steps():
    from analysis.run_record import budget_line

    # 540,000 plain steps: 3 hours where a step is 20 ms, 15 hours where it is 100 ms
    line = budget_line({"evaluate_hydra": record("a", 15 * 3600)}, 0.100)
    assert line.startswith("The stages above took 540,000 plain steps of this machine (15 h 00 min)")
    assert "is 540,000 plain steps (15 h 00 min here): within the target." in line
    assert budget_line({"evaluate_hydra": record("a", 15 * 3600 * 1.2)}, 0.100).endswith(": 20% over the target.")
    assert budget_line({"evaluate_hydra": record("a", 60)}, None) == ""


def test_the_run_section_states_the_machine_in_plain_steps_and_its_weight_read_floor():
    from analysis.run_record import machine_line

    latency = {"model": "SmolLM2-135M-Instruct", "baseline_step_s": 0.0712,
               "weight_read": {"seconds": 0.0123, "bytes": 538e6, "gb_per_s": 43.7}}
    assert machine_line(latency) == ("This machine's plain step (a 1-token decoding step of SmolLM2-135M-Instruct): "
                                     "71.2 ms; reading every weight once (538 MB): 12.3 ms (43.7 GB/s), the floor of a "
                                     "memory-bound step.")
    assert machine_line({**latency, "omp_wait": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None}}).endswith(
        "memory-bound step; OpenMP wait policy: PASSIVE.")
    assert machine_line({**latency, "omp_wait": {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None}}).endswith(
        "; OpenMP wait policy: libgomp's default (spin, then sleep).")
    assert machine_line(None) == ""


def test_plots_keep_their_whole_titles(tmp_path):
    """A title wider than its axes is saved whole: the image grows to hold it (it was cut at the right edge)."""
    import matplotlib.image as mpimg
    import matplotlib.pyplot as plt

    from analysis.plots import _save

    fig, ax = plt.subplots(figsize=(3, 2))
    title = ax.set_title("Paired comparisons (green: A ahead, red: B ahead, grey: no clear difference) " * 2)
    fig.canvas.draw()
    width = title.get_window_extent().width * 120 / fig.dpi           # in the saved image's pixels (dpi 120)
    image = mpimg.imread(_save(fig, tmp_path / "long_title.png"))
    assert image.shape[1] >= width > 3 * 120
