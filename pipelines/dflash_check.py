"""python -m pipelines.dflash_check     (make dflash-check)     [--seed 0 --layers 2 --block 16 --fit-steps 12]

DFlash's export read by the authors' own code: a seeded DFlash drafter on an 8-layer tiny Llama is written with
export.format=dflash (models/methods/dflash/dflash_format.py), and the authors' package, in its own environment
(.venv-dflash, built here on first use: torch 2.13.0, transformers 5.15.0, dflash 0.1.0 without its dependencies;
never a dependency of the project), loads it with DFlashDraftModel.from_pretrained and runs its forward
(conformance/official_dflash.py) on the same context features, block and positions as ours; then the authors'
dflash_generate decodes a few prompts greedily on the same base and drafter, and our decoder decodes them with the
drafter on a chain of block - 1 drafts; then the same for a copy fitted to the base's greedy continuations of those
prompts (models/methods/dflash/seeded.py: some of its drafts accepted); then that copy is written with
export.format=speculators and the speculators library (.venv-speculators, conformance/speculators_dflash.py) loads
it and runs its anchored-block forward. Passes when the authors' block outputs equal ours within 1e-5, the layer
ids, block size and mask token are ours, every whole-block step of both drafters drafts the same block and produces
the same tokens (near the length limit, the outputs: compare()), the fitted drafter is accepted at some step, and
the library loads every key and gives our logits within 1e-5 with the same argmax; then a seeded DSpark drafter of
each Markov kind (vanilla, gated, rnn; and the rnn with sample_from_anchor, every slot drafting), written with
export.format=speculators, is loaded as the library's `dspark` type and run through its own forward, and must give
our biased logits and confidence logits within 1e-5 with the same argmax, and its loss (its eager terms, against its
verifier's distribution and against one-hot tokens) our training's within 1e-6. Writes reports/dflash_check.json, the
authors' steps for the seeded drafter to tests/golden/dflash_conformance.json (which tests/test_dflash.py replays
without the package) and the library's DSpark logits and loss to tests/golden/speculators_dspark.json
(tests/test_dspark.py, tests/test_dspark_loss.py), and exits non-zero when a check fails.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from models.engine.decoding import generate
from models.engine.drafting import heads_drafter
from models.engine.taps import final_and_taps
from models.engine.trees import chain_tree
from models.methods import export_heads
from models.methods.dflash.seeded import fitted_copy, seeded
from pipelines.common import REPO_ROOT, write_json
from pipelines.conformance_harness import SPECULATORS_PACKAGES, SPECULATORS_VENV, official_env

VENV = REPO_ROOT / ".venv-dflash"
PACKAGES = (["torch==2.13.0"], ["transformers==5.15.0", "safetensors"], ["--no-deps", "dflash==0.1.0"])
RUNNER = REPO_ROOT / "conformance" / "official_dflash.py"
SPECULATORS_RUNNER = REPO_ROOT / "conformance" / "speculators_dflash.py"
REPORT = REPO_ROOT / "reports" / "dflash_check.json"
GOLDEN = REPO_ROOT / "tests" / "golden" / "dflash_conformance.json"
DSPARK_GOLDEN = REPO_ROOT / "tests" / "golden" / "speculators_dspark.json"
DSPARK_KINDS = {"dspark": ("dspark", False), "dspark_gated": ("dspark_gated", False),   # (family, sample_from_anchor)
                "dspark_rnn": ("dspark_rnn", False), "dspark_rnn_from_anchor": ("dspark_rnn", True)}
LOSS_TOLERANCE = 1e-6
PROMPTS = 3                 # random prompts of 12 tokens
NEW_TOKENS = 40
TOLERANCE = 1e-5
REPEATS = 5                 # timed decodes of each prompt a side (the median), as conformance/official_dflash.py


def our_steps(model, heads, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    """Our decoder on each prompt with the drafter on a chain of block - 1 drafts: every step's drafts and produced
    tokens, and the output, in the layout of the authors' side (conformance/official_dflash.py)."""
    out = []
    for ids in prompts:
        drafter, drafts = heads_drafter(heads, chain_tree(heads.dflash.block_size - 1)), []
        draft = drafter.draft
        drafter.draft = lambda root, depth: drafts.append(draft(root, depth)) or drafts[-1]
        res = generate(model, None, ids, drafter, max_new_tokens=new_tokens, stop_token_ids=[])
        steps = [{"drafts": d.tokens[1:].tolist(), "produced": n} for d, n in zip(drafts, res.accept_lengths)]
        times = sorted(generate(model, None, ids, heads_drafter(heads, chain_tree(heads.dflash.block_size - 1)),
                                max_new_tokens=new_tokens, stop_token_ids=[]).wall_time for _ in range(REPEATS))
        out.append({"output_tokens": res.new_tokens, "steps": steps, "seconds": times[REPEATS // 2]})
    return out


def speed(ours: list[dict], theirs: list[dict]) -> dict:
    """Tokens a second of each decoder over the same prompts (one thread each, the same drafter and base; each
    prompt's median of REPEATS decodes), and
    ours over theirs: a tiny base, so this is each decoder's own per-step overhead, not a model's speed."""
    def tps(runs):
        return sum(len(r["output_tokens"]) for r in runs) / sum(r["seconds"] for r in runs)
    return {"ours_tokens_per_s": tps(ours), "theirs_tokens_per_s": tps(theirs), "ours_over_theirs": tps(ours) / tps(theirs)}


def compare(ours: list[dict], theirs: list[dict], full: int) -> dict:
    """Each prompt's steps compared while both sides draft a whole block of `full` drafts (the same drafts and the
    same tokens produced), then its output. Near the length limit the authors' dflash_generate shortens the block
    (to the positions left, one more than can be emitted) and ours drafts the whole trained block and reads what can
    be emitted; a block's length changes every position's draft (it attends to itself both ways), so from there on
    a prompt is compared by its output tokens (tail_steps)."""
    compared, tail, first = 0, 0, None
    for q, (a, b) in enumerate(zip(ours, theirs)):
        if a["output_tokens"] != b["output_tokens"] and first is None:
            first = {"prompt": q, "output": True}
        for s, (x, y) in enumerate(zip(a["steps"], b["steps"])):
            if len(x["drafts"]) != full or len(y["drafts"]) != full:
                tail += len(a["steps"][s:])
                break
            compared += 1
            if x != y and first is None:
                first = {"prompt": q, "step": s, "ours": x, "theirs": y}
    return {"steps_compared": compared, "tail_steps": tail, "identical": first is None, "first_mismatch": first,
            "steps_accepting_drafts": sum(s["produced"] > 1 for p in theirs for s in p["steps"]
                                          if len(s["drafts"]) == full)}


def authors_forward(model, heads, work: Path, g: torch.Generator) -> dict:
    """Our export loaded by the authors' DFlashDraftModel; its block outputs against ours on random context features."""
    module, C, Q = heads.dflash, 12, heads.dflash.block_size
    features = torch.randn(1, C, module.fc.in_features, generator=g)
    block = torch.full((1, Q), module.mask_token_id)
    block[0, 0] = 7
    pos = torch.arange(C + Q)[None]
    with torch.no_grad():
        ours = module(features, block, pos)
    export_heads(heads, model, work / "draft", "dflash")
    torch.save({"target_hidden": features, "noise_embedding": module.embed(block), "position_ids": pos,
                "ours": ours}, work / "inputs.pt")
    out = subprocess.run([str(official_env(VENV, PACKAGES)), str(RUNNER), "--draft", str(work / "draft"),
                          "--inputs", str(work / "inputs.pt")], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def authors_steps(model, heads, work: Path, name: str, prompts: list[list[int]]) -> tuple[dict, list]:
    """dflash_generate on the prompts with `heads` exported to work/name, against our decoder step by step ->
    (the comparison, the authors' steps); the base is read from work/target."""
    export_heads(heads, model, work / name, "dflash")
    run = subprocess.run([str(official_env(VENV, PACKAGES)), str(RUNNER), "--draft", str(work / name), "--target",
                          str(work / "target"), "--prompts", str(work / "prompts.json"), "--new-tokens",
                          str(NEW_TOKENS)], check=True, capture_output=True, text=True)
    official = json.loads(run.stdout.strip().splitlines()[-1])["prompts"]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        our_steps(model, heads, prompts[:1], 4)                                  # warm-up, as theirs
        ours = our_steps(model, heads, prompts, NEW_TOKENS)
        return {**compare(ours, official, heads.dflash.block_size - 1), "speed": speed(ours, official)}, official
    finally:
        torch.set_num_threads(before)


def trained(model, heads, prompts: list[list[int]], steps: int):
    """A copy of `heads` fitted to the base's greedy continuations of the prompts (seeded.fitted_copy: in float64,
    the same on any CPU), so that the authors' decoding is compared where drafts get accepted too; the golden
    file's trained case, which tests/test_dflash.py rebuilds the same way."""
    sequences = [p + generate(model, None, p, max_new_tokens=NEW_TOKENS, stop_token_ids=[]).new_tokens
                 for p in prompts]
    return fitted_copy(model, heads, sequences, steps)


def block_outputs(model, heads, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(features [1, T, w], logits [T - 1, D, Vd], confidence logits [T - 1, D] or None): row r is the block rooted
    at x_{r+1} over the context 0..r, its D drafting slots (from first_slot) scored as decoding scores them; DSpark's
    with the Markov bias of the true token before each slot's target (slot 0's: the root), the rnn's state run from
    slot 0."""
    module, h, T = heads.dflash, model.config.hidden_size, ids.shape[1]
    f, bs = module.first_slot, module.block_size
    with torch.no_grad():
        feats = final_and_taps(model.get_decoder(), ids, module.taps, position_ids=torch.arange(T)[None])[..., h:]
        if getattr(heads, "markov", None) is None:
            drafts = module.unroll(feats, ids, module.depths)
            return feats, torch.stack([heads.lm_head(0, d[0]) for d in drafts], 1), None
        slots = torch.stack([d[0] for d in module.unroll(feats, ids, module.depths, with_anchor=True)], 1)
        tokens = ids[0, (torch.arange(1, T)[:, None] + torch.arange(bs)).clamp(max=T - 1)]   # x_{r+1}, x_{r+2}, ..
        prev = tokens if f == 0 else torch.cat([tokens[:, :1], tokens[:, :-1]], 1)       # [root, root, x_{r+2}, ..]
        return (feats, heads.block_logits(slots, prev)[:, f:], heads.accept_logits(slots, prev)[:, f:])


def before_final_norm(model, ids: torch.Tensor) -> torch.Tensor:
    """The base's last states before its final norm [1, T, h] (the library's verifier_last_hidden_states)."""
    seen = {}
    hook = model.get_decoder().norm.register_forward_hook(lambda m, args, out: seen.update(x=args[0]))
    try:
        with torch.no_grad():
            model.get_decoder()(input_ids=ids)
    finally:
        hook.remove()
    return seen["x"]


def our_dspark_loss(model, heads, ids: torch.Tensor, anchors: list[int], gamma: float, alpha: float) -> dict:
    """Our DSpark training loss (DSparkFitModule.block_loss, dspark_loss) on the blocks at `anchors` of ids [1, T]
    (every slot's target an assistant token), as the library's runner reports its own: "teacher" against the
    base's distribution (lm 0, teacher 1), "one_hot" against the tokens (lm 1, teacher 0); each its "total" and its
    "confidence" term."""
    from models.methods.dflash.dspark_training import DSparkFitModule, DSparkRecipe
    from models.methods.dflash.training import draw_blocks

    module, h, T = heads.dflash, model.config.hidden_size, ids.shape[1]
    with torch.no_grad():
        both = final_and_taps(model.get_decoder(), ids, module.taps, position_ids=torch.arange(T)[None])
        starts = torch.tensor(anchors)[None]
        blocks = draw_blocks(ids, torch.ones_like(ids, dtype=torch.bool), module, len(anchors), gamma,
                             anchors=(starts, torch.ones_like(starts, dtype=torch.bool)))
        out = module(both[..., h:], blocks.ids.view(1, -1), blocks.pos, mask=blocks.layout)
        out = out.view(1, len(anchors), module.block_size, -1)
        index = heads.to_draft_index(blocks.target)
        result = {}
        for name, lm, teacher in (("teacher", 0.0, 1.0), ("one_hot", 1.0, 0.0)):
            recipe = DSparkRecipe(kind="dspark", loss_decay_gamma=gamma, confidence_alpha=alpha, lm_loss_weight=lm,
                                  teacher_loss_weight=teacher)
            fit = DSparkFitModule(heads, model, recipe)
            loss, _, _, extra = fit.block_loss(out, blocks, index, blocks.weight * (index >= 0), both[..., :h])
            result[name] = {"total": float(loss), "confidence": float(extra["confidence_loss"])}
    return result


def loss_difference(ours: dict, theirs: dict) -> float:
    return max(abs(ours[k][t] - theirs[k][t]) for k in theirs for t in theirs[k])


def speculators_check(model, heads, work: Path, prompt: list[int], name: str = "speculators") -> tuple[dict, dict]:
    """export.format=speculators loaded by the speculators library (conformance/speculators_dflash.py, in its own
    environment) -> (verdict: its loading report, and its logits, and DSpark's confidence logits, at every block
    slot 1.. of every anchor against ours; the library's result)."""
    export_heads(heads, model, work / name, "speculators")
    ids, f = torch.tensor(prompt)[None], heads.dflash.first_slot
    feats, ours, confidence = block_outputs(model, heads, ids)
    torch.save({"hidden_states": feats, "input_ids": ids, "verifier_last_hidden_states": before_final_norm(model, ids)},
               work / f"{name}_inputs.pt")
    subprocess.run([str(official_env(SPECULATORS_VENV, SPECULATORS_PACKAGES)), str(SPECULATORS_RUNNER), "--draft",
                    str(work / name), "--inputs", str(work / f"{name}_inputs.pt"), "--out",
                    str(work / f"{name}.json")], check=True)
    result = json.loads((work / f"{name}.json").read_text())
    anchors = [a for a in result["anchors"] if a >= 1]             # ours: row a - 1 (anchor 0 has no context)
    at = [result["anchors"].index(a) for a in anchors]
    theirs, mine = torch.tensor(result["logits"])[at, f:], ours[[a - 1 for a in anchors]]
    report = result["loading_report"]
    verdict = {"versions": result["versions"], "model_class": result["model_class"],
               "missing_keys": report["missing_keys"], "unexpected_keys": report["unexpected_keys"],
               "mismatched_keys": report["mismatched_keys"],
               "file_keys_not_in_model": result["file_keys_not_in_model"],
               "file_tensors_loaded_unchanged": result["file_tensors_loaded_unchanged"], "anchors": len(anchors),
               "max_abs_logit_difference": float((theirs - mine).abs().max()),
               "same_argmax": int((theirs.argmax(-1) == mine.argmax(-1)).sum()),
               "positions": mine.shape[0] * mine.shape[1]}
    if confidence is not None:
        theirs_c = torch.tensor(result["confidence"])[at, f:]
        verdict["max_abs_confidence_difference"] = float((theirs_c - confidence[[a - 1 for a in anchors]]).abs().max())
        ours_loss = our_dspark_loss(model, heads, ids, result["anchors"], result["gamma"], result["confidence_alpha"])
        verdict.update(loss=result["loss"], our_loss=ours_loss,
                       max_abs_loss_difference=loss_difference(ours_loss, result["loss"]))
    return verdict, result


def speculators_passed(v: dict) -> bool:
    # the library fills the embedding and a full-vocabulary LM head from the verifier: those two may be "missing"
    filled = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    return (not set(v["missing_keys"]) - filled and not v["unexpected_keys"] and not v["mismatched_keys"]
            and not v["file_keys_not_in_model"] and v["file_tensors_loaded_unchanged"]
            and v["max_abs_logit_difference"] <= TOLERANCE and v["same_argmax"] == v["positions"]
            and v.get("max_abs_confidence_difference", 0.0) <= TOLERANCE
            and v.get("max_abs_loss_difference", 0.0) <= LOSS_TOLERANCE)


def write_dspark_golden(library: dict, prompt: list[int], args, path: Path = DSPARK_GOLDEN, topk: int = 5) -> None:
    """The library's DSpark logits (top-k at the drafting slots of every anchor), confidence logits and loss, each
    seeded kind (DSPARK_KINDS), for tests/test_dspark.py to replay against our seeded drafter without the library."""
    kinds = {}
    for kind, result in library.items():
        family, from_anchor = DSPARK_KINDS[kind]
        f = 0 if from_anchor else 1
        top = torch.tensor(result["logits"])[:, f:].topk(topk, dim=-1)
        kinds[kind] = {"family": family, "sample_from_anchor": from_anchor, "anchors": result["anchors"],
                       "topk_ids": top.indices.tolist(), "topk_values": top.values.tolist(),
                       "confidence": torch.tensor(result["confidence"])[:, f:].tolist(), "loss": result["loss"],
                       "gamma": result["gamma"], "confidence_alpha": result["confidence_alpha"]}
    about = ("the speculators library's DSparkDraftModel (its training forward, compute_metrics recording its inputs "
             "and computing its loss with its eager terms) on seeded DSpark drafters exported with "
             "export.format=speculators, an 8-layer tiny Llama: top-k logits at the drafting block slots and "
             "confidence logits of every anchor, and the loss against the verifier's distribution (teacher) and "
             "against the drafted tokens (one_hot); written by `make dflash-check`")
    golden = {"about": about, "versions": next(iter(library.values()))["versions"], "seed": args.seed,
              "layers": args.layers, "block": args.block, "prompt": prompt, "kinds": kinds}
    path.write_text(json.dumps(golden, separators=(",", ":")) + "\n")


def without_times(runs: list[dict]) -> list[dict]:
    return [{k: v for k, v in p.items() if k != "seconds"} for p in runs]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[2])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--fit-steps", type=int, default=12, help="Adam steps of the trained drafter (12: some of its "
                    "drafts accepted, most rejected)")
    args = ap.parse_args(argv)
    model, heads = seeded(args.seed, args.layers, args.block)
    module = heads.dflash
    g = torch.Generator().manual_seed(args.seed + 1)
    work = Path(tempfile.mkdtemp(prefix="dflash-check-"))
    theirs = authors_forward(model, heads, work, g)
    prompts = torch.randint(model.config.vocab_size - 1, (PROMPTS, 12), generator=g).tolist()
    model.save_pretrained(work / "target")
    model.config.name_or_path = str(work / "target")               # the verifier speculators loads
    (work / "prompts.json").write_text(json.dumps(prompts))
    steps, official = authors_steps(model, heads, work, "draft", prompts)
    fitted = trained(model, heads, prompts, args.fit_steps)
    trained_steps, trained_official = authors_steps(model, fitted, work, "trained", prompts)
    speculators, _ = speculators_check(model, fitted, work, sum(prompts, []))    # 36 tokens: 20 whole blocks
    dspark, library = {}, {}
    for kind, (family, from_anchor) in DSPARK_KINDS.items():   # DSpark's export, the library's `dspark` type
        _, drawn = seeded(args.seed, args.layers, args.block, family=family, sample_from_anchor=from_anchor)
        dspark[kind], library[kind] = speculators_check(model, drawn, work, sum(prompts, []), kind)
    verdict = {**theirs, "steps": steps, "trained_steps": trained_steps, "speculators": speculators,
               "speculators_dspark": dspark,
               "ours": {"target_layer_ids": module.target_layer_ids, "block_size": module.block_size,
                        "mask_token_id": module.mask_token_id},
               "tolerance": TOLERANCE, "settings": vars(args), "packages": [a for s in PACKAGES for a in s]}
    verdict["passed"] = (theirs["max_abs_diff"] <= TOLERANCE and theirs["target_layer_ids"] == module.target_layer_ids
                         and theirs["block_size"] == module.block_size
                         and theirs["mask_token_id"] == module.mask_token_id and steps["identical"]
                         and trained_steps["identical"] and trained_steps["steps_accepting_drafts"] > 0
                         and speculators_passed(speculators) and all(map(speculators_passed, dspark.values())))
    write_json(REPORT, verdict)
    if verdict["passed"]:
        write_json(GOLDEN, {"about": "the authors' dflash_generate (dflash 0.1.0, greedy) on a seeded DFlash drafter "
                                     "and an 8-layer tiny Llama: each step's drafted block and produced tokens "
                                     "(official); the same for that drafter fitted fit_steps Adam steps to the "
                                     "base's greedy continuations in float64 (trained_official, drafts accepted); "
                                     "written by `make dflash-check`",
                            **vars(args), "new_tokens": NEW_TOKENS, "prompts": prompts,
                            "official": without_times(official), "trained_official": without_times(trained_official),
                            "trained_steps_accepting_drafts": trained_steps["steps_accepting_drafts"]})
        write_dspark_golden(library, sum(prompts, []), args)
    print(json.dumps(verdict, indent=2))
    return verdict


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
