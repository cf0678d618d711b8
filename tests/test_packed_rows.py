"""oneDNN's packed matmuls run at a bounded set of row counts (models/packed_rows.py): the numbers are the plain
matmul's, and a generative model under the soak's load pattern builds a bounded set of oneDNN kernels instead of
one per new row count (issue 18: the chat worker's RSS grew ~0.1 MB per Generate call)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from models.llama import Linear
from models.packed_rows import EXACT_ROWS, MAX_ROWS, ROW_COUNTS, padded_rows

ROOT = Path(__file__).resolve().parents[1]
needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def test_row_counts_are_few_and_pad_by_a_quarter_at_most():
    assert len(ROW_COUNTS) == 32 and ROW_COUNTS[-1] == MAX_ROWS
    previous = 0
    for rows in range(1, MAX_ROWS + 1):
        padded = padded_rows(rows)
        assert padded in ROW_COUNTS and rows <= padded <= 1.25 * rows, rows
        assert padded >= previous  # monotone: more rows never run at fewer
        previous = padded
    assert all(padded_rows(rows) == rows for rows in range(1, EXACT_ROWS + 1))


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_linear_gives_the_plain_matmuls_numbers_at_any_row_count(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g).to(dtype)
    bias = torch.randn(48, generator=g).to(dtype)
    linear = Linear.build(w, pack=True)
    if linear.packed is None:
        pytest.skip(f"oneDNN cannot pack {dtype} here")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for rows in [*range(1, 41), 63, 65, 100, 257, MAX_ROWS - 1, MAX_ROWS, MAX_ROWS + 1, 2 * MAX_ROWS + 37]:
        x = torch.randn(rows, 64, generator=g).to(dtype)
        y = linear(x, bias)
        assert y.shape == (rows, 48) and y.dtype == dtype
        torch.testing.assert_close(y.float(), F.linear(x.float(), w.float(), bias.float()), rtol=tol, atol=tol)
    x = torch.randn(3, 7, 64, generator=g).to(dtype)  # leading dimensions are rows too
    torch.testing.assert_close(linear(x).float(), F.linear(x.float(), w.float()), rtol=tol, atol=tol)


SOAK_PATTERN = """
import asyncio, sys, time
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
from pathlib import Path
from appliance.engine.llm.service import GenerativeModelService
from appliance.engine.llm.settings import GenerativeSettings

async def main(model_dir, turns_each):
    # the soak's generative model and load (tests/test_workers_load.py): 40 slots x 512 positions, 16 sessions,
    # 6 tokens per Generate, each session starting over (ResetContext) after 7 turns
    svc = GenerativeModelService("chat", Path(model_dir), GenerativeSettings(
        kv_slots=40, max_seq_len=512, max_new_tokens=32, dtype="float32", device="cpu", max_text_chars=200,
        compile="off"))
    await svc.start()
    assert svc.state == "Ready", svc.failure_reason

    async def client(n):
        for turn in range(turns_each):
            r = await svc.generate(f"s{n}", f"Valve {n} turn {turn % 7}", 6, 0.0, time.monotonic() + 60)
            assert r.finish_reason in ("stop", "length"), r
            if turn % 7 == 6:
                await svc.reset(f"s{n}")
    await asyncio.gather(*[client(n) for n in range(16)])
    await svc.stop()
    print("turns done", 16 * turns_each, flush=True)

asyncio.run(main(sys.argv[2], int(sys.argv[3])))
"""

KERNEL = re.compile(r"create:cache_miss,cpu,inner_product,.*,mb(\d+)ic(\d+)oc(\d+),")


@needs_onednn
def test_the_soak_pattern_builds_a_bounded_set_of_onednn_kernels(tmp_path):
    """Before: every new row count of a step's matmuls built (and kept) a ~0.6 MB kernel, hundreds of them in a
    few hundred turns. Counted from oneDNN's own log of the kernels it creates (ONEDNN_VERBOSE=profile_create)."""
    pytest.importorskip("transformers")
    from tiny_llm import make_model_dir
    make_model_dir(tmp_path / "chat")
    turns_each = 28
    out = subprocess.run([sys.executable, "-c", SOAK_PATTERN, str(ROOT), str(tmp_path / "chat"), str(turns_each)],
                         capture_output=True, text=True, timeout=600, env=_env(ONEDNN_VERBOSE="profile_create"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"turns done {16 * turns_each}" in out.stdout
    built = Counter(tuple(int(v) for v in m.groups()) for m in KERNEL.finditer(out.stdout))
    rows = sorted({mb for mb, _ic, _oc in built})
    shapes = {(ic, oc) for _mb, ic, oc in built}
    print(f"{sum(built.values())} oneDNN kernels built for {len(shapes)} matrix shapes at row counts {rows}")
    assert built, "no packed matmul ran (oneDNN's log format changed?)"
    assert set(rows) <= set(ROW_COUNTS), rows
    assert max(built.values()) == 1  # none built twice: nothing was evicted and rebuilt
    assert len(built) <= len(ROW_COUNTS) * len(shapes)


def _env(**extra: str) -> dict[str, str]:
    """This environment without oneDNN settings of its own (cache capacities would change what is counted)."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("ONEDNN_", "DNNL_"))}, **extra}
