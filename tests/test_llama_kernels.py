"""The engine's Llama decode step through the fused Triton kernels (the interpreter on this CPU) gives the eager
path's greedy tokens, several ragged rows in slots out of order, and so does the engine end to end."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
import triton  # noqa: E402,F401 - a test dependency (pyproject [test]): missing, these fail instead of skipping
from tiny_llm import make_model_dir  # noqa: E402

from models.llama import KVCache, LlamaModel  # noqa: E402
from loader.weights import load_weights  # noqa: E402


def greedy(model: LlamaModel, prompts: list[list[int]], slots: list[int], steps: int):
    cfg = model.config
    cache = KVCache(cfg, 4, 64, torch.float32)
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
    lens = torch.tensor([len(p) for p in prompts])
    logits = model.forward(cache, ids, torch.tensor(slots), torch.zeros(len(prompts), dtype=torch.long), lens)
    tokens, all_logits = [logits.argmax(-1)], [logits]
    pos = lens.clone()
    for _ in range(steps - 1):
        logits = model.forward(cache, tokens[-1].unsqueeze(1), torch.tensor(slots), pos, torch.ones_like(pos))
        tokens.append(logits.argmax(-1))
        all_logits.append(logits)
        pos += 1
    return torch.stack(tokens, 1).tolist(), torch.stack(all_logits, 1)


def test_kernel_decode_matches_the_eager_path(tmp_path):
    make_model_dir(tmp_path / "m", seed=3)
    loaded = load_weights(tmp_path / "m", torch.float32)
    eager = LlamaModel(loaded.config, loaded.tensors, kernels="torch")
    fused = LlamaModel(loaded.config, loaded.tensors, kernels="triton")
    assert fused.use_kernels() and not eager.use_kernels()
    prompts = [[5, 17, 33, 2, 91, 7, 8], [44, 12, 3]]
    want, want_logits = greedy(eager, prompts, [2, 0], 6)
    got, got_logits = greedy(fused, prompts, [2, 0], 6)
    assert got == want
    assert torch.allclose(got_logits, want_logits, atol=1e-4, rtol=1e-4)


def test_the_engine_through_the_kernels_answers_as_the_eager_engine(tmp_path):
    import asyncio

    from appliance.engine.llm.service import GenerativeModelService
    from appliance.engine.llm.settings import GenerativeSettings

    make_model_dir(tmp_path / "m", seed=5)

    async def answers(kernels: str) -> list[str]:
        svc = GenerativeModelService("llm", tmp_path / "m", GenerativeSettings(
            kv_slots=2, max_seq_len=128, max_new_tokens=8, kernels=kernels, device="cpu"))
        await svc.start()
        assert svc.state == "Ready", svc.failure_reason
        try:
            replies = await asyncio.gather(*(svc.generate(s, p, 6, 0.0, float("inf"))
                                             for s, p in (("a", "Is the pump running?"), ("b", "Valve 3"))))
            return [r.text for r in replies]
        finally:
            await svc.stop()

    assert asyncio.run(answers("triton")) == asyncio.run(answers("torch"))


def test_the_runner_through_decode_graphs_answers_as_the_eager_runner(tmp_path):
    """The runner's CUDA-graph path (on this CPU: the same padded bucket buffers, run eagerly) gives the eager
    path's tokens for ragged rows in slots out of order, batch sizes that fall between buckets included."""
    from appliance.engine.llm.runner import ModelRunner
    from appliance.engine.llm.scheduler import Scheduler
    from appliance.engine.llm.sequence import Sequence
    from appliance.engine.llm.slots import SlotManager
    from appliance.engine.llm.token_turns import TokenTurns, run_to_end

    make_model_dir(tmp_path / "m", seed=4)
    loaded = load_weights(tmp_path / "m", torch.float32)
    prompts = [[5, 17, 33, 2, 91], [44, 12, 3], [7, 7, 8, 9, 10, 11], [60, 61], [3, 4, 5]]

    def tokens(model: LlamaModel, graphs: bool) -> list[list[int]]:
        cache = KVCache(loaded.config, 8, 48, torch.float32)
        turns = TokenTurns({str(i): p for i, p in enumerate(prompts)})
        sched = Scheduler(SlotManager(8, 48), turns, prefill_chunk=16)
        runner = ModelRunner(model, cache, graphs=graphs)
        seqs = [Sequence(session_key=f"s{i}", prompt=str(i), max_tokens=4 + i) for i in range(len(prompts))]
        for s in seqs:
            sched.add(s)
        run_to_end(sched, runner)
        assert (runner._graphs is not None) == graphs
        return [s.generated for s in seqs]

    want = tokens(LlamaModel(loaded.config, loaded.tensors, kernels="torch"), graphs=False)
    got = tokens(LlamaModel(loaded.config, loaded.tensors, kernels="triton"), graphs=True)
    assert got == want
