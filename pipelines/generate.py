"""python -m pipelines.generate heads=medusa1 tree=sparse64 prompt="Why is the sky blue?"
python -m pipelines.generate heads=hydra prompts='["Why is the sky blue?", "Name three rivers."]'
python -m pipelines.generate heads=eagle prompts_file=questions.txt     (one prompt a line, or a JSON list)

prompt=: one answer, streamed to the terminal. prompts= or prompts_file=: the answers decoded as one batch
(models/engine/batch.py: one verify forward a step for all of them, each with its own drafter), printed in order
when all are done, with the batch's tokens/s. Tokens that came from accepted drafts are shown in green
(in [brackets] when stdout is not a terminal); the end prints the mean accepted length and
tokens/s. Options (conf/config.yaml, "pipelines.generate" block):
  heads=none                     the autoregressive baseline
  tree=cut                       the calibrated 16-node tree cut per step by cost (as in evaluate)
  tree=optimal_pld|cut_pld       the heads' tree with prompt lookup's chain merged in
  heads_dir=FOLDER               heads from FOLDER instead of results/heads/<heads.name>
  random_heads=true              freshly initialised heads of the configured family (for trying it out)
  max_new_tokens=N temperature=T top_p=P top_k=K acceptance=greedy|typical|sampling
  output=FILE.json               also write the result (tokens, text, per-step stats; a list for a batch) as JSON
  threads=N                      torch CPU threads
"""
from __future__ import annotations

from pipelines import omp  # noqa: F401,I001  (first: OpenMP's wait policy is read when torch loads)
import functools
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from models.engine.batch import generate_batch
from models.engine.decoding import SamplingConfig, generate
from models.engine.fast_inference import prepare_heads_for_decoding
from models.engine.path_choice import prepare_for_decoding
from models.engine.drafting import make_drafter
from models.methods import load_for_decoding
from pipelines.methods import heads_spec, random_heads, resolve_tree
from pipelines.common import load_model, log, mlflow_run, stage, write_json
from pipelines.host import apply_host, static_step

GREEN, RESET = "\033[32m", "\033[0m"


def load_draft_heads(cfg: DictConfig, model):
    """(model, heads or None): trained heads from their folder, or fresh ones with random_heads=true."""
    if cfg.heads.family == "none":
        return model, None
    if cfg.random_heads:
        return model, random_heads(cfg, model, cfg.heads)
    folder = Path(cfg.heads_dir or Path(cfg.paths.results) / "heads" / cfg.heads.name)
    if not folder.is_dir():
        raise FileNotFoundError(f"no trained heads in {folder}: train them with `python -m pipelines.train "
                                f"heads={cfg.heads.name}`, point heads_dir=... at a heads folder, or try the "
                                "decoder with random_heads=true")
    model, heads, _ = load_for_decoding(folder, model)
    return model, heads


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    messages = [{"role": "user", "content": prompt}]
    if not tokenizer.chat_template:
        return tokenizer(prompt)["input_ids"]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


class Streamer:
    """on_tokens callback: prints the new text, marking the pieces that came from accepted drafts."""

    def __init__(self, tokenizer, stream=None):
        stream = stream if stream is not None else sys.stdout     # looked up now: a default bound at import goes stale
        self.tok, self.stream, self.tty = tokenizer, stream, stream.isatty()
        self.tokens: list[int] = []
        self.printed = ""

    def __call__(self, tokens: list[int], from_draft: list[bool]) -> None:
        for token, drafted in zip(tokens, from_draft):
            self.tokens.append(token)
            text = self.tok.decode(self.tokens, skip_special_tokens=True)
            if text.endswith("\ufffd"):                    # an incomplete multi-byte character: wait for more
                continue
            piece, self.printed = text[len(self.printed):], text
            if drafted and piece:
                piece = f"{GREEN}{piece}{RESET}" if self.tty else f"[{piece}]"
            self.stream.write(piece)
        self.stream.flush()

    def finish(self) -> None:
        """Print what an unfinished multi-byte character held back."""
        text = self.tok.decode(self.tokens, skip_special_tokens=True)
        self.stream.write(text[len(self.printed):] + "\n")
        self.stream.flush()


def check_settings(cfg: DictConfig) -> None:
    """Refuse values that would make an empty or meaningless answer, naming the value and what is accepted."""
    n = cfg.max_new_tokens
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"max_new_tokens={n!r}: the number of new tokens must be a whole number >= 1")
    if float(cfg.temperature) < 0:
        raise ValueError(f"temperature={cfg.temperature!r}: use 0 (greedy) or a positive temperature")
    if not 0 < float(cfg.top_p) <= 1:
        raise ValueError(f"top_p={cfg.top_p!r}: use a value in (0, 1] (1 keeps every token)")
    if isinstance(cfg.top_k, bool) or not isinstance(cfg.top_k, int) or cfg.top_k < 0:
        raise ValueError(f"top_k={cfg.top_k!r}: use a whole number >= 0 (0 keeps every token)")
    if cfg.threads is not None and (not isinstance(cfg.threads, int) or cfg.threads < 1):
        raise ValueError(f"threads={cfg.threads!r}: use a whole number >= 1, or leave it unset (all cores)")


def batch_prompts(cfg: DictConfig) -> list[str] | None:
    """prompts= (a list) or prompts_file= (one prompt a line, or a JSON list of strings), or None for prompt=."""
    given = [k for k in ("prompt", "prompts", "prompts_file") if cfg.get(k)]
    if len(given) != 1:
        raise ValueError(f"give one of prompt=..., prompts=[...] or prompts_file=FILE (got {given or 'none'})")
    if given[0] == "prompt":
        return None
    if given[0] == "prompts":
        prompts = list(cfg.prompts) if not isinstance(cfg.prompts, str) else [cfg.prompts]
    else:
        path = Path(str(cfg.prompts_file))
        if not path.is_file():
            raise FileNotFoundError(f"prompts_file={path}: no such file (one prompt a line, or a JSON list)")
        text = path.read_text()
        try:
            prompts = json.loads(text) if text.lstrip().startswith("[") else [ln for ln in text.splitlines() if ln.strip()]
        except json.JSONDecodeError as e:
            raise ValueError(f"prompts_file={path} starts like a JSON list but is not one (cut off?): {e}") from None
    if not prompts or not all(isinstance(p, str) and p.strip() for p in prompts):
        raise ValueError(f"{given[0]}: every prompt must be a non-empty string; got {prompts!r:.200}")
    return prompts


def run_batch(cfg, model, tok, new_drafter, sampling, method: str, prompts: list[str], host: dict) -> None:
    """The prompts as one batch; each answer printed in order, then the batch's figures."""
    import mlflow

    drafters = [new_drafter() for _ in prompts] if new_drafter else None
    results = generate_batch(model, tok, [prompt_ids(tok, p) for p in prompts], drafters, sampling=sampling,
                             max_new_tokens=int(cfg.max_new_tokens))
    for i, (p, r) in enumerate(zip(prompts, results)):
        print(f"-- [{i}] {p}\n{r.text}\n   ({len(r.new_tokens)} tokens, mean accepted length "
              f"{r.mean_accepted_length:.2f}, stop: {r.stop_reason})")
    wall = max(r.wall_time for r in results)
    tokens = sum(len(r.new_tokens) for r in results)
    print(f"-- {method}, batch of {len(prompts)}: {tokens} tokens in {wall:.2f} s = {tokens / wall:.1f} tokens/s")
    mlflow.log_metrics({"tokens_per_second": tokens / wall, "new_tokens": tokens, "wall_time": wall,
                        "batch_size": len(prompts)})
    if cfg.output:
        write_json(cfg.output, {"prompts": prompts, "method": method, "model": cfg.model.name,
                                "sampling": asdict(sampling), "host": host,
                                "answers": [r.to_dict() for r in results]})
        mlflow.log_artifact(str(cfg.output))


@stage
def main(cfg: DictConfig) -> None:
    batch = batch_prompts(cfg)
    check_settings(cfg)
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    model, tok = load_model(cfg)
    host = apply_host(cfg, str(next(model.parameters()).device))   # on a CPU: nothing changes, recorded as such
    model, heads = load_draft_heads(cfg, model)     # trained: LoRA merged and packed (load_for_decoding)
    prepare_for_decoding(model)
    if heads is not None and cfg.random_heads:
        prepare_heads_for_decoding(heads)
    tree, new_drafter = None, None
    if heads is not None:     # as evaluate runs it: tree=cut per step by cost, tree=optimal_pld with prompt lookup
        option = resolve_tree(cfg, OmegaConf.to_container(cfg.tree, resolve=True), cfg.tree.name)
        tree = option.tree
        new_drafter = functools.partial(make_drafter, heads_spec(cfg, option), heads=heads)
    sampling = SamplingConfig(temperature=float(cfg.temperature), top_p=float(cfg.top_p), top_k=int(cfg.top_k),
                              acceptance=str(cfg.acceptance), seed=int(cfg.seed),
                              epsilon=float(OmegaConf.select(cfg, "eval.typical.epsilon", default=0.09)),
                              delta=float(OmegaConf.select(cfg, "eval.typical.delta", default=0.3)))
    method = "baseline" if heads is None else f"{cfg.heads.name} / {tree.name}" + (" (random heads)" if cfg.random_heads else "")
    if batch is not None:
        log.info("%s: a batch of %d prompts, up to %d new tokens each", method, len(batch), cfg.max_new_tokens)
        with mlflow_run(cfg, "generate"):
            run_batch(cfg, model, tok, new_drafter, sampling, method, batch, host)
        return
    ids = prompt_ids(tok, str(cfg.prompt))
    log.info("%s: %d prompt tokens, up to %d new", method, len(ids), cfg.max_new_tokens)
    with mlflow_run(cfg, "generate"):
        import mlflow

        streamer = Streamer(tok)
        res = generate(model, tok, ids, new_drafter() if new_drafter else None, sampling=sampling,
                       max_new_tokens=int(cfg.max_new_tokens), on_tokens=streamer,
                       static=static_step(cfg, next(model.parameters()).device))
        streamer.finish()
        print(f"-- {method}: {len(res.new_tokens)} tokens in {res.wall_time:.2f} s = {res.tokens_per_second:.1f} "
              f"tokens/s; mean accepted length {res.mean_accepted_length:.2f} over {res.steps} steps "
              f"(stop: {res.stop_reason})")
        mlflow.log_metrics({"tokens_per_second": res.tokens_per_second, "mean_accepted_length": res.mean_accepted_length,
                            "new_tokens": len(res.new_tokens), "steps": res.steps, "wall_time": res.wall_time})
        if cfg.output:
            record = {"prompt": str(cfg.prompt), "method": method, "model": cfg.model.name,
                      "heads": None if heads is None else cfg.heads.name, "tree": None if tree is None else tree.name,
                      "sampling": asdict(sampling), "host": host, **res.to_dict()}
            write_json(cfg.output, record)
            mlflow.log_artifact(str(cfg.output))
            log.info("wrote %s", cfg.output)


if __name__ == "__main__":
    main()
