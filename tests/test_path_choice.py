"""engine.weights: auto chooses by measuring on the CPU it runs on (loader/path_choice.py, loader/path_build.py,
appliance/engine/llm/weight_plan.py): the choice follows the timings (forced through the `measure` seam, never by
sleeping), approximate paths must meet the accuracy bar, the choice and its figures are recorded beside the weight
cache and read back at the next start, and Backend, appliance_model_info and the status page show it, with the
reason wherever our kernels cannot be had."""
from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import pytest
import torch

import test_gguf
from appliance.engine.llm.loading import load_engine
from appliance.engine.llm.settings import GenerativeSettings
from appliance.metrics import weight_format_of
from kernels import cpu_build, cpu_isa, cpu_quant
from kernels_here import cpu_here, runnable_isas
from loader import path_choice
from models import quant
from loader.path_choice import PathName
from test_quantized import write_kquant_gguf


# ---- ranking -------------------------------------------------------------------------------------------------------

def test_the_fastest_path_that_meets_the_bar_is_chosen():
    timings = {"a": (1.0, 10.0), "b": (2.0, 4.0), "c": (1.5, 5.0), "d": (9.0, 9.0)}
    # slowdowns summed at 1 and at `slots` rows: a 1 + 2.5, b 2 + 1, c 1.5 + 1.25, d 9 + 2.25
    assert path_choice.rank(timings) == ["c", "b", "a", "d"]
    asked = []
    assert path_choice.choose(timings, lambda p: asked.append(p) or p != "c") == "b" and asked == ["c", "b"]
    assert path_choice.choose(timings, lambda p: False) is None


def test_candidates_follow_the_settings_and_the_file():
    isas = ["avx512vnni", "avx2"]
    auto = [str(p) for p in path_choice.candidates("auto", "auto", "auto", isas, {"Q4_1"}, quant.FOUR_BIT)]
    assert auto == ["blocks/int8/avx512vnni", "blocks/float32/avx512vnni", "blocks/int8/avx2", "blocks/float32/avx2",
                    "blocks/float32/torch", "float32", "bfloat16"]
    kq = [str(p) for p in path_choice.candidates("auto", "auto", "auto", isas, {"Q4_K", "Q6_K"}, quant.FOUR_BIT)]
    assert "blocks/float32/torch" not in kq  # torch's int4 op cannot hold Q6_K
    assert [str(p) for p in path_choice.candidates("blocks", "int8", "avx2", isas, {"Q4_1"}, quant.FOUR_BIT)] == \
        ["blocks/int8/avx2"]
    assert [str(p) for p in path_choice.candidates("auto", "auto", "auto", [], {"Q4_1"}, quant.FOUR_BIT)] == \
        ["blocks/float32/torch", "float32", "bfloat16"]


# ---- forced through the engine -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def q4_file(tmp_path_factory):
    """A tiny Llama GGUF whose layer matrices are all Q4_0 / Q4_1 (so torch's int4 op is a candidate too)."""
    path = tmp_path_factory.mktemp("q4") / "q4.gguf"
    saved = dict(test_gguf.TYPES)
    test_gguf.TYPES.update({"v_proj": test_gguf.QT.Q4_1, "o_proj": test_gguf.QT.Q4_0,
                            "down_proj": test_gguf.QT.Q4_1})
    try:
        test_gguf.write_tiny_gguf(path, tied=True)
    finally:
        test_gguf.TYPES.clear()
        test_gguf.TYPES.update(saved)
    return path


def settings(tmp: Path, **kw) -> GenerativeSettings:
    return GenerativeSettings(kv_slots=4, max_seq_len=128, weight_cache_dir=str(tmp / "weights"),
                              cpu_kernel_dir=str(tmp / "kernels"), compile="off", **kw)


def forced(fastest: str, seen: list | None = None):
    """A measure seam: `fastest` takes 1 ms at one row and 2 at four, every other path 5 and 10."""
    def measure(parts: dict, slots: int) -> dict:
        assert slots == 4
        if seen is not None:
            seen.append(sorted(parts))
        return {p: (1.0, 2.0) if p == fastest else (5.0, 10.0) for p in parts}
    return measure


def candidates_here(path: Path, tmp: Path) -> list[str]:
    from loader.weight_cache import gguf_tensor_types
    types = gguf_tensor_types(path, tmp / "weights")
    try:
        isas = cpu_isa.cpu_info(tmp / "kernels").isas
    except cpu_build.KernelsUnavailable as exc:
        if "x86-64" not in str(exc):
            raise  # a cpuid probe that does not build is a broken build, not a CPU without our kernels
        isas = []
    layers = {t for n, t in types.items() if n not in ("token_embd.weight", "output.weight")}
    return [str(p) for p in path_choice.candidates("auto", "auto", "auto", isas, layers, quant.FOUR_BIT)]


def used_path(engine) -> str:
    """What the loaded model actually multiplies with."""
    lin = engine.model.layers[0].gate_up
    lin = getattr(lin, "parts", [lin])[0]  # gate and up of different types multiply apart (RowStack)
    if isinstance(lin, quant.BlockLinear):
        k = lin.kernels
        return f"blocks/{k.activations}/{k.isa}" if k else "blocks/float32/torch"
    return str(engine.model.dtype).removeprefix("torch.")


def test_every_path_is_chosen_when_its_timings_are_fastest_and_then_served(q4_file, tmp_path):
    """Each candidate path on this CPU, made fastest by the timings: chosen, recorded, named in Backend and the
    weight format, and the model really multiplies along it. Approximate paths pass the accuracy check here (the
    kl seam says 0)."""
    paths = candidates_here(q4_file, tmp_path)
    assert {"blocks/float32/torch", "float32", "bfloat16"} <= set(paths)
    for i, path in enumerate(paths):
        seen: list = []
        engine = load_engine("m", q4_file, settings(tmp_path / str(i)), None, None, measure=forced(path, seen),
                             kl=lambda p, inputs, exact: 0.0)
        assert seen == [sorted(paths)], path  # every candidate was timed, once
        assert engine.path_record.chosen == path and used_path(engine) == path
        assert f": {path}" in engine.backend
        assert "auto, measured 1.0 / 2.0 ms per step's matmuls at 1 / 4 rows" in engine.backend
        p = PathName.parse(path)
        expected = p.weights if not p.quantized else \
            f"Q4_1+Q4_0+Q8_0/{'torch-int4' if p.kernels == 'torch' else p.activations}"
        assert engine.weight_format == expected == weight_format_of(engine.backend), (path, engine.backend)
        records = list((tmp_path / str(i) / "weights").glob("choice-*.json"))
        assert len(records) == 1 and json.loads(records[0].read_text())["chosen"] == path


def test_an_approximate_path_over_the_bar_is_passed_over(q4_file, tmp_path):
    isa = (candidates_here(q4_file, tmp_path)[0].split("/") + ["", ""])[2]
    if not isa or isa == "torch":
        runnable_isas(tmp_path / "kernels")  # a skip naming what the CPU lacks
        pytest.fail(f"this CPU runs our kernels, yet the first candidate is {candidates_here(q4_file, tmp_path)[0]}")
    fast = f"blocks/int8/{isa}"
    timings = {p: (5.0, 10.0) for p in candidates_here(q4_file, tmp_path)}
    timings[fast] = (1.0, 1.0)
    timings[f"blocks/float32/{isa}"] = (2.0, 2.0)
    checked = []

    def kl(p, inputs, exact):
        checked.append((str(p), str(exact)))
        return 2 * path_choice.KL_BAR
    engine = load_engine("m", q4_file, settings(tmp_path), None, None, measure=lambda parts, slots: timings, kl=kl)
    assert checked == [(fast, f"blocks/float32/{isa}")]
    assert engine.path_record.chosen == f"blocks/float32/{isa}" and used_path(engine) == f"blocks/float32/{isa}"
    assert engine.path_record.accuracy[fast]["ok"] is False


def test_the_record_is_read_at_the_next_start_and_measured_again_when_it_no_longer_fits(q4_file, tmp_path):
    first = load_engine("m", q4_file, settings(tmp_path), None, None, measure=forced("float32"))
    assert first.path_record.chosen == "float32"

    def never(parts, slots):
        raise AssertionError("measured again")
    again = load_engine("m", q4_file, settings(tmp_path), None, None, measure=never)
    assert again.path_record.chosen == "float32" and again.backend == first.backend
    seen: list = []
    bigger = GenerativeSettings(**{**settings(tmp_path).__dict__, "kv_slots": 8})
    load_engine("m", q4_file, bigger, None, None,
                measure=lambda parts, slots: seen.append(slots) or {p: (1.0, 1.0) for p in parts})
    assert seen == [8]  # another slot count: the figures at `slots` rows must be measured again


def test_real_measurement_on_a_k_quant_file_records_every_path_s_figures(tmp_path):
    """No seam: the engine times the paths itself on a Q4_K/Q5_K/Q6_K/Q8_0 file and serves the choice."""
    path = tmp_path / "k.gguf"
    write_kquant_gguf(path)
    engine = load_engine("m", path, settings(tmp_path), None, None)
    record = engine.path_record
    assert set(record.timings_ms) == set(candidates_here(path, tmp_path))
    assert all(t[0] > 0 and t[1] > 0 for t in record.timings_ms.values())
    assert f": {record.chosen}" in engine.backend
    assert used_path(engine) == record.chosen
    assert record.cpu == cpu_isa.cpu_info().brand if record.cpu != "unknown" else True


def test_without_our_kernels_backend_says_why(q4_file, tmp_path, monkeypatch):
    monkeypatch.setenv("APPLIANCE_CPU_KERNELS", "0")
    engine = load_engine("m", q4_file, settings(tmp_path), None, None, measure=forced("blocks/float32/torch"))
    assert "our kernels unavailable: our CPU kernels are switched off (APPLIANCE_CPU_KERNELS=0)" in engine.backend
    assert engine.path_record.chosen == "blocks/float32/torch" and used_path(engine) == "blocks/float32/torch"
    assert set(engine.path_record.timings_ms) == {"blocks/float32/torch", "float32", "bfloat16"}


def test_avxvnni_named_on_a_cpu_with_avx512_vnni_only_runs_the_evex_stand_in(q4_file, tmp_path):
    """`quant_kernels: avxvnni` on a CPU with AVX-512 VNNI but no AVX-VNNI (this EPYC): served by the avxvnni
    kernels with vpdpbusd EVEX-encoded, and Backend says so; `auto` keeps to the CPU's own kernels."""
    info = cpu_here(tmp_path / "kernels")
    if not info.stands_in("avxvnni"):
        pytest.skip("this CPU has AVX-VNNI itself, or no AVX-512 VNNI: no stand-in to serve")
    assert not any(p.endswith("/avxvnni") for p in candidates_here(q4_file, tmp_path))
    engine = load_engine("m", q4_file, settings(tmp_path, quant_kernels="avxvnni"), None, None,
                         measure=forced("blocks/int8/avxvnni"), kl=lambda p, inputs, exact: 0.0)
    assert engine.path_record.chosen == "blocks/int8/avxvnni" and used_path(engine) == "blocks/int8/avxvnni"
    assert "avxvnni without AVX-VNNI here: its kernels run with vpdpbusd EVEX-encoded" in engine.backend
    lin = engine.model.layers[0].gate_up
    lin = getattr(lin, "parts", [lin])[0]
    x = torch.randn(3, lin.in_features, generator=torch.Generator().manual_seed(1))
    evex = lin(x)  # through the stand-in; integer sums are exact, so the avx2 kernels give the same bits
    assert lin.kernels.isa == "avxvnni" and torch.equal(evex, quant.linear_for(lin.matrix, cpu_quant.kernels(
        "avx2", "int8", tmp_path / "kernels"))(x))


def test_no_compiler_and_no_prebuilt_library_is_named_too(q4_file, tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_build, "SOURCE_DIR", tmp_path / "nothing-prebuilt")
    monkeypatch.setattr(cpu_isa, "_cpu", [])
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path))
    engine = load_engine("m", q4_file, settings(tmp_path), None, None, measure=forced("float32"))
    assert "our kernels unavailable: no C compiler (cc/gcc) on PATH" in engine.backend


def test_a_file_type_without_a_kernel_is_named(tmp_path, monkeypatch):
    """A Q2_K matrix (no kernel of ours) in a file otherwise kept in its blocks: requantized to Q8_0, and said."""
    import numpy as np

    import test_quantized
    real = test_quantized.random_blocks

    def blocks(name, n, k, seed, scale=0.02):
        if name != "Q2_K":
            return real(name, n, k, seed, scale)
        rng = np.random.default_rng(seed)  # Q2_K: scales[16], qs[64], d fp16, dmin fp16 per 256 inputs
        raw = rng.integers(0, 256, size=(n * k // 256, 84), dtype=np.uint8)
        for off in (80, 82):
            raw[:, off:off + 2] = (rng.standard_normal(len(raw)) * 1e-3).astype(np.float16).view(np.uint8).reshape(-1, 2)
        return raw.reshape(n, -1)
    monkeypatch.setattr(test_quantized, "random_blocks", blocks)
    monkeypatch.setitem(test_quantized.KQUANT_TYPES, "attn_output", test_gguf.QT.Q2_K)
    monkeypatch.setitem(test_quantized.SCALES, test_gguf.QT.Q2_K, 1e-3)
    write_kquant_gguf(tmp_path / "q2.gguf")
    engine = load_engine("m", tmp_path / "q2.gguf", settings(tmp_path, weights="blocks", activations="float32"),
                         None, None)
    assert "no kernel for Q2_K: those matrices requantized to Q8_0" in engine.backend
    assert engine.model.layers[0].o.matrix.type_name == "Q8_0"


# ---- through the appliance ----------------------------------------------------------------------------------------

def test_backend_metrics_and_status_page_show_the_measured_choice(tmp_path):
    """A real appliance measures in its worker at the first load: the model's Backend node (over SignAndEncrypt),
    appliance_model_info's weight_format label and the status page all show the recorded choice."""
    from harness import RunningAppliance
    from uaclient import read, run, session

    model = tmp_path / "k.gguf"
    write_kquant_gguf(model)
    app = RunningAppliance(tmp_path / "app", {"chat": {"kind": "generative", "path": str(model)}},
                           {"engine": {"kv_slots": 2, "max_seq_len": 128, "max_new_tokens": 16}})
    try:
        cert, key = app.issue("monitor", "monitor")

        async def go():
            async with session(app, cert, key) as c:
                return await read(c, "Models", "chat", "Backend")
        backend = run(go())
        (record_file,) = (tmp_path / "app" / "cache" / "weights" / "chat").glob("choice-*.json")
        record = json.loads(record_file.read_text())
        assert backend.startswith("cpu ") and "auto, measured" in backend, backend
        fmt = weight_format_of(backend)
        chosen = PathName.parse(record["chosen"])
        assert fmt.endswith("/" + chosen.activations) or fmt == chosen.weights, (fmt, record["chosen"])
        pattern = r'appliance_model_info\{[^}]*model="chat"[^}]*weight_format="' + re.escape(fmt) + '"'
        deadline = time.monotonic() + 15  # the supervision loop publishes model info once a second
        while not re.search(pattern, metrics := urllib.request.urlopen(app.metrics_url + "/metrics",
                                                                       timeout=10).read().decode()):
            assert time.monotonic() < deadline, metrics
            time.sleep(0.2)
        page = urllib.request.urlopen(app.metrics_url + "/", timeout=10).read().decode()
        assert f"<b>{fmt}</b>" in page
    finally:
        app.stop()


def test_models_prepare_measures_records_and_lays_out(tmp_path, q4_file, capsys):
    """`appliance models prepare NAME`: the paths measured with the YAML's engine settings, the table printed, the
    record and the laid-out weights left where the service reads them."""
    import yaml

    from appliance.cli import main
    state = tmp_path / "state"
    config = tmp_path / "appliance.yaml"
    config.write_text(yaml.safe_dump({
        "server": {"endpoint": "opc.tcp://127.0.0.1:48400", "state_dir": str(state)},
        "engine": {"kv_slots": 2, "max_seq_len": 128, "max_new_tokens": 16, "compile": "off"},
        "models": {"chat": {"kind": "generative", "path": str(q4_file)}}}))
    assert main(["models", "prepare", "chat", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    (record_file,) = (state / "cache" / "weights" / "chat").glob("choice-*.json")
    record = json.loads(record_file.read_text())
    assert "chat: cpu " in out and f": {record['chosen']}" in out
    for path in record["timings_ms"]:
        assert re.search(rf"^\s+{re.escape(path)}\s+[\d.]+\s+[\d.]+", out, re.M), (path, out)
    assert re.search(rf"{re.escape(record['chosen'])}\s+[\d.]+\s+[\d.]+.*<- chosen", out)
    if PathName.parse(record["chosen"]).quantized:
        assert list((state / "cache" / "weights" / "chat").glob("*.weights"))
    assert main(["models", "prepare", "nosuch", "--config", str(config)]) == 2


def test_a_decode_step_compiled_on_this_box_before_is_compiled_at_ready_on_every_later_start(tmp_path, q4_file,
                                                                                              caplog):
    """engine.compile: auto. The first start of a model on a box that was never prepared compiles in the background
    (and writes its package); every later start loads the package before load_engine returns, i.e. before Ready:
    the box never serves eager decode while a compile takes a core. `prepare` does the first compile."""
    from appliance.engine.llm.loading import compile_in_background, prepare_model
    s = GenerativeSettings(**{**settings(tmp_path).__dict__, "compile": "auto", "weights": "blocks",
                              "activations": "float32", "compile_cache_dir": str(tmp_path / "inductor")})
    first = load_engine("m", q4_file, s, None, None)
    assert first.compiled_decode is not None and not first.compiled_decode.ready  # serves eager, compiles after
    assert not first.compiled_decode.prepared
    with caplog.at_level("WARNING"):
        compile_in_background("m", first).join(600)
    assert first.compiled_decode.ready, f"the background compile did not finish: {caplog.text}"
    assert first.compiled_decode.built and first.compiled_decode.prepared  # its package written
    second = load_engine("m", q4_file, s, None, None)
    assert second.compiled_decode.ready and not second.compiled_decode.built  # loaded, not compiled again

    prepared = prepare_model("m", q4_file, GenerativeSettings(**{**s.__dict__, "compile_cache_dir":
                                                                 str(tmp_path / "other-inductor")}))
    assert prepared.compiled_decode.ready and prepared.compiled_decode.built and prepared.compiled_decode.prepared


NO_AVX2_PROCESS = """
import asyncio, json, logging, sys, time
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
import torch
from appliance.engine.llm.service import GenerativeModelService
from appliance.engine.llm.settings import GenerativeSettings
from kernels import cpu_build, cpu_isa, cpu_quant

async def main():
    svc = GenerativeModelService("m", sys.argv[2], GenerativeSettings(
        kv_slots=2, max_seq_len=128, max_new_tokens=8, weight_cache_dir=sys.argv[3] + "/weights",
        cpu_kernel_dir=sys.argv[3] + "/kernels", compile="off"), version_label="t", metrics=None)
    await svc.start()
    reply = await svc.generate("s", "hello pump", 6, 0.0, time.monotonic() + 300)
    print(json.dumps({"state": svc.state, "backend": svc.backend_name, "tokens": reply.token_count,
                      "capability": torch.backends.cpu.get_cpu_capability(),
                      "isas": cpu_isa.cpu_info().isas}))
    await svc.stop()

logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
asyncio.run(main())
"""


def test_a_cpu_without_avx2_is_served_and_says_which_path_and_why(q4_file, tmp_path):
    """An Atom x6000 or an older Celeron (no AVX, no AVX2): emulated here by masking what our kernels see
    (APPLIANCE_CPU_ISA=none) and torch's dispatch (ATEN_CPU_CAPABILITY=default, set before torch loads). The model
    loads with no import error, `auto` measures the paths that remain (torch's int4 op, dense float32 and
    bfloat16) and serves one, Backend names it and the reason our kernels are out, and the first Generate answers."""
    import os
    import subprocess
    import sys
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "APPLIANCE_CPU_ISA": "none", "ATEN_CPU_CAPABILITY": "default"}
    out = subprocess.run([sys.executable, "-c", NO_AVX2_PROCESS, root, str(q4_file), str(tmp_path)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    run = json.loads(out.stdout.strip().splitlines()[-1])
    assert run["capability"] == "DEFAULT" and run["isas"] == [] and run["state"] == "Ready"
    assert run["tokens"] >= 1
    backend = run["backend"]
    assert "our kernels unavailable: the CPU has no AVX2 with FMA and F16C (cpuid, as APPLIANCE_CPU_ISA=none makes " \
           "it look)" in backend
    assert re.search(r": (blocks/float32/torch|float32|bfloat16)\b.*\(auto, measured", backend), backend


def test_a_path_far_out_of_the_race_is_timed_once(monkeypatch):
    """measure() times every path in the first RACE_TRIALS trials, then only those within OUT_OF_RACE of the fastest
    at one row count or the other (the first start's measurement under AVX2 spent most of its 56 s on paths tens to
    hundreds of times slower at both): the slow path keeps its first trials' figures; a path far
    behind at 1 row but fastest at 4 is timed to the end. The clock is
    the products' own cost (a clock that advances by what each call costs): the same on a loaded CPU."""
    import types
    calls: dict[str, int] = {}
    clock = [0.0]
    monkeypatch.setattr(path_choice, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def parts(name: str, seconds: float, seconds_at_4: float | None = None) -> path_choice.StepMatmuls:
        def linear(x):
            calls[name] = calls.get(name, 0) + 1
            clock[0] += seconds if x.shape[0] == 1 or seconds_at_4 is None else seconds_at_4
        return path_choice.StepMatmuls([linear], [8], layers=2, head=linear, head_in=8, head_scale=1.0)
    timings = path_choice.measure({"fast": parts("fast", 0.001), "close": parts("close", 0.002),
                                   "slow": parts("slow", 0.01),
                                   "wide": parts("wide", 0.05, 0.0005)},  # far behind at 1 row, fastest at 4
                                  slots=4, trials=5, inner=3)
    assert timings == {"fast": pytest.approx((3.0, 3.0)), "close": pytest.approx((6.0, 6.0)),
                       "slow": pytest.approx((30.0, 30.0)), "wide": pytest.approx((150.0, 1.5))}
    # per path: 2 row counts x (layer + head) x (warm-up + trials x (untimed + inner))
    assert calls["fast"] == calls["close"] == calls["wide"] == 2 * 2 * (1 + 5 * (1 + 3))
    assert calls["slow"] == 2 * 2 * (1 + path_choice.RACE_TRIALS * (1 + 3))  # 10x behind at both row counts
    assert path_choice.rank(timings)[0] == "fast"
