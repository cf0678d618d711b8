"""Decode graphs per batch bucket: bucket choice and padding (CPU, eager); capture itself needs a GPU (bench/)."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.cuda_graphs import DecodeGraphs, InputSpec, batch_buckets, bucket_for

ROOT = Path(__file__).resolve().parents[1]


def test_buckets_are_powers_of_two_then_the_maximum():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(12) == [1, 2, 4, 8, 12]
    assert [bucket_for(n, batch_buckets(12)) for n in (1, 2, 3, 5, 8, 9, 12)] == [1, 2, 4, 8, 8, 12, 12]
    with pytest.raises(ValueError, match="larger than the largest captured bucket \\(12\\)"):
        bucket_for(13, batch_buckets(12))
    with pytest.raises(ValueError):
        batch_buckets(0)


def test_rows_are_padded_into_the_bucket_and_sliced_back():
    seen = []

    def step(token_ids, positions):
        seen.append((token_ids.clone(), positions.clone()))
        return token_ids.float().unsqueeze(1) * 10 + positions.float().unsqueeze(1)

    specs = {"token_ids": InputSpec((), torch.long, 0), "positions": InputSpec((), torch.long, 99)}
    graphs = DecodeGraphs(step, specs, max_batch=8, device="cpu")
    assert not graphs.use_graphs  # CPU: eager over the same static buffers
    out = graphs.run(token_ids=torch.tensor([3, 4, 5]), positions=torch.tensor([0, 1, 2]))
    assert out.tolist() == [[30.0], [41.0], [52.0]]
    tokens, positions = seen[-1]
    assert tokens.tolist() == [3, 4, 5, 0] and positions.tolist() == [0, 1, 2, 99]  # bucket 4, pad rows
    graphs.run(token_ids=torch.tensor([7]), positions=torch.tensor([5]))
    assert seen[-1][0].tolist() == [7]
    graphs.run(token_ids=torch.arange(6), positions=torch.arange(6))
    assert seen[-1][1].tolist() == [0, 1, 2, 3, 4, 5, 99, 99]  # stale rows of an earlier call are re-padded


def test_bad_inputs_are_named():
    graphs = DecodeGraphs(lambda x, y: x, {"x": InputSpec((), torch.long, 0), "y": InputSpec((2,), torch.float32, 0)},
                          max_batch=2, device="cpu")
    with pytest.raises(ValueError, match="expected inputs"):
        graphs.run(x=torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="input y has 2 rows"):
        graphs.run(x=torch.zeros(1, dtype=torch.long), y=torch.zeros(2, 2))
    with pytest.raises(ValueError, match="largest"):
        graphs.run(x=torch.zeros(3, dtype=torch.long), y=torch.zeros(3, 2))


def test_kernel_decode_step_through_the_graph_runner_matches_direct_calls(tmp_path):
    """The model's decode step through the fused kernels behind DecodeGraphs (eager on CPU, Triton interpreter):
    same logits as calling it directly, and pad rows write only the scratch cell."""
    from models.llama import KVCache, LlamaModel
    from loader.weights import load_weights
    from tiny_llm import make_model_dir
    make_model_dir(tmp_path, seed=1)
    w = load_weights(tmp_path, torch.float32)
    model = LlamaModel(w.config, w.tensors, kernels="triton")
    max_seq = 16
    cache_graph, cache_direct = KVCache(w.config, 3, max_seq, torch.float32), KVCache(w.config, 3, max_seq, torch.float32)
    graphs = model.decode_graphs(cache_graph)
    assert graphs.buckets == [1, 2, 3]
    cache_graph.kv.zero_()  # capture-time runs of the pad rows touched only scratch cells; start clean
    for step in range(2):
        args = dict(token_ids=torch.tensor([5 + step, 9, 11]), slot_ids=torch.tensor([2, 0, 1]),
                    positions=torch.tensor([step] * 3))
        got = graphs.run(**args, lengths=args["positions"] + 1)
        want = model.decode_kernels(cache_direct, args["token_ids"], args["slot_ids"], args["positions"])
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(cache_graph.kv[..., :max_seq, :], cache_direct.kv[..., :max_seq, :])
    two = graphs.run(token_ids=torch.tensor([1, 2]), slot_ids=torch.tensor([0, 1]), positions=torch.tensor([2, 2]),
                     lengths=torch.tensor([3, 3]))  # bucket 2: no pad rows
    assert two.shape == (2, w.config.vocab_size)


def test_import_does_not_initialise_cuda():
    code = "import torch, models.cuda_graphs, models.llama; print(torch.cuda.is_initialized())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
