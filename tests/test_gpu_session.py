"""pytest tests/test_gpu_session.py: the one prepared GPU call (pipelines/bench/gpu_session.sh) dry-run on the CPU.

Every test it names is collected (a renamed file or test would otherwise be found on the device, its time spent),
every bench setting it passes is one the bench reads and checks, and it refuses to start without the commit it
must name in its file or without the wheels the device lacks.
"""
import os
import subprocess
import sys
from pathlib import Path

from pipelines.common import REPO_ROOT

SCRIPT = REPO_ROOT / "pipelines" / "bench" / "gpu_session.sh"


def session(tmp_path: Path, **env) -> subprocess.CompletedProcess:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"      # python3: this environment's
    base = {k: v for k, v in os.environ.items() if k not in ("SOURCE_COMMIT", "DRY_RUN")}
    return subprocess.run(["bash", str(SCRIPT)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**base, "PATH": path, "OUT": str(tmp_path), **env})


def test_the_dry_run_collects_every_named_test_and_checks_every_bench_setting(tmp_path):
    proc = session(tmp_path, DRY_RUN="1", SOURCE_COMMIT="0" * 40)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    collected = [line for line in proc.stdout.splitlines() if "::" in line]
    for name in ("test_graphed_growth", "test_static_taps", "test_fused", "test_static_step", "test_graphed_draft",
                 "test_cuda"):
        assert any(f"tests/{name}.py::" in line for line in collected), name
    assert "bench_gpu dry run:" in proc.stdout and '"shapes": ["vicuna_7b"]' in proc.stdout
    assert '"settings": ["host_settings", "static_step", "static_drafts"]' in proc.stdout


def test_it_refuses_to_start_without_the_commit_it_must_name(tmp_path):
    proc = session(tmp_path, DRY_RUN="1")
    assert proc.returncode != 0 and "set SOURCE_COMMIT to the commit this tree is" in proc.stderr


def test_a_bench_setting_it_does_not_read_fails_the_dry_run(tmp_path):
    text = SCRIPT.read_text().replace("+bench_gpu.repeats=5", "+bench_gpu.repeat=5")
    broken = tmp_path / "gpu_session.sh"
    broken.write_text(text)
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    proc = subprocess.run(["bash", str(broken)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PATH": path, "OUT": str(tmp_path), "DRY_RUN": "1", "SOURCE_COMMIT": "x"})
    assert proc.returncode != 0 and "bench_gpu.repeat is not a setting" in proc.stdout + proc.stderr
