"""Batch invariance, reported: 16 prompts of different lengths decoded greedily alone and all together through the
scheduler and runner; how many outputs are identical, per weight format. Asserted for fp32 (the same numbers must
not depend on batch partners); printed for bfloat16, int8 and int4, whose matmul kernels may block differently by
batch size."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from appliance.engine.runner import ModelRunner  # noqa: E402
from appliance.engine.scheduler import Scheduler  # noqa: E402
from appliance.engine.sequence import FinishReason, Sequence  # noqa: E402
from appliance.engine.slots import SlotManager  # noqa: E402
from models.llama import KVCache, LlamaModel  # noqa: E402
from models.weights import load_weights  # noqa: E402
from tiny_llm import make_model_dir  # noqa: E402

PROMPTS = 16
NEW = 12


class Fixed:
    def __init__(self, prompts):
        self.prompts = prompts

    def prepare(self, seq, slot, acquired):
        slot.tokens.extend(self.prompts[int(seq.prompt)])

    def accept(self, seq, slot, token):
        seq.generated.append(token)
        slot.tokens.append(token)
        return FinishReason.LENGTH if len(seq.generated) >= seq.max_tokens else None

    def close(self, seq, slot):
        pass


def decode(model, kv_dtype, prompts, which: list[int]) -> dict[int, list[int]]:
    cache = KVCache(model.config, len(which), 96, kv_dtype)
    sched = Scheduler(SlotManager(len(which), 96), Fixed(prompts), prefill_chunk=64, max_prefill_tokens=1024)
    runner = ModelRunner(model, cache)
    seqs = {i: Sequence(session_key=f"s{i}", prompt=str(i), max_tokens=NEW) for i in which}
    for s in seqs.values():
        sched.add(s)
    while sched.has_work:
        plan = sched.schedule()
        sched.commit(plan, runner.run(plan))
    return {i: s.generated for i, s in seqs.items()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("invariance")
    make_model_dir(d, seed=3)
    return d


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "int4"])
def test_batch_invariance(model_dir, fmt):
    g = torch.Generator().manual_seed(5)
    if fmt in ("float32", "bfloat16"):
        w = load_weights(model_dir, getattr(torch, fmt))
        model, kv_dtype = LlamaModel(w.config, w.tensors, dtype=getattr(torch, fmt)), getattr(torch, fmt)
    else:
        w = load_weights(model_dir, torch.float32, fmt)
        model, kv_dtype = LlamaModel(w.config, w.tensors), torch.bfloat16
    vocab = w.config.vocab_size
    prompts = [[1] + torch.randint(3, vocab, (3 + 2 * i,), generator=g).tolist() for i in range(PROMPTS)]
    alone = {}
    for i in range(PROMPTS):
        alone.update(decode(model, kv_dtype, prompts, [i]))
    together = decode(model, kv_dtype, prompts, list(range(PROMPTS)))
    same = sum(alone[i] == together[i] for i in range(PROMPTS))
    print(f"batch invariance {fmt}: {same}/{PROMPTS} greedy outputs identical alone and together")
    if fmt == "float32":
        assert same == PROMPTS
