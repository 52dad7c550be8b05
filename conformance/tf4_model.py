"""The project's model folder (written by transformers 5) rewritten for an older transformers 4.x, as the
official decoders' environments need it (conformance/official_medusa.py, official_eagle.py).
Runs in those environments only.

    dst = rewrite_model(src, dst, say, fix)    # weights linked; config.json, tokenizer files rewritten; `say` prints
                                               # each change, labelled `fix` (the runner's numbering)

- config.json: `rope_parameters` -> `rope_theta`, `dtype` -> `torch_dtype` (4.x reads those keys);
- tokenizer.json: merges as "a b" strings (tokenizers before 0.20 does not read [a, b] pairs);
- tokenizer_config.json: tokenizer_class GPT2TokenizerFast (5.x writes a class 4.x does not have).
"""
import json
from pathlib import Path


def rewrite_model(src: Path, dst: Path, say=print, fix: str = "fix 2") -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors" or f.name in ("generation_config.json",):
            target = dst / f.name
            if not target.exists():
                target.symlink_to(f.resolve())
    cfg = json.loads((src / "config.json").read_text())
    rope = (cfg.pop("rope_parameters", None) or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    cfg["rope_theta"] = float(rope)
    cfg["torch_dtype"] = cfg.pop("dtype", cfg.get("torch_dtype", "float32"))
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    say(f"{fix}: config.json for transformers 4.x: rope_parameters -> rope_theta={cfg['rope_theta']}, "
        f"dtype -> torch_dtype={cfg['torch_dtype']}")
    tok = json.loads((src / "tokenizer.json").read_text())
    merges = tok["model"].get("merges", [])
    if merges and isinstance(merges[0], list):
        tok["model"]["merges"] = [" ".join(m) for m in merges]
        say(f"{fix}: tokenizer.json: {len(merges)} merges as 'a b' strings (old tokenizers read no pairs)")
    (dst / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    tcfg = json.loads((src / "tokenizer_config.json").read_text())
    if tcfg.get("tokenizer_class") != "GPT2TokenizerFast":
        say(f"{fix}: tokenizer_config.json: tokenizer_class {tcfg.get('tokenizer_class')} -> GPT2TokenizerFast")
        tcfg["tokenizer_class"] = "GPT2TokenizerFast"
    for key in ("backend", "is_local"):
        tcfg.pop(key, None)
    (dst / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))
    return dst
