"""A tiny Llama decoded only through the kernel ops (Triton interpreter) gives HF transformers' greedy tokens."""
import pytest
import torch

from kernels.reference_forward import KernelLlama, greedy
from tiny_llm import make_model_dir

PROMPTS = [[5, 17, 42, 99, 7, 250], [11, 3, 200]]
NEW = 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    make_model_dir(directory, seed=3)
    return directory


def hf_greedy(model_dir, prompt):
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                      pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_triton_path_gives_hf_greedy_tokens_for_ragged_rows(model_dir):
    want = [hf_greedy(model_dir, p) for p in PROMPTS]
    model = KernelLlama.from_hf_dir(model_dir, backend="triton")
    got = greedy(model, PROMPTS, NEW, slots=[2, 0])  # slots out of order, a free slot in between
    assert got == want


def test_kernel_logits_match_twin_logits_step_by_step(model_dir):
    kernel = KernelLlama.from_hf_dir(model_dir, backend="triton")
    twin = KernelLlama.from_hf_dir(model_dir, backend="torch")
    kv_k, kv_t = kernel.new_cache(2, 32), twin.new_cache(2, 32)
    for step, token in enumerate([5, 17, 42]):
        args = (torch.tensor([token, token + 1]), torch.tensor([1, 0]), torch.tensor([step, step]))
        torch.testing.assert_close(kernel.decode_step(kv_k, *args), twin.decode_step(kv_t, *args),
                                   rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv_k, kv_t, rtol=1e-5, atol=1e-5)


def test_int8_weights_keep_the_greedy_tokens_of_their_twin(model_dir):
    kernel = KernelLlama.from_hf_dir(model_dir, backend="triton", quant_bits=8)
    twin = KernelLlama.from_hf_dir(model_dir, backend="torch", quant_bits=8)
    assert greedy(kernel, PROMPTS[:1], 3) == greedy(twin, PROMPTS[:1], 3)
