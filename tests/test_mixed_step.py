"""Prefill chunks and decode rows of one step in one pass over the weights (LlamaModel.forward_mixed, used by the
runner whenever a step has both): the same logits and cache contents as running them apart, and the same greedy
tokens when sessions arrive while others are decoding."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from appliance.engine.llm.runner import ModelRunner  # noqa: E402
from appliance.engine.llm.scheduler import Scheduler  # noqa: E402
from appliance.engine.llm.sequence import Sequence  # noqa: E402
from appliance.engine.llm.slots import SlotManager  # noqa: E402
from appliance.engine.llm.token_turns import TokenTurns, run_to_end  # noqa: E402
from models.llama import KVCache, LlamaModel  # noqa: E402
from loader.weights import load_weights  # noqa: E402
from tiny_llm import make_model_dir  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("mixed")
    make_model_dir(d, seed=4)
    w = load_weights(d, torch.float32)
    return LlamaModel(w.config, w.tensors)


def test_mixed_step_equals_prefill_and_decode_apart(model):
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    apart, mixed = (KVCache(model.config, 6, 64, torch.float32) for _ in range(2))
    history = torch.randint(3, vocab, (2, 9), generator=g)  # slots 4 and 5 already hold 9 tokens
    for cache in (apart, mixed):
        model.forward(cache, history, torch.tensor([4, 5]), torch.zeros(2, dtype=torch.long), torch.tensor([9, 9]))
    prefill = (torch.randint(3, vocab, (3, 7), generator=g), torch.tensor([0, 2, 1]), torch.tensor([0, 0, 4]),
               torch.tensor([7, 3, 5]))  # ragged rows, one continuing at position 4
    decode = (torch.randint(3, vocab, (2,), generator=g), torch.tensor([4, 5]), torch.tensor([9, 9]))
    p_ref = model.forward(apart, *prefill)
    d_ref = model.forward(apart, decode[0].view(-1, 1), decode[1], decode[2], torch.ones(2, dtype=torch.long))
    p_out, d_out = model.forward_mixed(mixed, prefill, decode)
    assert torch.allclose(p_out, p_ref, atol=1e-5) and torch.allclose(d_out, d_ref, atol=1e-5)
    real = [slice(0, 64)]  # every real cell (the scratch cell holds padding)
    assert torch.allclose(mixed.kv[..., real[0], :], apart.kv[..., real[0], :], atol=1e-6)


def test_sessions_arriving_while_others_decode_get_their_tokens_alone(model):
    """Each step of this run mixes a new session's prefill with the others' decode rows."""
    g = torch.Generator().manual_seed(7)
    prompts = {str(i): [1] + torch.randint(3, model.config.vocab_size, (4 + 5 * i,), generator=g).tolist()
               for i in range(6)}

    def run(which: list[int], staggered: bool) -> dict[int, list[int]]:
        cache = KVCache(model.config, len(which), 96, torch.float32)
        sched = Scheduler(SlotManager(len(which), 96), TokenTurns(prompts), prefill_chunk=64, max_prefill_tokens=512)
        runner = ModelRunner(model, cache)
        seqs = {i: Sequence(session_key=f"s{i}", prompt=str(i), max_tokens=8) for i in which}
        mixed_steps = 0
        if staggered:
            for i in which:  # one new session per step, while the earlier ones decode
                sched.add(seqs[i])
                plan = sched.schedule()
                mixed_steps += bool(plan.prefill and plan.decode)
                sched.commit(plan, runner.run(plan))
            assert mixed_steps >= len(which) - 2
        else:
            for s in seqs.values():
                sched.add(s)
        run_to_end(sched, runner)
        return {i: s.generated for i, s in seqs.items()}

    alone = {}
    for i in range(6):
        alone.update(run([i], staggered=False))
    assert run(list(range(6)), staggered=True) == alone
