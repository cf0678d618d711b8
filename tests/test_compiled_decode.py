"""The decode step compiled ahead of time (loader/compiled_decode.py) against the eager forward it replaces: the
same greedy tokens for 8 sequences of different lengths decoded together, one package for every batch and length,
the package loaded (not compiled again) by the next process and by a reload, the compiler kept out of the serving
process, and the eager path serving where compiling fails."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from appliance.engine.llm.runner import ModelRunner  # noqa: E402
from appliance.engine.llm.scheduler import Scheduler  # noqa: E402
from appliance.engine.llm.sequence import Sequence  # noqa: E402
from appliance.engine.llm.slots import SlotManager  # noqa: E402
from appliance.engine.llm.token_turns import TokenTurns, run_to_end  # noqa: E402
from loader.compiled_decode import CompiledDecode, CompileUnavailable  # noqa: E402
from models.llama import KVCache, LlamaModel  # noqa: E402
from loader.weights import load_weights  # noqa: E402
from tiny_llm import make_model_dir  # noqa: E402

SEQS = 8
NEW = 10
MAX_SEQ = 160


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("compiled")
    make_model_dir(d, seed=11)
    return d


@pytest.fixture(scope="module")
def first_build(model_dir, tmp_path_factory) -> tuple[Path, dict]:
    """A cache directory holding the float32 package of the tiny model for SEQS x MAX_SEQ, built by a process of its
    own as a worker's first start builds it, and what that process held afterwards
    (test_the_serving_process_never_holds_the_compiler); compiled once for the tests that need such a package rather
    than the act of building it (each compile is ~20 s of a 2-core box). A test that adds or breaks a package works
    on a copy (`copy_of`)."""
    d = tmp_path_factory.mktemp("inductor-float32")
    run = compile_in_a_process(model_dir, d)
    assert run["built"] and len(list(d.glob("decode-*.pt2"))) == 1
    return d, run


@pytest.fixture(scope="module")
def float32_package(first_build) -> Path:
    return first_build[0]


@pytest.fixture(scope="module")
def int4_package(model_dir, tmp_path_factory) -> Path:
    """The same with our AVX2 kernels' int8 path (their ops name the library by path)."""
    d = tmp_path_factory.mktemp("inductor-int4")
    model, kv_dtype = build(model_dir, "int4+avx2")
    compiled = CompiledDecode(model, KVCache(model.config, SEQS, MAX_SEQ, kv_dtype), d)
    compiled.compile()
    assert compiled.built
    return d


def test_the_step_with_our_kernels_attends_through_their_operator(model_dir, int4_package):
    """Where the model multiplies with our CPU kernels, each layer's decode attention is their operator
    (kernels/cpu/quant_attention.h), not Inductor's loops; tests/test_cpu_attention.py checks its numbers."""
    import zipfile
    (package,) = int4_package.glob("decode-*.pt2")
    with zipfile.ZipFile(package) as z:
        calls = [z.read(n).count(b"quant_cpu::decode_attention") for n in z.namelist() if n.endswith(".json")]
    assert sum(calls) == load_weights(model_dir, torch.float32).config.num_hidden_layers


def copy_of(package_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(package_dir, tmp_path / "inductor"))


def build(model_dir: Path, fmt: str):
    if fmt == "float32":
        w = load_weights(model_dir, torch.float32)
        return LlamaModel(w.config, w.tensors), torch.float32
    from kernels_here import best_kernels
    kernels = best_kernels("float32")  # a skip only where the CPU lacks AVX2; a failed build fails
    w = load_weights(model_dir, torch.float32, "int4")
    return LlamaModel(w.config, w.tensors, cpu_kernels=kernels), torch.bfloat16


def decode_together(model, cache, compiled) -> tuple[dict[int, list[int]], int]:
    """Greedy tokens of SEQS prompts of lengths 3..66 decoded together, and how many decode steps went through the
    compiled step."""
    g = torch.Generator().manual_seed(2)
    prompts = {str(i): [1] + torch.randint(3, model.config.vocab_size, (2 + 9 * i,), generator=g).tolist()
               for i in range(SEQS)}
    sched = Scheduler(SlotManager(SEQS, MAX_SEQ), TokenTurns(prompts), prefill_chunk=32, max_prefill_tokens=256)
    seqs = {i: Sequence(session_key=f"s{i}", prompt=str(i), max_tokens=NEW) for i in range(SEQS)}
    for s in seqs.values():
        sched.add(s)
    runner = ModelRunner(model, cache, compiled=compiled)
    steps = count_steps(compiled) if compiled is not None else [0]
    run_to_end(sched, runner)
    return {i: s.generated for i, s in seqs.items()}, steps[0]


def count_steps(compiled: CompiledDecode) -> list[int]:
    """From now on, [decode steps that went through the compiled step]."""
    calls = [0]
    real_step = compiled.step

    def counting_step(*args):
        calls[0] += 1
        return real_step(*args)
    compiled.step = counting_step
    return calls


PACKAGES = {"float32": "float32_package", "int4+avx2": "int4_package"}


@pytest.mark.parametrize("fmt", ["float32", "int4+avx2"])
def test_compiled_gives_the_eager_greedy_tokens_for_8_sequences_together(model_dir, fmt, tmp_path, request):
    model, kv_dtype = build(model_dir, fmt)
    eager, _ = decode_together(model, KVCache(model.config, SEQS, MAX_SEQ, kv_dtype), None)
    cache = KVCache(model.config, SEQS, MAX_SEQ, kv_dtype)
    # the module's package, compiled once in this process for a model of the same weights and loaded here
    compiled = CompiledDecode(model, cache, request.getfixturevalue(PACKAGES[fmt]))
    compiled.compile()
    assert compiled.ready and not compiled.built
    together, steps = decode_together(model, cache, compiled)
    assert steps >= NEW - 1  # the decode steps really went through the graph
    assert together == eager


def test_one_package_serves_every_batch_size_and_length(model_dir, float32_package):
    model, kv_dtype = build(model_dir, "float32")
    cache = KVCache(model.config, SEQS, MAX_SEQ, kv_dtype)
    compiled = CompiledDecode(model, cache, float32_package)
    compiled.compile()
    for b in range(1, SEQS + 1):
        for last in (0, 70, MAX_SEQ - 1):
            positions = torch.arange(b) * 3 % (last + 1)
            positions[-1] = last
            out = compiled.step(torch.ones(b, dtype=torch.long), torch.arange(b), positions)
            assert out.shape == (b, model.config.vocab_size)
    assert [p.name for p in float32_package.glob("*.pt2")] == [compiled.package_path(float32_package).name]


SECOND_PROCESS = """
import json, sys, torch
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
from loader.compiled_decode import CompiledDecode
from models.llama import KVCache, LlamaModel
from loader.weights import load_weights
from kernels import cpu_quant
kernels = cpu_quant.library() if sys.argv[4] == "int4+avx2" else None
w = load_weights(sys.argv[2], torch.float32, "int4" if kernels else None)
model = LlamaModel(w.config, w.tensors, cpu_kernels=kernels)
kv_dtype = torch.bfloat16 if kernels else torch.float32
compiled = CompiledDecode(model, KVCache(w.config, int(sys.argv[5]), int(sys.argv[6]), kv_dtype), sys.argv[3])
compiled.compile()
print(json.dumps({"built": compiled.built, "seconds": compiled.compile_seconds}))
"""


COMPILER_STAYS_OUT = """
import json, sys, torch
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
from loader.compiled_decode import CompiledDecode
from models.llama import KVCache, LlamaModel
from loader.weights import load_weights
torch.set_num_threads(int(sys.argv[6]))  # the test process's count: its tests load this package, not build another
w = load_weights(sys.argv[2], torch.float32)
model = LlamaModel(w.config, w.tensors)
compiled = CompiledDecode(model, KVCache(w.config, int(sys.argv[4]), int(sys.argv[5]), torch.float32), sys.argv[3])
compiled.compile()
out = compiled.step(torch.tensor([3, 4]), torch.tensor([0, 1]), torch.tensor([0, 0]))
compiler = sorted(m for m in sys.modules if m.startswith(("torch._inductor", "torch._dynamo")))
print(json.dumps({"built": compiled.built, "compiler": compiler, "shape": list(out.shape)}))
"""


def compile_in_a_process(model_dir: Path, cache_dir: Path) -> dict:
    """COMPILER_STAYS_OUT for the float32 model and a SEQS x MAX_SEQ cache in a process of its own: whether it built
    the package, the compiler modules it holds after, the step's output shape."""
    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", COMPILER_STAYS_OUT, root, str(model_dir), str(cache_dir), str(SEQS),
                          str(MAX_SEQ), str(torch.get_num_threads())], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_serving_process_never_holds_the_compiler(model_dir, first_build):
    """The package is built in a forked child: the worker that serves keeps neither the compiler's modules nor its
    memory (~1 GB for a 1B model), whether it built the package (first start: the module's package) or loaded it
    (every later one)."""
    cache_dir, first = first_build
    runs = [first, compile_in_a_process(model_dir, cache_dir)]
    assert [r["built"] for r in runs] == [True, False]
    assert runs[0]["compiler"] == runs[1]["compiler"] == []
    assert runs[0]["shape"][0] == runs[1]["shape"][0] == 2


def test_a_package_cut_short_is_compiled_again(model_dir, float32_package, tmp_path, caplog):
    """A package the loader cannot read (cut short by a full disk, written by hand) is removed and built again, and
    the step it serves has the eager numbers: a start never stays eager for ever because of a bad file."""
    model, kv_dtype = build(model_dir, "float32")
    cache_dir = copy_of(float32_package, tmp_path)
    first = CompiledDecode(model, KVCache(model.config, SEQS, MAX_SEQ, kv_dtype), cache_dir)
    package = first.package_path(cache_dir)
    assert package.exists()
    package.write_bytes(package.read_bytes()[:package.stat().st_size // 2])
    again = CompiledDecode(model, KVCache(model.config, SEQS, MAX_SEQ, kv_dtype), cache_dir)
    with caplog.at_level("WARNING"):
        again.compile()
    assert again.ready and again.built and "compiling it again" in caplog.text
    args = (torch.tensor([5, 9, 2]), torch.arange(3), torch.tensor([4, 7, 30]))
    eager = model.forward(KVCache(model.config, SEQS, MAX_SEQ, kv_dtype), args[0].view(-1, 1), args[1], args[2],
                          torch.ones(3, dtype=torch.long))
    assert torch.allclose(again.step(*args), eager, atol=1e-4)


def test_a_restart_reuses_the_compiled_artefacts(model_dir, request):
    """With our AVX2 kernels where they build: their ops name the library by path, which the next process shares.
    The first process is this one (the module's package); the next is a fresh interpreter."""
    from kernels import cpu_quant
    fmt = "int4+avx2" if cpu_quant.library() is not None else "float32"
    cache_dir = request.getfixturevalue(PACKAGES[fmt])
    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", SECOND_PROCESS, root, str(model_dir), str(cache_dir), fmt,
                          str(SEQS), str(MAX_SEQ)], capture_output=True, text=True, timeout=600, check=True)
    run_ = json.loads(out.stdout.strip().splitlines()[-1])
    assert not run_["built"]  # the next process loaded this one's package
    assert len(list(cache_dir.glob("decode-*.pt2"))) == 1
    print(f"compile ({fmt}): the next process loaded the package in {run_['seconds']:.1f} s")


def test_another_kind_of_model_in_the_same_process_gets_its_own_package(model_dir, float32_package, tmp_path):
    """A worker reloads its model at every deploy and rollback, and a new version may be another model: one that
    differs in a constant of the graph (as two models' norms do) compiles a package of its own and computes with
    its own constant, beside the first one's package (the module's, loaded here)."""
    import dataclasses
    w = load_weights(model_dir, torch.float32)
    args = (torch.tensor([5, 9, 2]), torch.arange(3), torch.tensor([4, 7, 30]))
    cache_dir = copy_of(float32_package, tmp_path)
    for i in range(2):
        config = dataclasses.replace(w.config, rms_norm_eps=w.config.rms_norm_eps * (1 + 1000 * i))
        model = LlamaModel(config, w.tensors)
        compiled = CompiledDecode(model, KVCache(config, SEQS, MAX_SEQ, torch.float32), cache_dir)
        compiled.compile()
        assert compiled.built == (i == 1)  # the first is the module's package; the second model builds its own
        eager = model.forward(KVCache(config, SEQS, MAX_SEQ, torch.float32), args[0].view(-1, 1), args[1], args[2],
                              torch.ones(3, dtype=torch.long))
        assert torch.allclose(compiled.step(*args), eager, atol=1e-4)
    assert len(list(cache_dir.glob("decode-*.pt2"))) == 2


def test_a_failed_compile_leaves_decode_eager(model_dir, monkeypatch, caplog):
    from appliance.engine.llm.loading import compile_decode
    model, kv_dtype = build(model_dir, "float32")
    cache = KVCache(model.config, SEQS, MAX_SEQ, kv_dtype)
    compiled = CompiledDecode(model, cache)

    def broken(*_args, **_kwargs):
        raise RuntimeError("no C++ compiler")
    monkeypatch.setattr(torch.export, "export", broken)
    with pytest.raises(CompileUnavailable, match="no C\\+\\+ compiler"):
        compiled.compile()
    with caplog.at_level("WARNING"):
        compile_decode("tiny", compiled)
    assert "decode stays eager" in caplog.text and not compiled.ready
    eager, _ = decode_together(model, KVCache(model.config, SEQS, MAX_SEQ, kv_dtype), None)
    together, steps = decode_together(model, cache, compiled)
    assert steps == 0 and together == eager


def test_a_box_without_a_compiler_stays_eager_at_once(model_dir):
    """The installed box has no g++: compile() says so before tracing (Inductor would fail after a minute of it,
    a minute of a core the model serves on)."""
    import torch._inductor.config as inductor_config
    model, kv_dtype = build(model_dir, "float32")
    compiled = CompiledDecode(model, KVCache(model.config, SEQS, MAX_SEQ, kv_dtype))
    started = time.monotonic()
    with inductor_config.patch({"cpp.cxx": (None, "/nonexistent/g++")}):  # torch's config: its own patch
        with pytest.raises(CompileUnavailable, match="no C\\+\\+ compiler for Inductor"):
            compiled.compile()
    assert time.monotonic() - started < 2 and not compiled.ready


def test_generate_over_opc_ua_with_the_compiled_step_answers_as_eager(tmp_path, model_dir, monkeypatch):
    """engine.compile from the YAML reaches the worker: `on` compiles before Ready (artefacts under the state
    directory), and two sessions generating together get the eager appliance's texts. The workers run as on a box
    (no Triton interpreter, which the suite turns on for the kernel tests): on a CPU-only box the compiling worker
    never loads Triton."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from asyncua import ua

    from harness import RunningAppliance
    from uaclient import call, run, session, status_name

    def texts(mode: str) -> list[str]:
        app = RunningAppliance(tmp_path / mode, {"chat": {"kind": "generative", "path": str(model_dir),
                                                          "max_text_chars": 200}},
                               {"engine": {"kv_slots": 2, "max_seq_len": 256, "max_new_tokens": 12,
                                           "compile": mode}})
        try:
            operator = app.issue("plc1", "operator")

            async def one(prompt):
                async with session(app, *operator) as c:
                    r = await call(c, "chat", "Generate", [ua.Variant(prompt, ua.VariantType.String),
                                                           ua.Variant(12, ua.VariantType.UInt32),
                                                           ua.Variant(0.0, ua.VariantType.Float)])
                    assert status_name(r) == "Good"
                    return r.OutputArguments[0].Value

            async def both():
                return list(await asyncio.gather(one("pump one"), one("tank level rising high")))
            answers = run(both())
            if mode == "on" and not torch.cuda.is_available():  # a CPU-only box: the worker never loads Triton
                pid = app.app.services["chat"].supervisor.process.pid
                with open(f"/proc/{pid}/maps") as f:
                    assert "libtriton" not in f.read()
            return answers
        finally:
            app.stop()
    compiled = texts("on")
    assert any((tmp_path / "on" / "cache" / "inductor").iterdir())
    assert compiled == texts("off")


@pytest.mark.parametrize("case", ["cpu", "cuda", "interpreter"])
def test_a_cpu_worker_keeps_triton_out_and_still_compiles(case):
    """keep_triton_out in a fresh process, as a worker calls it before its engine imports torch: CPU-only models
    make `import triton` fail (Inductor imports it otherwise: 66 MB of a worker's memory) and the decode step still
    compiles; a model on a GPU, or the Triton interpreter (tests), keeps it importable."""
    code = f"""
import math, sys
from appliance.workers import protocol as p
from appliance.workers.os_setup import keep_triton_out
keep_triton_out([p.ModelSpec("m", "generative", "x", None, {{"device": "{'cuda:0' if case == 'cuda' else 'cpu'}"}})])
import torch, torch._inductor
step = torch.compile(lambda x: (x * 2).sin().sum())
assert abs(float(step(torch.ones(4))) - 4 * math.sin(2)) < 1e-5
print("blocked" if sys.modules.get("triton", 0) is None else "importable")
"""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    env.pop("TRITON_INTERPRET", None)
    if case == "interpreter":
        env["TRITON_INTERPRET"] = "1"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == ("blocked" if case == "cpu" else "importable")


def test_auto_compiles_in_the_background_after_ready_and_decode_switches_over(model_dir, tmp_path, caplog):
    """engine.compile: auto: Ready without waiting for the compiler, eager answers meanwhile, the compiled step once
    it is built, and the same greedy text from both."""
    import threading
    import time as clock

    from appliance.engine.llm.service import GenerativeModelService
    from appliance.engine.llm.settings import GenerativeSettings

    caplog.set_level("WARNING")

    async def go():
        svc = GenerativeModelService("tiny", model_dir, GenerativeSettings(
            kv_slots=2, max_seq_len=128, max_new_tokens=8, compile="auto",
            compile_cache_dir=str(tmp_path / "inductor")), version_label="t", metrics=None)
        await svc.start()
        try:
            compiled = svc._engine.compiled_decode
            assert svc.state == "Ready" and not compiled.ready  # Ready came first
            eager = await svc.generate("a", "pump one", 8, 0.0, clock.monotonic() + 60)
            end = clock.monotonic() + 300
            compiling = lambda: any(t.name == "compile-tiny" for t in threading.enumerate())  # noqa: E731
            while not compiled.ready and compiling() and clock.monotonic() < end:
                await asyncio.sleep(0.2)
            assert compiled.ready, caplog.text  # a failed compile says why in the log
            calls = count_steps(compiled)
            after = await svc.generate("b", "pump one", 8, 0.0, clock.monotonic() + 60)
            assert calls[0] > 0 and after.text == eager.text
        finally:
            await svc.stop()
    asyncio.run(go())


def test_a_reloaded_model_reuses_the_graphs_with_its_own_weights(model_dir, float32_package):
    """A reload makes a new CompiledDecode: the package takes weights and cache at load, so it compiles nothing
    new, and it computes with the new weights, not the old ones (the package was compiled with the first)."""
    w = load_weights(model_dir, torch.float32)
    args = (torch.tensor([5, 9, 2]), torch.arange(3), torch.tensor([4, 7, 30]))
    graphs, steps = [], []
    for scale in (1.0, 1.5):
        model = LlamaModel(w.config, {k: v * scale if ".mlp." in k else v for k, v in w.tensors.items()})
        compiled = CompiledDecode(model, KVCache(model.config, SEQS, MAX_SEQ, torch.float32), float32_package)
        compiled.compile()
        graphs.append(compiled.built)
        eager = model.forward(KVCache(model.config, SEQS, MAX_SEQ, torch.float32), args[0].view(-1, 1), args[1],
                              args[2], torch.ones(3, dtype=torch.long))
        steps.append(compiled.step(*args))
        assert torch.allclose(steps[-1], eager, atol=1e-4)
    assert graphs == [False, False] and not torch.allclose(steps[0], steps[1], atol=1e-3)


@pytest.mark.parametrize("n_heads, n_kv, cache_dtype", [(9, 3, torch.bfloat16), (32, 8, torch.bfloat16),
                                                        (4, 4, torch.float32)])
def test_the_traced_decode_attention_is_the_eager_one(n_heads, n_kv, cache_dtype):
    """GraphOps.attend (products and sums that Inductor fuses) against TorchOps.attend (sdpa) for decode rows of
    slots in any order, each looking at its own length, with grouped query heads and a narrower cache."""
    from models.forward_ops import GraphOps, TorchOps
    torch.manual_seed(5)
    slots, max_seq, hd, t = 6, 96, 64, 64
    k_cache = torch.randn(slots, n_kv, max_seq + 1, hd).to(cache_dtype)
    v_cache = torch.randn(slots, n_kv, max_seq + 1, hd).to(cache_dtype)
    slot_ids = torch.tensor([4, 0, 5, 2])
    positions = torch.tensor([0, 17, 63, 40])
    mask = (torch.arange(t) <= positions[:, None]).view(4, 1, 1, t)
    cos, sin = torch.ones(max_seq, hd), torch.zeros(max_seq, hd)
    rows = TorchOps.graph_decode_rows(torch.zeros(4, dtype=torch.long), slot_ids, positions, mask, cos, sin)
    q = torch.randn(4, n_heads, hd)
    want = TorchOps(1e-5).attend(q, k_cache, v_cache, rows)
    got = GraphOps(1e-5).attend(q, k_cache, v_cache, rows)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_step_s_loops_are_generated_for_the_threads_it_serves_with(model_dir, float32_package, tmp_path):
    """The package is built in a forked child computing on one thread; its loops must still be parallel for the
    worker's threads (built for one, every fused loop ran on one core), and a package is keyed by that count."""
    import zipfile
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model, kv_dtype = build(model_dir, "float32")
        cache = KVCache(model.config, SEQS, MAX_SEQ, kv_dtype)
        cache_dir = copy_of(float32_package, tmp_path)  # loaded where this process had 2 threads, else compiled
        compiled = CompiledDecode(model, cache, cache_dir)
        compiled.compile()
        package = compiled.package_path(cache_dir)
        with zipfile.ZipFile(package) as z:
            kernels = "".join(z.read(n).decode() for n in z.namelist() if n.endswith(".kernel.cpp"))
        assert "#pragma omp parallel num_threads(2)" in kernels
        torch.set_num_threads(1)
        assert compiled.package_path(cache_dir) != package
    finally:
        torch.set_num_threads(before)


CAPPED_PROCESS = """
import json, sys, torch
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
from loader.compiled_decode import CompiledDecode, inductor_isa
from models.llama import KVCache, LlamaModel
from loader.weights import load_weights
w = load_weights(sys.argv[2], torch.float32)
model = LlamaModel(w.config, w.tensors)
compiled = CompiledDecode(model, KVCache(w.config, 4, 64, torch.float32), sys.argv[3])
compiled.compile()
from pathlib import Path
print(json.dumps({"package": str(compiled.package_path(Path(sys.argv[3]))), "isa": inductor_isa(),
                  "capability": torch.backends.cpu.get_cpu_capability()}))
"""


def test_a_step_compiled_under_aten_cpu_capability_avx2_holds_no_avx512(model_dir, tmp_path):
    """`bench/generate.py --isa avx2` emulates an AVX2-only CPU: torch capped by ATEN_CPU_CAPABILITY=avx2, and the
    compiled step's generated code too, its vector code and its other loops (Inductor builds those with
    -march=native unless told otherwise): no zmm register in the package's shared object, and a package of its own
    (never the native one loaded under the cap)."""
    import zipfile
    root = str(Path(__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CPP_MARCH", "ATEN_CPU_CAPABILITY")}
    out = subprocess.run([sys.executable, "-c", CAPPED_PROCESS, root, str(model_dir), str(tmp_path / "inductor")],
                         capture_output=True, text=True, timeout=900, env={**env, "ATEN_CPU_CAPABILITY": "avx2"})
    assert out.returncode == 0, out.stderr[-3000:]
    run = json.loads(out.stdout.strip().splitlines()[-1])
    assert run["capability"] == "AVX2" and run["isa"] == "avx2/x86-64-v3", run
    with zipfile.ZipFile(run["package"]) as z:
        objects = [n for n in z.namelist() if n.endswith(".so")]
        assert objects
        for name in objects:
            path = z.extract(name, tmp_path / "unpacked")
            text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", path], capture_output=True, text=True,
                                  check=True).stdout
            assert "ymm" in text  # AVX2's vectors are used
            assert "zmm" not in text, name
    from loader.compiled_decode import inductor_isa
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX2"):  # this process: the CPU's own capability
        model, kv_dtype = build(model_dir, "float32")
        native = CompiledDecode(model, KVCache(model.config, 4, 64, torch.float32), tmp_path / "inductor")
        assert inductor_isa() != run["isa"] and native.package_path(tmp_path / "inductor") != Path(run["package"])
