"""The authors' EAGLE-1 decoder (PyPI eagle-llm==1.2.1, its EaModel.eagenerate, unchanged) as a server for the
conformance harness (pipelines/conformance_eagle.py). Runs ONLY in the EAGLE conformance environment
(.venv-conformance-eagle: transformers 4.36.2, eagle-llm 1.2.1), never in the project's.

    .venv-conformance-eagle/bin/python conformance/official_eagle.py --model M --eagle E --work W [--threads 2]

M: the base model folder as the project keeps it (transformers 5); E: an EAGLE layer exported in the authors'
format (config.json + pytorch_model.bin with fc.*, layers.0.*, embed_tokens.weight: models/methods/eagle/eagle_format.py);
W: a scratch folder. It prints every fix it applies (stderr), then one JSON line on stdout ({"ready": true,
"tree": the static tree's paths}), then reads request files from stdin, one path a line: a JSON object
{"ids": [prompt ids], "max_new_tokens": n}. For each it decodes greedily with EaModel.eagenerate on the
package's static tree (eagle.model.choices.mc_sim_7b_63: 25 nodes, depth 5, the tree of the EAGLE-1 paper) and
writes <path>.result.json ({"steps": [[root, accepted drafts...] per step], "new_tokens", "seconds"}), printing
that path (stdout). eagenerate stops after the step whose new tokens exceed its max_new_tokens, or at EOS; it
is called with max_new_tokens = n - 1, so it stops as the harness's own loop does (once n tokens are out).

eagle-llm 1.2.1 holds two copies of the code: eagle.model (batch size 1, used here: EaModel, cnets.Model) and
eagle.modelbsne1 (batched). Both draft on a static tree (tree_choices; the draft layer's own copy, set by
cnets.Model.init_tree, is the same mc_sim_7b_63); EAGLE-2's dynamic tree is not in this release.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

import eagle.model.cnets as cnets
import eagle.model.ea_model as ea
import eagle.model.modeling_llama_kv as kv
from eagle.model.choices import mc_sim_7b_63

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import Recorder, serve as serve_requests  # noqa: E402
from tf4_model import rewrite_model  # noqa: E402


def say(msg):
    print(msg, file=sys.stderr, flush=True)


# -- fix 1: the rotary base, in the base model and in the draft layer ----------------------------------------
def fix_rope(model, theta: float):
    for layer in model.base_model.model.layers:
        attn = layer.self_attn
        attn.rotary_emb = kv.LlamaRotaryEmbedding(attn.head_dim, max_position_embeddings=attn.max_position_embeddings,
                                                  base=theta)
    for layer in model.ea_layer.layers:
        attn = layer.self_attn
        attn.rotary_emb = cnets.LlamaRotaryEmbedding(attn.head_dim, max_position_embeddings=attn.max_position_embeddings,
                                                     base=theta)
    say(f"fix 1: rotary base {theta:g} (config.rope_theta) in the vendored Llama (modeling_llama_kv, "
        f"{len(model.base_model.model.layers)} layers) and in the draft layer (cnets), which both hard-code 10000")


@torch.inference_mode()
def check_base(model, reference, ids: list[int]) -> float:
    """Max |logit difference| of the official base Llama against transformers 4.36's own LlamaForCausalLM."""
    x = torch.tensor([ids])
    want = reference(x).logits[0]
    got = model.base_model.lm_head(model.base_model.model(input_ids=x)[0])[0]
    return float((want - got).abs().max())


@torch.inference_mode()
def check_draft_layer(model, cfg_dir: Path, ids: list[int]) -> float:
    """Max |difference| of the official draft module (cnets.Model: fc, then its layer 0 without input norm) against
    fc followed by transformers 4.36's own LlamaDecoderLayer (which reads rope_theta) with the same weights, on the
    pairs (base feature f_t, token x_{t+1}) of `ids`."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    cfg = LlamaConfig.from_pretrained(str(cfg_dir))
    ref = LlamaDecoderLayer(cfg, layer_idx=0).eval()
    ref.input_layernorm = torch.nn.Identity()
    ref.load_state_dict(model.ea_layer.layers[0].state_dict(), strict=False)
    x = torch.tensor([ids])
    feats = model.base_model.model(input_ids=x)[0][:, :-1]                        # [1, T-1, h]
    got = model.ea_layer(feats, input_ids=x[:, 1:])                                # [1, T-1, h]
    ea = model.ea_layer
    inp = ea.fc(torch.cat((ea.embed_tokens(x[:, 1:]).to(feats.dtype), feats), dim=-1))
    n = inp.shape[1]
    mask = torch.full((n, n), torch.finfo(inp.dtype).min).triu(1)[None, None]
    want = ref(inp, attention_mask=mask, position_ids=torch.arange(n)[None])[0]
    return float((want - got).abs().max())


def load(model_dir: Path, eagle_dir: Path, work: Path, ids: list[int], dtype):
    """EaModel on the rewritten base folder, the rotary fix applied and checked before and after."""
    from transformers import LlamaForCausalLM
    base_dir = rewrite_model(model_dir, work / "model-tf436", say)
    theta = float(json.loads((base_dir / "config.json").read_text())["rope_theta"])
    model = ea.EaModel.from_pretrained(base_model_path=str(base_dir), ea_model_path=str(eagle_dir),
                                       torch_dtype=dtype).eval()
    reference = LlamaForCausalLM.from_pretrained(str(base_dir), torch_dtype=dtype).eval()
    before = (check_base(model, reference, ids), check_draft_layer(model, base_dir, ids))
    say(f"before fix 1: official base logits differ from transformers 4.36's LlamaForCausalLM by {before[0]:.3g}; "
        f"the official draft layer's output from transformers 4.36's LlamaDecoderLayer by {before[1]:.3g}")
    fix_rope(model, theta)
    model.to(dtype)
    after = (check_base(model, reference, ids), check_draft_layer(model, base_dir, ids))
    say(f"after fix 1: base logits differ by {after[0]:.3g}; the draft layer's output by {after[1]:.3g}")
    del reference
    return model, {"base_before": before[0], "draft_before": before[1], "base_after": after[0],
                   "draft_after": after[1], "rope_theta": theta}


def serve(model, rec):
    def decode(req):
        model.eagenerate(torch.tensor([req["ids"]]), temperature=0.0, max_new_tokens=int(req["max_new_tokens"]) - 1,
                         tree_choices=mc_sim_7b_63)
    serve_requests(rec, decode)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--eagle", required=True, type=Path)
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--check-ids", default="", help="comma-separated ids for the checks")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers
    say(f"official side: eagle-llm 1.2.1 (eagle.model.EaModel), transformers {transformers.__version__}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}")
    ids = [int(t) for t in args.check_ids.split(",") if t] or list(range(1, 40))
    model, checks = load(args.model, args.eagle, args.work, ids, getattr(torch, args.dtype))
    if model.ea_layer.tree != mc_sim_7b_63:
        raise RuntimeError("the draft layer's tree (cnets.Model.init_tree) is not eagenerate's mc_sim_7b_63")
    say(f"official tree: eagle.model.choices.mc_sim_7b_63, {len(mc_sim_7b_63)} nodes, depth "
        f"{max(map(len, mc_sim_7b_63))}, top-{cnets.top_k} per drafted node")
    rec = Recorder(ea.update_inference_inputs)
    ea.update_inference_inputs = rec
    print(json.dumps({"ready": True, "tree": mc_sim_7b_63, "checks": checks}), flush=True)
    serve(model, rec)


if __name__ == "__main__":
    main()
