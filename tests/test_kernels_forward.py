"""The one forward (models/forward.py) through the fused Triton kernels (the interpreter on this CPU): a tiny Llama
decoded token by token gives HF transformers' greedy tokens, the same logits and cache as torch's ops step by step,
and with weights kept quantized (int8 rows, int4 groups) the Triton matmul gives the CPU path's tokens."""
import pytest
import torch

from models.llama import KVCache, LlamaModel
from loader.weights import load_weights
from hf_oracle import hf_greedy
from tiny_llm import make_model_dir

PROMPTS = [[5, 17, 42, 99, 7, 250], [11, 3, 200]]
NEW = 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    make_model_dir(directory, seed=3)
    return directory


def greedy_one_token_per_step(model: LlamaModel, prompts, new_tokens: int, slots: list[int],
                              max_seq_len: int = 128) -> list[list[int]]:
    """Prompts fed one token per step (prefill as decode), so rows of different lengths share every step; every
    step is a decode step, which is where the kernels run."""
    cache = KVCache(model.config, max(slots) + 1, max_seq_len, model.dtype)
    seqs = [list(p) for p in prompts]
    produced: list[list[int]] = [[] for _ in prompts]
    step = 0
    while any(len(p) < new_tokens for p in produced):
        rows = [r for r in range(len(prompts)) if len(produced[r]) < new_tokens]
        tokens = torch.tensor([[seqs[r][step]] for r in rows])
        logits = model.forward(cache, tokens, torch.tensor([slots[r] for r in rows]),
                               torch.full((len(rows),), step), torch.ones(len(rows), dtype=torch.long))
        for i, r in enumerate(rows):
            if step == len(seqs[r]) - 1:  # this row fed its last known token: its prediction is new
                seqs[r].append(int(logits[i].argmax()))
                produced[r].append(seqs[r][-1])
        step += 1
    return produced


def test_triton_path_gives_hf_greedy_tokens_for_ragged_rows(model_dir):
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    want = [hf_greedy(hf, [p], NEW, stop_at_eos=False)[0] for p in PROMPTS]
    w = load_weights(model_dir, torch.float32)
    model = LlamaModel(w.config, w.tensors, kernels="triton")
    assert model.use_kernels()
    assert greedy_one_token_per_step(model, PROMPTS, NEW, slots=[2, 0]) == want  # slots out of order, one free


def test_kernel_logits_match_torch_ops_step_by_step(model_dir):
    w = load_weights(model_dir, torch.float32)
    kernel, twin = (LlamaModel(w.config, w.tensors, kernels=k) for k in ("triton", "torch"))
    caches = [KVCache(w.config, 2, 32, torch.float32) for _ in range(2)]
    for step, token in enumerate([5, 17, 42]):
        args = (torch.tensor([[token], [token + 1]]), torch.tensor([1, 0]), torch.tensor([step, step]),
                torch.ones(2, dtype=torch.long))
        torch.testing.assert_close(kernel.forward(caches[0], *args), twin.forward(caches[1], *args),
                                   rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(caches[0].kv[..., :32, :], caches[1].kv[..., :32, :], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_weights_through_the_triton_matmul_keep_the_cpu_path_tokens(model_dir, fmt):
    """One weight type per format: the same quant.Int8Rows / Int4Groups numbers multiplied by the Triton kernel
    (kernels/dequant_matmul.py) and by torch's CPU ops give the same greedy tokens."""
    from models.gpu_linear import TritonQuantLinear
    w = load_weights(model_dir, torch.float32, fmt)
    triton_model = LlamaModel(w.config, w.tensors, kernels="triton")
    cpu_model = LlamaModel(w.config, w.tensors, kernels="torch")
    assert isinstance(triton_model.layers[0].gate_up, TritonQuantLinear)
    assert not isinstance(cpu_model.layers[0].gate_up, TritonQuantLinear)
    got = greedy_one_token_per_step(triton_model, PROMPTS[:1], 3, slots=[0])
    assert got == greedy_one_token_per_step(cpu_model, PROMPTS[:1], 3, slots=[0])
