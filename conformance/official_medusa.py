"""The authors' Medusa decoder (PyPI medusa-llm==0.1, plus the HEAD tree code in medusa_head.py) as a server for
the conformance harness (pipelines/conformance.py). Runs ONLY in the conformance environment (.venv-conformance:
transformers 4.34.1, medusa-llm 0.1), never in the project's.

    .venv-conformance/bin/python conformance/official_medusa.py --model M --heads H --work W [--threads 2]

M: the base model folder as the project keeps it (transformers 5); H: heads exported in the official format
(medusa_lm_head.pt + config.json); W: a scratch folder. It prints every fix it applies (stderr), then reads
request files from stdin, one path a line: a JSON object {"tree": "v0.1" | "head63", "ids": [prompt ids],
"max_new_tokens": n}. For each it decodes greedily with the official code, writes <path>.result.json
({"steps": [[root, accepted drafts...] per step], "new_tokens", "seconds"}) and prints that path (stdout).

- tree "v0.1": 0.1's own MedusaModel.medusa_generate with medusa_choices=[1, 7, 6] (top-7 of head 0 times
  top-6 of head 1: 49 nodes), the tree shape 0.1 supports;
- tree "head63": HEAD's sparse-tree loop (the calls of HEAD's medusa_generate, in order) on HEAD's
  mc_sim_7b_63 with HEAD's buffers, candidates and tree decoding (medusa_head.py) and 0.1's model, greedy
  evaluate_posterior and update_inference_inputs (the same in both versions).
Both stop as the official loop does: after the step whose tokens reach max_new_tokens, or at the EOS token.
"""
import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

import medusa.model.medusa_model as mm
import medusa.model.modeling_llama_kv as kv
from medusa.model import utils as utils01

sys.path.insert(0, str(Path(__file__).resolve().parent))
import medusa_head  # noqa: E402
from serve import Recorder, serve as serve_requests  # noqa: E402
from tf4_model import rewrite_model  # noqa: E402  (fix 3: the model folder, rewritten for transformers 4.34)


def say(msg):
    print(msg, file=sys.stderr, flush=True)


def heads_folder(src: Path, dst: Path, model_dir: Path, num_heads: int | None = None) -> Path:
    """The exported heads with config.json naming the rewritten base folder (the loader reads it from there);
    num_heads: medusa_num_heads to load (0.1's loader, strict=False, leaves the file's other heads out)."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src / "medusa_lm_head.pt", dst / "medusa_lm_head.pt")
    cfg = json.loads((src / "config.json").read_text())
    cfg["base_model_name_or_path"] = str(model_dir)
    if num_heads is not None:
        cfg["medusa_num_heads"] = num_heads
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


# -- fixes 1 and 2 --------------------------------------------------------------------------------------
def fix_kv_cache():
    mm.initialize_past_key_values = medusa_head.initialize_past_key_values
    say("fix 1: KV cache shaped by num_key_value_heads (HEAD's initialize_past_key_values) instead of 0.1's "
        "num_attention_heads, which a grouped-query model (SmolLM2: 9 query heads, 3 KV heads) crashes on")


def fix_rope(model):
    base = float(model.config.rope_theta)
    for layer in model.base_model.model.layers:
        attn = layer.self_attn
        attn.rotary_emb = kv.LlamaRotaryEmbedding(attn.head_dim, max_position_embeddings=attn.max_position_embeddings,
                                                  base=base)
    say(f"fix 2: rotary base {base:g} (config.rope_theta) in the vendored Llama, which hard-codes 10000")


@torch.inference_mode()
def check_base(model, model_dir: Path, ids: list[int]) -> float:
    """Max |logit difference| of the patched official Llama against transformers 4.34's own Llama (which reads
    rope_theta and grouped-query attention) on `ids`."""
    from transformers import LlamaForCausalLM
    ref = LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    x = torch.tensor([ids])
    want = ref(x).logits[0]
    got = model.base_model.lm_head(model.base_model.model(input_ids=x)[0])[0]
    return float((want - got).abs().max())


# -- decoding ---------------------------------------------------------------------------------------------
def decode_v01(model, rec, ids, max_new):
    for _ in model.medusa_generate(torch.tensor([ids]), temperature=0.0, max_steps=max_new,
                                   medusa_choices=[1, 7, 6]):
        if rec.emitted >= max_new:
            break


class DropMedusaForward:
    """HEAD's tree_decoding passes medusa_forward=True (HEAD's forward: run the heads too); 0.1's forward
    always runs them and has no such argument."""

    def __init__(self, model):
        self.model = model

    def __call__(self, *args, medusa_forward=True, **kwargs):
        return self.model(*args, **kwargs)


def decode_head63(model, rec, ids, max_new):
    """HEAD's medusa_generate loop, greedy, on mc_sim_7b_63."""
    buffers = model.head63_buffers
    input_ids = torch.tensor([ids])
    if not hasattr(model, "past_key_values"):
        model.past_key_values, model.past_key_values_data, model.current_length_data = \
            mm.initialize_past_key_values(model.base_model)
    pkv, pkv_data, cur_len = model.past_key_values, model.past_key_values_data, model.current_length_data
    cur_len.zero_()
    utils01.reset_medusa_mode(model)
    medusa_logits, logits = utils01.initialize_medusa(input_ids, model, buffers["medusa_attn_mask"], pkv)
    new_token, wrapped = 0, DropMedusaForward(model)
    for _ in range(max_new):
        candidates, tree_candidates = medusa_head.generate_candidates(
            medusa_logits, logits, buffers["tree_indices"], buffers["retrieve_indices"], temperature=0.0)
        medusa_logits, logits, outputs = medusa_head.tree_decoding(
            wrapped, tree_candidates, pkv, buffers["medusa_position_ids"], input_ids, buffers["retrieve_indices"])
        best, accept_length = utils01.evaluate_posterior(logits, candidates, 0.0, 0.09, 0.3)
        input_ids, logits, medusa_logits, new_token = rec(
            input_ids, candidates, best, accept_length, buffers["retrieve_indices"], outputs, logits,
            medusa_logits, new_token, pkv_data, cur_len)
        if rec.emitted >= max_new or model.tokenizer.eos_token_id in input_ids[0, len(ids):]:
            break


def serve(models, rec):
    def decode(req):
        run = decode_v01 if req["tree"] == "v0.1" else decode_head63
        run(models[req["tree"]], rec, req["ids"], int(req["max_new_tokens"]))
    serve_requests(rec, decode)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--heads", required=True, type=Path)
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--check-ids", default="", help="comma-separated ids for the base-model check")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers
    say(f"official side: medusa-llm 0.1 (+ HEAD e2a5d20 tree code), transformers {transformers.__version__}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    model_dir = rewrite_model(args.model, args.work / "model-tf434", say, "fix 3")
    fix_kv_cache()
    # 0.1's medusa_choices give one top-k count per head after the root ([1, 7, 6]: 2 heads), so that tree
    # runs on a 2-head load of the same file; HEAD's 63-node tree on all 4 heads.
    models = {}
    for tree, num_heads in (("v0.1", 2), ("head63", None)):
        heads = heads_folder(args.heads, args.work / f"heads-official-{tree}", model_dir, num_heads)
        model = mm.MedusaModel.from_pretrained(str(heads), torch_dtype=torch.float32).eval()
        if tree == "v0.1":
            ids = [int(t) for t in args.check_ids.split(",") if t] or list(range(1, 40))
            say(f"before fix 2: official base logits differ from transformers 4.34's Llama by "
                f"{check_base(model, model_dir, ids):.3g}")
        fix_rope(model)
        if tree == "v0.1":
            say(f"after fix 2: official base logits differ from transformers 4.34's Llama by "
                f"{check_base(model, model_dir, ids):.3g}")
        say(f"official {tree}: {model.medusa} heads loaded")
        models[tree] = model
    models["head63"].head63_buffers = medusa_head.generate_medusa_buffers(medusa_head.mc_sim_7b_63, device="cpu")
    rec = Recorder(utils01.update_inference_inputs)
    mm.update_inference_inputs = rec
    print(json.dumps({"ready": True, "mc_sim_7b_63": medusa_head.mc_sim_7b_63}), flush=True)
    serve(models, rec)


if __name__ == "__main__":
    main()
