"""Run in the authors' environment (.venv-dflash: torch 2.13.0, transformers 5.15.0, dflash 0.1.0 without its
dependencies; pipelines/dflash_check.py builds it) and print one JSON line.

    python conformance/official_dflash.py --draft FOLDER --inputs inputs.pt
        our export loaded by DFlashDraftModel.from_pretrained, their forward on the inputs our module was run on
        (target_hidden [1, C, w], noise_embedding [1, Q, h], position_ids [1, C + Q], ours [1, Q, h]): how far
        their block outputs are from ours
    python conformance/official_dflash.py --draft FOLDER --target FOLDER --prompts prompts.json --new-tokens N
        dflash_generate, greedy, on each prompt: every step's drafted block (the argmax of each position, recorded
        from compute_logits) and how many tokens it produced, and the output tokens
"""
import argparse
import json
import time

import torch
from dflash.model import DFlashDraftModel, dflash_generate
from transformers import AutoModelForCausalLM

REPEATS = 5                     # timed decodes of each prompt (pipelines/dflash_check.py times ours alike)


def forward_check(model, inputs: str) -> dict:
    x = torch.load(inputs, weights_only=True)
    with torch.inference_mode():
        theirs = model(target_hidden=x["target_hidden"], noise_embedding=x["noise_embedding"],
                       position_ids=x["position_ids"])
    diff = (theirs - x["ours"]).abs()
    return {"max_abs_diff": float(diff.max()), "max_abs": float(x["ours"].abs().max()),
            "target_layer_ids": list(model.target_layer_ids), "block_size": model.block_size,
            "mask_token_id": model.mask_token_id}


def steps_of(prompt: list[int], output: list[int], drafts: list[list[int]]) -> list[dict]:
    """Each step's drafts and the tokens it produced (the accepted drafts and the bonus), read off the output."""
    steps, start = [], len(prompt)             # output[start] is the step's root: the first, the prefill's token
    for d in drafts:
        accepted = 0
        while accepted < len(d) and start + 1 + accepted < len(output) and output[start + 1 + accepted] == d[accepted]:
            accepted += 1
        produced = min(accepted + 1, len(output) - 1 - start)
        steps.append({"drafts": d, "produced": produced})
        start += produced
    return steps


def generate_steps(model, target: str, prompts: str, new_tokens: int) -> dict:
    base = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    drafts, record = [], model.compute_logits

    def compute_logits(hidden, head):                         # the block's drafts, as dflash_generate takes them
        logits = record(hidden, head)
        drafts.append(logits.argmax(-1)[0].tolist())
        return logits
    model.compute_logits = compute_logits
    out = []
    prompts = json.loads(open(prompts).read())
    dflash_generate(model, base, torch.tensor([prompts[0]]), 4, stop_token_ids=None)          # warm-up
    for ids in prompts:
        drafts.clear()
        output = dflash_generate(model, base, torch.tensor([ids]), new_tokens, stop_token_ids=None)[0].tolist()
        steps = steps_of(ids, output, list(drafts))
        times = []
        for _ in range(REPEATS):                                  # the median of REPEATS timed decodes
            t0 = time.perf_counter()
            dflash_generate(model, base, torch.tensor([ids]), new_tokens, stop_token_ids=None)
            times.append(time.perf_counter() - t0)
        out.append({"output_tokens": output[len(ids):], "steps": steps, "seconds": sorted(times)[REPEATS // 2]})
    return {"prompts": out}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", required=True)
    ap.add_argument("--inputs")
    ap.add_argument("--target")
    ap.add_argument("--prompts")
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    model = DFlashDraftModel.from_pretrained(args.draft, dtype=torch.float32).eval()
    torch.set_num_threads(1)
    result = forward_check(model, args.inputs) if args.inputs else generate_steps(model, args.target, args.prompts,
                                                                                    args.new_tokens)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
