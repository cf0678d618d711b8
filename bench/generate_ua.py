"""Generation through the OPC UA server versus the engine driven directly, and cold start with mapped weights
versus torch.load, on the same weights in the same run.

1. Cold start: the SmolLM2 GGUF is dequantised once into an HF directory (fp32 safetensors); then, each in a fresh
   process, (a) `load_weights` maps it (safetensors mmap) and (b) `torch.load` reads the same tensors from a .pt
   file. Prints seconds and peak RSS of each, and the service's time from start() to Ready on the mapped directory.
2. Throughput: aggregate generated tokens/s with N concurrent sequences (default 8, greedy, fixed MaxTokens),
   (a) through GenerativeModelService directly, (b) through the appliance's OPC UA server (a separate process) with N
   sessions calling Generate over SignAndEncrypt. Prints ua/direct (goal >= 0.8 at 8).

    .venv/bin/python bench/generate_ua.py [--sessions 8] [--max-tokens 64]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))  # tests/ports.py

PROMPTS = ["What is a centrifugal pump?", "Explain cavitation in one paragraph.", "What does a PLC do?",
           "Why do bearings overheat?", "Describe a heat exchanger.", "What is a control valve?",
           "How does a VFD save energy?", "What is predictive maintenance?", "Name three causes of vibration.",
           "What is OPC UA?", "Explain PID control simply.", "What is a pressure relief valve?",
           "How is flow measured?", "What is a setpoint?", "Why filter hydraulic oil?", "What is a SCADA system?"]

CHILD = r'''
import json, resource, sys, time
sys.path.insert(0, {root!r})
import torch
kind, path = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
if kind == "mapped":
    from loader.weights import load_weights
    w = load_weights(__import__("pathlib").Path(path), torch.float32)
    total = sum(t.numel() for t in w.tensors.values())
else:
    tensors = torch.load(path, weights_only=True)
    total = sum(t.numel() for t in tensors.values())
elapsed = time.perf_counter() - t0
print(json.dumps({{"seconds": elapsed, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "parameters": total}}))
'''


def export_hf_dir(gguf: Path, out: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    from loader.weights import load_weights
    w = load_weights(gguf, torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in w.tensors.items()}
    save_file(tensors, str(out / "model.safetensors"))
    torch.save(tensors, str(out / "weights.pt"))
    c = w.config
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings, "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_ids}))
    w.tokenizer.tokenizer.save(str(out / "tokenizer.json"))
    names = w.tokenizer.template_tokens
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": w.tokenizer.chat_template, **names}))
    return out


def wait_ready(url: str, timeout: float = 300) -> None:
    import urllib.error
    import urllib.request
    end = time.time() + timeout
    while time.time() < end:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError("the appliance did not become ready")


def child_load(kind: str, path: Path) -> dict:
    p = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT)), kind, str(path)],
                       capture_output=True, text=True, timeout=600)
    if p.returncode:
        raise RuntimeError(p.stderr[-2000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


async def direct(model_dir: Path, n: int, max_tokens: int) -> tuple[float, float]:
    from appliance.engine.llm.service import GenerativeModelService
    from appliance.engine.llm.settings import GenerativeSettings
    settings = GenerativeSettings(kv_slots=max(n, 1), max_seq_len=1024, max_new_tokens=max_tokens,
                                  slot_policy="evict_lru", prefill_chunk=256, dtype="float32", device="cpu",
                                  threads=0, seed=0, max_text_chars=16382, system_prompt=None, top_p=0.95,
                                  max_queue_size=64)
    svc = GenerativeModelService("bench", model_dir, settings, version_label=None, metrics=None)
    t0 = time.perf_counter()
    await svc.start()
    ready = time.perf_counter() - t0
    assert svc.state == "Ready", svc.failure_reason
    await asyncio.gather(*[svc.generate(f"warm{i}", "hi", 2, 0.0, time.monotonic() + 300) for i in range(n)])
    t0 = time.perf_counter()
    results = await asyncio.gather(*[svc.generate(f"s{i}", PROMPTS[i % len(PROMPTS)], max_tokens, 0.0,
                                                  time.monotonic() + 600) for i in range(n)])
    elapsed = time.perf_counter() - t0
    await svc.stop()
    return sum(r.token_count for r in results) / elapsed, ready


async def through_ua(endpoint: str, cert: Path, key: Path, n: int, max_tokens: int) -> float:
    from asyncua import ua

    from appliance.client import call_method, connect, model_node
    clients = [await connect(endpoint, cert, key, timeout=600) for _ in range(n)]
    try:
        nodes = []
        for c in clients:
            model, ns = await model_node(c, "assistant")
            nodes.append((model, await model.get_child(f"{ns}:Generate")))

        async def gen(i, prompt, tokens):
            c, (model, method) = clients[i], nodes[i]
            r = await call_method(c, model, method, [ua.Variant(prompt, ua.VariantType.String),
                                                     ua.Variant(tokens, ua.VariantType.UInt32),
                                                     ua.Variant(0.0, ua.VariantType.Float)])
            if not r.StatusCode.is_good():
                raise RuntimeError(r.StatusCode.name)
            return r.OutputArguments[1].Value
        await asyncio.gather(*[gen(i, "hi", 2) for i in range(n)])
        t0 = time.perf_counter()
        counts = await asyncio.gather(*[gen(i, PROMPTS[i % len(PROMPTS)], max_tokens) for i in range(n)])
        return sum(counts) / (time.perf_counter() - t0)
    finally:
        for c in clients:
            await c.disconnect()


def main() -> int:
    import logging
    logging.getLogger("asyncua").setLevel(logging.ERROR)
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    from core.config import resolve_builtin
    from certs.pki import PKI
    from ports import free_ports, wait_port

    work = Path(tempfile.mkdtemp(prefix="gen-bench-"))
    gguf = resolve_builtin("smollm2")
    model_dir = export_hf_dir(gguf, work / "smollm2-hf")
    size_mb = (model_dir / "model.safetensors").stat().st_size / 2**20
    mapped = child_load("mapped", model_dir)
    loaded = child_load("torch", model_dir / "weights.pt")
    print(f"weights: {mapped['parameters'] / 1e6:.1f} M parameters, {size_mb:.0f} MiB fp32")
    print(f"load, mapped safetensors: {mapped['seconds']:6.2f} s  peak RSS {mapped['peak_rss_mb']:6.0f} MB")
    print(f"load, torch.load        : {loaded['seconds']:6.2f} s  peak RSS {loaded['peak_rss_mb']:6.0f} MB")
    print(f"torch.load / mapped time: {loaded['seconds'] / mapped['seconds']:.2f}")

    rate_direct, ready = asyncio.run(direct(model_dir, args.sessions, args.max_tokens))
    print(f"service start() to Ready on the mapped directory: {ready:.2f} s")
    print(f"engine direct, {args.sessions} sequences: {rate_direct:7.1f} generated tokens/s")

    state = work / "state"
    pki = PKI(state)
    pki.init("urn:bench:appliance", ["localhost", socket.gethostname()], ["127.0.0.1"])
    pki.issue("bench", "operator", work / "clients", socket.gethostname())
    port, metrics_port = free_ports(2)
    cfg = {"server": {"endpoint": f"opc.tcp://127.0.0.1:{port}", "state_dir": str(state),
                      "application_uri": "urn:bench:appliance"},
           "metrics": {"listen": f"127.0.0.1:{metrics_port}"}, "logging": {"level": "WARNING"},
           "watchdog": {"backend": "none"},
           "engine": {"kv_slots": max(args.sessions, 1), "max_seq_len": 1024, "max_new_tokens": args.max_tokens,
                      "dtype": "float32", "request_timeout_s": 600},
           "models": {"assistant": {"kind": "generative", "path": str(model_dir), "max_text_chars": 16382}}}
    (work / "appliance.yaml").write_text(yaml.safe_dump(cfg))
    app = subprocess.Popen([sys.executable, "-m", "appliance", "serve", "--config", str(work / "appliance.yaml")],
                           env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.DEVNULL)
    try:
        wait_port(port, app)
        wait_ready(f"http://127.0.0.1:{metrics_port}/readyz")  # the model loads after the server listens
        rate_ua = asyncio.run(through_ua(f"opc.tcp://127.0.0.1:{port}", work / "clients" / "bench.der",
                                         work / "clients" / "bench.key.pem", args.sessions, args.max_tokens))
    finally:
        app.terminate()
        app.wait(30)
    print(f"through OPC UA, {args.sessions} sessions: {rate_ua:7.1f} generated tokens/s")
    print(f"ua/direct: {rate_ua / rate_direct:.2f}  (goal >= 0.8)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
