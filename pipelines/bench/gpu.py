"""python -m pipelines.bench.gpu        (make bench-gpu)    [+bench_gpu.shapes=[tiny] +bench_gpu.repeats=5 ...]

A benchmark, not a test: what a decode step costs on the device at hand (a GPU where there is one), on models
built from configs with random weights at the papers' shapes (timing does not depend on the weights):
  vicuna_7b      Llama, 4096 wide, 32 layers, 32 heads, 11008 intermediate, 32k vocabulary (Vicuna-7B's config)
  smollm2_135m   SmolLM2-135M's config (576 wide, 30 layers, 9 heads / 3 KV heads, 49,152 vocabulary)
  tiny           the 2-layer test model (models.base.build_tiny_model): the command's own check, on a CPU
For each shape, under torch's defaults, then the host settings (models/hardware.py, conf host.*), then those with
the static step (models/engine/static_step.py: CUDA graphs; the drafts stay eager), then with the drafts replayed as
CUDA graphs too where the drafter can (static_drafts: models/engine/drafters/graphed.py):
  - our plain step: generate() without a drafter, decode ms a step;
  - transformers' generate, ms a token: plain, and with its static cache (which transformers compiles on CUDA;
    measured in the settings of bench_gpu.hf_static_in, by default the last, so that a long compile comes last);
  - the verify profile: a step verifying n tokens (n up to 128) relative to a 1-token step;
  - each method's drafting (one random-headed family per head config of `pipeline_heads`) on the 63-node tree
    (conf/tree/sparse64.yaml, Medusa's mc_sim_7b_63), a 4-token chain and EAGLE-2's grown tree (conf/tree/eagle2.yaml),
    and a head config's own shape (its bench_trees: DFlash's block as a chain of 15, conf/tree/chain15.yaml):
    draft, verify, accept, commit, step ms, and whether the draft replayed a graph (draft_graph); with
    +bench_gpu.profile_drafting=true also a torch.profiler record of draft() alone (kernel time against wall time:
    where drafting is host-bound); with +bench_gpu.profile_step=true a torch.profiler record of our plain step and
    of transformers' static-cache generate, a token (kernel time, kernels, launches, the longest kernels).
The file is rewritten after every setting, so a run cut short keeps what it measured (`complete` says which shapes
finished).
Writes reports/bench/gpu_<device>.json (bench_gpu.out to change it) with the device, library versions, the
decoder's commit, the date and the host record of each setting; the results document's projection
(analysis/projection.py) reads such a file. Defaults: on CUDA vicuna_7b and smollm2_135m in bfloat16, on a CPU
the tiny shape in float32.
"""
from __future__ import annotations

from pipelines import omp  # noqa: F401,I001  (first: OpenMP's wait policy is read when torch loads)
import copy
import datetime
import json
import re
import subprocess
import time
from pathlib import Path

import torch
import transformers
from omegaconf import DictConfig, OmegaConf, open_dict

from models.base import DTYPES, build_tiny_model
from models.engine.decoding import generate
from models.engine.drafting import make_drafter
from models.engine.static_step import static_summaries
from models.engine.step import DeviceClock, HostEvent
from models.engine.trees import GrownTree, tree_from_config
from models.hardware import apply_host_settings, is_cuda
from models.shared import HeadsConfig
from models.methods import build_heads
from models.measure.draft_profile import device_sync, draft_profile
from models.measure.latency import batch_verify_profile, verify_latency_profile
from models.measure.lossless import judged_difference
from models.measure.step_profile import step_profile
from pipelines.common import conf_option, git_commit, log, stage, write_json
from pipelines.bench.verify import with_fixed_twins
from pipelines.host import apply_host, static_step

# The papers' shapes, as configs (no weights, no download). Vicuna-7B is Llama-7B's shape.
SHAPES = {
    "vicuna_7b": {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                  "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32000,
                  "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
    "smollm2_135m": {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
                     "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": True},
    "tiny": None,                                   # models.base.build_tiny_model's defaults
}
DEFAULTS = {"shapes": None, "device": "auto", "dtype": None, "sizes": [1, 2, 4, 8, 16, 32, 64, 128], "repeats": 15,
            "prefix_len": 300, "new_tokens": 64, "trees": ["sparse64", "chain4", "eagle2"], "families": None,

            "hf_static_in": ["static_drafts"], "settings": None, "out": None, "profile_drafting": False,
            "profile_repeats": 20, "profile_step": False,
            "batch_sizes": None, "batch_tree_sizes": [1, 4, 16, 64],   # None: 1..64 on CUDA, 1, 2, 4, 8 on a CPU
            "dry_run": False}       # true: check the settings and print them, measure nothing (gpu_session.sh's dry run)
FIGURES = {
    "plain_step_ms": "our generate() without a drafter: decode time / steps (ms)",
    "hf_generate_ms_per_token": "transformers' model.generate (greedy, min_new_tokens = max_new_tokens): wall ms / "
                                "new token; hf_generate_static_ms_per_token the same with cache_implementation=static",
    "verify": "verify_latency_profile: a step verifying n tokens (forward + LM head) relative to a 1-token step, "
              "with the static step where the setting has it (static: true); "
              "one_token_ms the 1-token step",
    "batch_verify": "models.measure.latency.batch_verify_profile (host_settings only: a batch decodes eagerly): B rows "
                    "of n tokens each in one forward with the LM head, ms, and relative to a 1-token step at the same "
                    "B (the baseline's batched step): the cost side of speculation against the batch size",
    "drafting": "per family and tree, ms a step of generate() with that drafter: draft, verify (forward incl. LM "
                "head rows), lm_head, accept, commit and the whole step (step_ms); eagle2 is the grown tree "
                "(conf/tree/eagle2.yaml; under static drafts grown at fixed shapes on the device and replayed as a graph), "
                "followed by fixed<n>, a fixed tree of as many verified tokens (grown_over_fixed: the grown step over "
                "its); step_plain_steps, draft_plain_steps: in plain steps; a head config's bench_trees add "
                "its own shape (DFlash's block of 16 as a chain, conf/tree/chain15.yaml)",
    "plain_tokens_equal_host_settings": "under static_step: the plain step's greedy tokens equal those of the eager "
                                        "host_settings run on the same prompt (bf16: a tie may flip one)",
    "seconds": "wall seconds the setting's measurements took",
    "profile": "with bench_gpu.profile_drafting: torch.profiler over draft() alone, repeated from one state "
               "(models/measure/draft_profile.py): wall_ms, device_busy_ms (kernel time), kernels (launches), "
               "host_ops and top_host_ops (ms of host self time a draft); wall well above device_busy: host-bound",
    "step_profile": "with bench_gpu.profile_step: torch.profiler over our plain decode (step_profile) and, where "
                    "transformers' static-cache generate is measured, over that (hf_static_step_profile), a token "
                    "from decodes of 1 and new_tokens tokens (models/measure/step_profile.py): wall_ms, "
                    "device_busy_ms (kernel time), kernels (run), launches (from the host), top_kernels (ms, count)",
    "plain_difference": "under static_step where the plain tokens differ from host_settings': the first difference "
                        "judged by the tie rule (models/measure/lossless.judged_difference, floor 1e-3)",
}


def settings_of(cfg: DictConfig) -> dict:
    """DEFAULTS overridden by cfg.bench_gpu; unknown keys refused with the known ones."""
    given = OmegaConf.to_container(OmegaConf.select(cfg, "bench_gpu", default=OmegaConf.create({})), resolve=True)
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"bench_gpu.{unknown[0]} is not a setting; known: {sorted(DEFAULTS)}")
    s = {**DEFAULTS, **given}
    s["device"] = ("cuda" if torch.cuda.is_available() else "cpu") if s["device"] == "auto" else str(s["device"])
    s["shapes"] = list(s["shapes"] or (["vicuna_7b", "smollm2_135m"] if is_cuda(s["device"]) else ["tiny"]))
    s["dtype"] = s["dtype"] or ("bfloat16" if is_cuda(s["device"]) else "float32")
    s["settings"] = list(s["settings"] or SETTINGS)
    if not s["settings"] or set(s["settings"]) - set(SETTINGS):
        raise ValueError(f"bench_gpu.settings={s['settings']}; use a non-empty list of {list(SETTINGS)}")
    for name in s["shapes"]:
        if name not in SHAPES:
            raise ValueError(f"bench_gpu.shapes names {name!r}; known shapes: {sorted(SHAPES)}")
    if s["dtype"] not in DTYPES:
        raise ValueError(f"bench_gpu.dtype={s['dtype']!r}; use one of {sorted(DTYPES)}")
    if 1 not in s["sizes"]:
        raise ValueError(f"bench_gpu.sizes={s['sizes']} must include 1 (the plain step the others are relative to)")
    return s


def build_shape(name: str, device: str, dtype: str):
    """A model of that shape with random weights, in eval mode on `device`."""
    torch.manual_seed(0)
    if SHAPES[name] is None:
        model, _ = build_tiny_model()
        return model.to(device, DTYPES[dtype]).eval()
    config = transformers.AutoConfig.for_model(**SHAPES[name])
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype],
                                                              attn_implementation="sdpa").eval()
    model.config.name_or_path = f"{name}-shape-random"
    return model


def hf_decode(model, prompt: list[int], device: str, static: bool):
    """k -> transformers' greedy generate of exactly k tokens after the prompt (its static cache where `static`)."""
    ids = torch.tensor([prompt], device=device)
    kw = {"do_sample": False, "pad_token_id": 0, **({"cache_implementation": "static"} if static else {})}
    return lambda k: model.generate(ids, max_new_tokens=k, min_new_tokens=k, **kw)


def hf_ms_per_token(model, prompt: list[int], n: int, device: str, static: bool) -> float:
    """transformers' greedy generate of exactly n tokens after the prompt, wall ms a token (after one warm-up)."""
    decode = hf_decode(model, prompt, device, static)
    decode(n)                                                               # the same shapes: compiled once
    device_sync(torch.device(device))
    t = time.perf_counter()
    decode(n)
    device_sync(torch.device(device))
    return 1e3 * (time.perf_counter() - t) / n


def our_decode(model, prompt: list[int], static: bool = False):
    """k -> our greedy plain decode of exactly k tokens after the prompt (with the static step where `static`)."""
    return lambda k: generate(model, None, prompt, max_new_tokens=k, stop_token_ids=[], static=static)


def family_heads(cfg: DictConfig, families: list[str] | None) -> list[tuple[str, dict]]:
    """(head config name, its resolved config): the first config of each family in cfg.pipeline_heads."""
    out, seen = [], set()
    for name in cfg.pipeline_heads:
        node = copy.deepcopy(cfg)
        with open_dict(node):
            node.heads = conf_option("heads", name)                          # resolved against the whole config
        h = OmegaConf.to_container(node.heads, resolve=True)
        if h["family"] in seen or (families and h["family"] not in families and name not in families):
            continue
        seen.add(h["family"])
        out.append((str(name), h))
    return out


def drafting_costs(cfg, model, prompt, s: dict, static: bool = False, static_drafts: bool | None = None) -> dict:
    """{family: {tree: per-step ms of each part, step_ms, tokens_per_step}}, random heads; static_drafts None: as static."""
    static_drafts = static if static_drafts is None else static_drafts
    out = {}
    for name, h in family_heads(cfg, s["families"]):
        own = list(h.get("bench_trees") or [])            # a head config's own shape (DFlash: its block as a chain)
        trees = with_fixed_twins({t: tree_from_config(conf_option("tree", t)) for t in [*s["trees"], *own]})
        torch.manual_seed(0)
        block = {k: h[k] for k in ("mask_token_id", "sample_from_anchor") if h.get(k) is not None}   # DFlash's
        config = HeadsConfig.for_base(model, h["family"], int(h["num_heads"]), int(h["num_layers"]),
                                      share_lm_head=bool(h.get("share_lm_head", False)), **block)
        param = next(model.parameters())
        with torch.device(param.device):       # initialised where they run: a 7B-wide LM head a head on one host
            heads = build_heads(config, model).to(param.device, param.dtype).eval()   # thread is seconds each
        row = {}
        for tname, tree in trees.items():
            drafter = make_drafter({"kind": "heads", "tree": tree}, heads=heads)
            # warm up: deep enough for the whole tree, so a draft replayed as a graph is captured outside the clock
            generate(model, None, prompt[:32], drafter, max_new_tokens=16, stop_token_ids=[], static=static,
                     static_drafts=static_drafts)
            clock = DeviceClock() if model.device.type == "cuda" else DeviceClock(HostEvent)
            res = generate(model, None, prompt, drafter, max_new_tokens=s["new_tokens"], stop_token_ids=[],
                           static=static, static_drafts=static_drafts, device_clock=clock)
            steps = max(1, res.steps)
            row[tname] = {**{f"{k}_ms": round(1e3 * v / steps, 3) for k, v in res.timings.items()},
                          **{f"device_{k}_ms": round(1e3 * v / steps, 3) for k, v in res.device_timings.items()},
                          "step_ms": round(1e3 * res.decode_time / steps, 3),
                          "tokens_per_step": round(res.mean_accepted_length, 3)}
            if hasattr(drafter, "graph_summary"):
                row[tname]["draft_graph"] = drafter.graph_summary()
            if s["profile_drafting"]:
                row[tname]["profile"] = draft_profile(model, drafter, prompt, repeats=int(s["profile_repeats"]),
                                                      static_drafts=static_drafts)
        for tname, tree in trees.items():             # a grown tree's step over its fixed twin's (as many tokens)
            if isinstance(tree, GrownTree) and f"fixed{tree.nodes}" in row:
                row[tname]["grown_over_fixed"] = round(row[tname]["step_ms"] / row[f"fixed{tree.nodes}"]["step_ms"], 3)
        out[h["family"]] = {"heads": name, **row}
        del heads
    return out


def in_plain_steps(drafting: dict, plain_ms: float) -> None:
    """Each row's step and draft in plain steps (the targets' unit: a grown tree of 60 tokens at most 1.35 plain
    steps for EAGLE, its draft at most 15% of one: device_draft_plain_steps, read from the device's events)."""
    for row in drafting.values():
        for r in (v for v in row.values() if isinstance(v, dict)):
            r["step_plain_steps"] = round(r["step_ms"] / plain_ms, 3)
            r["draft_plain_steps"] = round(r["draft_ms"] / plain_ms, 3)
            if "device_draft_ms" in r:                 # the target's reading: drafting in device time
                r["device_draft_plain_steps"] = round(r["device_draft_ms"] / plain_ms, 3)


def bench_prompt(model, s: dict) -> list[int]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(model.config.vocab_size, (s["prefix_len"],), generator=g).tolist()


def hf_static_figures(model, s: dict) -> dict:
    """transformers' generate with its static cache (compiled on CUDA; the compile can take minutes, so it is timed
    after the setting's other figures are saved), and its step profiled where bench_gpu.profile_step asks; where
    either fails, why."""
    prompt = bench_prompt(model, s)
    try:
        out = {"hf_generate_static_ms_per_token": round(hf_ms_per_token(model, prompt, s["new_tokens"], s["device"],
                                                                        True), 3)}
    except Exception as e:  # noqa: BLE001  (a benchmark row, not the point of the run)
        return {"hf_generate_static_ms_per_token": None, "hf_generate_static_error": f"{type(e).__name__}: {str(e)[:200]}"}
    if s["profile_step"]:
        try:
            out["hf_static_step_profile"] = step_profile(hf_decode(model, prompt, s["device"], True), s["device"],
                                                         n=int(s["new_tokens"]))
        except Exception as e:  # noqa: BLE001
            out["hf_static_step_profile_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return out


def measure_setting(cfg, model, s: dict, setting: str, static: bool) -> dict:
    """Every figure of FIGURES but transformers' static-cache generate, for one shape, with the static step where
    `static`."""
    device, t0 = s["device"], time.perf_counter()
    prompt = bench_prompt(model, s)
    prof = verify_latency_profile(model, s["sizes"], int(s["repeats"]), int(s["prefix_len"]), static=static)
    decode = our_decode(model, prompt, static)
    decode(4)                                                                                   # warm up
    plain = decode(s["new_tokens"])
    row = {"plain_step_ms": round(1e3 * plain.decode_time / max(1, plain.steps), 3),
           "hf_generate_ms_per_token": round(hf_ms_per_token(model, prompt, s["new_tokens"], device, False), 3),
           "verify": {"sizes": prof["sizes"], "relative": [round(x, 4) for x in prof["relative"]],
                      "one_token_ms": round(1e3 * prof["forward_lm_head_s"][0], 3)},
           "plain_tokens": list(plain.new_tokens)}
    if s["profile_step"]:
        row["step_profile"] = step_profile(decode, device, n=int(s["new_tokens"]))
    if setting == "host_settings":
        row["batch_verify"] = batch_verify(model, s)
    row["drafting"] = drafting_costs(cfg, model, prompt, s, static,
                                     static_drafts=False if setting == "static_step" else None)
    in_plain_steps(row["drafting"], row["plain_step_ms"])
    if setting in ("static_step", "static_drafts"):
        row["static_decoders"] = static_summaries()           # graphs captured, sizes that fell back and why
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def batch_verify(model, s: dict) -> dict:
    """The batched verify step against B and tree tokens (FIGURES["batch_verify"])."""
    sizes = s["batch_sizes"] or ([1, 2, 4, 8, 16, 32, 64] if is_cuda(s["device"]) else [1, 2, 4, 8])
    prof = batch_verify_profile(model, sizes, s["batch_tree_sizes"], int(s["repeats"]), int(s["prefix_len"]))
    ms = [[round(1e3 * t, 3) for t in row] for row in prof["seconds"]]
    one = prof["sizes"].index(1) if 1 in prof["sizes"] else 0
    return {"batch_sizes": prof["batch_sizes"], "sizes": prof["sizes"], "ms": ms,
            "relative": [[round(t / row[one], 4) for t in row] for row in ms]}


SETTINGS = ("torch_defaults", "host_settings", "static_step", "static_drafts")


def apply_setting(cfg: DictConfig, device: str, setting: str, default_threads: int) -> tuple[dict, bool]:
    """Put torch in one of SETTINGS for `device`; -> (the host record (models.hardware.host_record), whether the
    setting decodes with the static step: pipelines/host.py static_step)."""
    if setting == "torch_defaults":
        return apply_host_settings(device, threads=default_threads, cudnn_attention=True, static_step=False), False
    if setting in ("static_step", "static_drafts"):
        cfg = copy.deepcopy(cfg)
        with open_dict(cfg):
            cfg.host = {**(OmegaConf.to_container(cfg.get("host") or {}, resolve=True)), "static_step": True}
    return apply_host(cfg, device), static_step(cfg, device)


def device_slug(device: str) -> str:
    """`cuda` -> the GPU's name shortened (NVIDIA H100 80GB HBM3 -> h100_80gb_hbm3); a CPU -> cpu."""
    if not (is_cuda(device) and torch.cuda.is_available()):
        return "cpu"
    name = torch.cuda.get_device_name(torch.device(device)).lower().replace("nvidia", "")
    return re.sub(r"[^a-z0-9]+", "_", name).strip("_")


def driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def run_bench(cfg: DictConfig) -> tuple[Path, dict]:
    """Measure every shape before and after the host settings; write the file; -> (its path, its contents)."""
    s = settings_of(cfg)
    default_threads = torch.get_num_threads()          # torch's own, before any setting
    device = s["device"]
    gpu = torch.cuda.get_device_name(torch.device(device)) if is_cuda(device) and torch.cuda.is_available() else None
    record = {"what": "Decode-step costs of this decoder on the device at hand, models built from configs with "
                      "random weights (timing does not depend on them; accepted lengths here mean nothing)",
              "device": gpu or "cpu", "driver": driver_version() if gpu else None, "torch": torch.__version__,
              "cuda": torch.version.cuda, "transformers": transformers.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
              "decoder_commit": git_commit(), "weights": "random", "dtype": s["dtype"], "attention": "sdpa",
              "figures": FIGURES, "bench_settings": s,
              "settings": {"torch_defaults": f"torch's own: {default_threads} host threads, cuDNN attention on",
                           "host_settings": "the project's host settings (models/hardware.py, conf host.*)",
                           "static_step": "the host settings with the static step (CUDA graphs; CUDA only, so "
                                          "on a CPU the same as host_settings), the drafts eager",
                           "static_drafts": "the static step, and each fixed tree's greedy draft replayed as a CUDA "
                                            "graph where the drafter can (draft_graph says which did)"},
              "shapes": {}}
    path = Path(s["out"] or Path(cfg.paths.reports) / "bench" / f"gpu_{device_slug(device)}.json")
    for name in s["shapes"]:
        t0 = time.perf_counter()
        model = build_shape(name, device, s["dtype"])
        rows = {}
        for setting in s["settings"]:                             # heads are built per setting: not in inference mode
            host, static = apply_setting(cfg, device, setting, default_threads)
            rows[setting] = {"host": {"threads": torch.get_num_threads(),
                                      "cudnn_attention": torch.backends.cuda.cudnn_sdp_enabled(),
                                      "static_step": static, "static_drafts": setting == "static_drafts" and static},
                             "host_record": host, **measure_setting(cfg, model, s, setting, static)}
            if setting in ("static_step", "static_drafts") and "host_settings" in rows:
                ref, got = rows["host_settings"]["plain_tokens"], rows[setting]["plain_tokens"]
                rows[setting]["plain_tokens_equal_host_settings"] = ref == got
                if ref != got:
                    rows[setting]["plain_difference"] = judged_difference(model, bench_prompt(model, s), ref, got,
                                                                          [1] * (len(got) - 1), floor=1e-3)
            log.info("%s, %s: plain step %.2f ms, transformers %.2f ms a token", name, setting,
                     rows[setting]["plain_step_ms"], rows[setting]["hf_generate_ms_per_token"])
            record["shapes"][name] = {"config": SHAPES[name] or {"tiny": "models.base.build_tiny_model defaults"},
                                      "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 3),
                                      "seconds": round(time.perf_counter() - t0, 1), "settings": rows,
                                      "complete": setting == s["settings"][-1]}
            write_json(path, record)         # after every setting: a run cut short keeps what it measured
            if setting in s["hf_static_in"]:
                rows[setting].update(hf_static_figures(model, s))
                write_json(path, record)
        del model
        if is_cuda(device) and torch.cuda.is_available():
            torch.cuda.empty_cache()
    return write_json(path, record), record


@stage
def main(cfg: DictConfig) -> None:
    s = settings_of(cfg)
    if s["dry_run"]:                                 # every setting read and checked; nothing built or timed
        print("bench_gpu dry run:", json.dumps({k: v for k, v in s.items() if k != "dry_run"}, sort_keys=True))
        return
    path, record = run_bench(cfg)
    for name, shape in record["shapes"].items():
        for setting, row in shape["settings"].items():
            steps = ", ".join(f"{f}/{t} {v['step_ms'] / row['plain_step_ms']:.2f}x"
                              for f, trees in row["drafting"].items() for t, v in trees.items() if t != "heads")
            print(f"{name} {setting} ({row['host']}): plain {row['plain_step_ms']:.2f} ms, transformers "
                  f"{row['hf_generate_ms_per_token']:.2f} ms/token; verify x1-token {row['verify']['relative']}; "
                  f"steps in plain steps: {steps}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
