"""The GPU check script on a machine without a GPU: valid bash, every Python part compiles and skips cleanly, and the
whole script (install skipped) finishes with its summary line in the results file."""
import os
import py_compile
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "bench").glob("gpu_*.py"))


def cpu_env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(extra)
    return env


def test_bash_syntax():
    subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu_check.sh")], check=True)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_python_parts_compile(script):
    py_compile.compile(str(script), doraise=True)


def test_the_whole_script_without_install_writes_its_summary(tmp_path):
    """Each Python part run by the script (every gpu_*.py but gpu_common.py) prints its SKIP line naming the missing
    CUDA device first and exits 0 (each run once, here, rather than again on its own)."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the full check takes minutes")
    out = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], capture_output=True, text=True, cwd=ROOT,
                         env=cpu_env(SKIP_INSTALL="1", PYTHON=sys.executable, OUT=str(tmp_path)), timeout=300)
    text = (tmp_path / "gpu_check.txt").read_text()
    assert out.returncode == 0, text
    assert text.count("SKIP ") == 4 and "summary: 0 PASS, 0 FAIL" in text
    # the script's log: "$ PYTHON bench/gpu_x.py ... (limit ...)", the script's output, "exit RC at N s"
    steps = re.findall(r"^\$ [^\n]*?bench/(gpu_\w+\.py)[^\n]*\n(.*?)^exit (\d+) at", text, re.S | re.M)
    parts = sorted(s.name for s in SCRIPTS if s.name != "gpu_common.py")
    assert sorted(name for name, _, _ in steps) == parts, text
    for name, output, rc in steps:
        assert rc == "0" and output.startswith("SKIP ") and "no CUDA device" in output, (name, output, rc)


@pytest.mark.parametrize("script,passes", [("gpu_kernels.py", 42), ("gpu_decode.py", 5)])
def test_cpu_dry_run_of_the_gpu_scripts(script, passes):
    """The scripts' own logic (shapes, comparisons, greedy loops, graph runner, HF calls) on tiny shapes through
    the interpreter, so a bug in them does not cost GPU minutes."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--cpu-dry-run"], capture_output=True,
                         text=True, cwd=ROOT, env=cpu_env(), timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "FAIL" not in out.stdout and out.stdout.count("\nPASS ") == passes, out.stdout[-3000:]
    assert "FIGURE" in out.stdout
