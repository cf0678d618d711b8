"""The architectures people try, against transformers (the oracle): llama, Llama 3.x rope scaling, qwen2 (q/k/v
biases), qwen3 (per-head q/k RMSNorm, its own head_dim) and phi3 (fused qkv and gate/up, longrope), each a tiny
random model written as GGUF the way llama.cpp's converter writes it (tests/arch_models.py) and saved as an HF
safetensors directory; their tokenizers (byte-level BPE with Qwen's split, SentencePiece for Phi-3) against
transformers' own GGUF tokenizers; chat templates that do not simply append (Phi-3 ends a finished conversation with
its eos, Qwen3 drops the reasoning of earlier replies); and a Phi-3 GGUF served end to end.

Tolerance: fp32 logits within 1e-4 max abs (measured ~3e-7); greedy tokens identical.
"""
from __future__ import annotations

import asyncio
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from arch_models import (PHI3_ORIGINAL, VARIANTS, architecture, byte_level_vocab, hf_model,  # noqa: E402
                         sentencepiece_vocab, write_gguf)
from appliance.engine.llm.runner import ModelRunner  # noqa: E402
from hf_oracle import hf_greedy  # noqa: E402
from appliance.engine.llm.scheduler import Scheduler  # noqa: E402
from appliance.engine.llm.sequence import Sequence  # noqa: E402
from appliance.engine.llm.slots import SlotManager  # noqa: E402
from appliance.engine.llm.token_turns import TokenTurns, run_to_end  # noqa: E402
from models.llama import KVCache, LlamaModel  # noqa: E402
from models.llama_config import LlamaConfig  # noqa: E402
from models.rope import angle_tables  # noqa: E402
from loader.weights import load_weights  # noqa: E402

LOGIT_TOLERANCE = 1e-4
PAD = 0


def vocab_for(variant: str) -> dict:
    if variant.startswith("phi3"):
        return sentencepiece_vocab()
    return byte_level_vocab("qwen2" if variant.startswith("qwen") else "llama-bpe")


@pytest.fixture(scope="module", autouse=True)
def fresh_compiler():
    """This module compiles decode steps of models unlike the rest of the suite's: Dynamo counts recompilations
    of the one compiled function per process (8 at most), so later modules start from a clean slate."""
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """variant -> (HF model, path of its GGUF), built once per module."""
    out = {}
    for variant in VARIANTS:
        vocab = vocab_for(variant)
        hf = hf_model(variant, len(vocab["tokens"]), tied=variant == "qwen2")  # Qwen2.5's small models tie
        path = tmp_path_factory.mktemp(variant) / f"{variant}.gguf"
        write_gguf(path, hf, vocab)
        out[variant] = (hf, path)
    return out


def prompt(length: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(3, vocab, (length - 1,), generator=g).tolist()


def engine_greedy(model: LlamaModel, prompts: list[list[int]], new_tokens: int, compiled=None,
                  cache: KVCache | None = None) -> list[list[int]]:
    """Our scheduler and runner: chunked prefill interleaved with decode, several sequences in their slots."""
    cache = cache or KVCache(model.config, len(prompts), 96, torch.float32)
    turns = TokenTurns({str(i): p for i, p in enumerate(prompts)})
    sched = Scheduler(SlotManager(cache.n_slots, cache.max_seq_len), turns, prefill_chunk=4, max_prefill_tokens=8)
    seqs = [Sequence(session_key=f"s{i}", prompt=str(i), max_tokens=new_tokens) for i in range(len(prompts))]
    for s in seqs:
        sched.add(s)
    run_to_end(sched, ModelRunner(model, cache, compiled=compiled))
    return [s.generated for s in seqs]


# ---- the forward of each architecture, from GGUF ------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_gguf_model_gives_transformers_logits_and_greedy_tokens(written, variant):
    hf, path = written[variant]
    w = load_weights(path, torch.float32)
    assert w.config.architecture == architecture(variant)
    model = LlamaModel(w.config, w.tensors)
    vocab = w.config.vocab_size
    lengths = [9, 3, 17]
    prompts = [prompt(n, seed=n, vocab=vocab) for n in lengths]
    ids = torch.zeros(3, max(lengths), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
    cache = KVCache(w.config, 4, 64, torch.float32)
    logits = model.forward(cache, ids, torch.tensor([3, 0, 2]), torch.zeros(3, dtype=torch.long),
                           torch.tensor(lengths), all_logits=True)  # slots out of order: the gather path
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0]
        err = (logits[i, :len(p)] - ref).abs().max().item()
        assert err < LOGIT_TOLERANCE, (variant, err)
    assert engine_greedy(model, prompts, 10) == hf_greedy(hf, prompts, 10, PAD)


@pytest.mark.parametrize("variant", VARIANTS)
def test_hf_directory_model_gives_transformers_logits(tmp_path, variant):
    from tiny_llm import _tokenizer
    tok = _tokenizer(tmp_path)  # tokenizer.json + tokenizer_config.json, as load_weights wants a directory
    hf = hf_model(variant, tok.get_vocab_size(), seed=5, tied=variant == "qwen2")
    hf.save_pretrained(str(tmp_path))
    w = load_weights(tmp_path, torch.float32)
    assert w.source_format == "safetensors" and w.config.architecture == architecture(variant)
    model = LlamaModel(w.config, w.tensors)
    p = prompt(21, seed=2, vocab=w.config.vocab_size)
    out = model.forward(KVCache(w.config, 1, 64, torch.float32), torch.tensor([p]), torch.tensor([0]),
                        torch.tensor([0]), torch.tensor([len(p)]), all_logits=True)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([p])).logits[0]
    assert (out - ref).abs().max().item() < LOGIT_TOLERANCE


def test_unsupported_hf_options_are_refused_by_name():
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        LlamaConfig.from_hf_dict({**base, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="use_sliding_window"):
        LlamaConfig.from_hf_dict({**base, "model_type": "qwen2", "use_sliding_window": True})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        LlamaConfig.from_hf_dict({**base, "model_type": "phi3", "partial_rotary_factor": 0.75})
    with pytest.raises(ValueError, match="rope scaling 'yarn'"):
        LlamaConfig.from_hf_dict({**base, "model_type": "llama", "rope_scaling": {"rope_type": "yarn",
                                                                                    "factor": 4.0}})


# ---- rotary scaling ------------------------------------------------------------------------------------------------
def hf_tables(hf, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own cos/sin (positions, head_dim), attention factor included."""
    x = torch.zeros(1, positions, 4)
    with torch.no_grad():
        cos, sin = hf.model.rotary_emb(x, torch.arange(positions).view(1, -1))
    return cos[0], sin[0]


@pytest.mark.parametrize("variant", ["llama3", "phi3-longrope"])
def test_scaled_rotary_tables_equal_transformers_from_gguf_and_directory(written, tmp_path, variant):
    hf, path = written[variant]
    hf.save_pretrained(str(tmp_path))
    configs = {"gguf": load_weights(path).config,
               "directory": LlamaConfig.from_hf_dict(json.loads((tmp_path / "config.json").read_text()))}
    want_cos, want_sin = hf_tables(hf, 200)
    plain = LlamaConfig(**{**configs["gguf"].__dict__, "rope_scaling": None})
    for source, cfg in configs.items():
        cos, sin = angle_tables(cfg, 200, context=200)
        torch.testing.assert_close(torch.cat([cos, cos], -1), want_cos, rtol=1e-5, atol=1e-6, msg=source)
        torch.testing.assert_close(torch.cat([sin, sin], -1), want_sin, rtol=1e-5, atol=1e-6, msg=source)
    unscaled, _ = angle_tables(plain, 200, context=200)
    assert (torch.cat([unscaled, unscaled], -1) - want_cos).abs().max() > 1e-2  # the scaling matters here


def test_longrope_takes_the_long_factors_for_a_context_past_the_original(written):
    """transformers switches to the long factors once a sequence passes the original context; a cache that long
    uses them from its first position (llama.cpp's rule: by context size)."""
    hf, path = written["phi3-longrope"]
    cfg = load_weights(path).config
    long_cos, _ = hf_tables(hf, PHI3_ORIGINAL + 50)  # a sequence past the original length: long factors
    cos, _ = angle_tables(cfg, PHI3_ORIGINAL + 50, context=PHI3_ORIGINAL + 50)
    torch.testing.assert_close(torch.cat([cos, cos], -1), long_cos, rtol=1e-5, atol=1e-6)
    short, _ = angle_tables(cfg, PHI3_ORIGINAL + 50, context=PHI3_ORIGINAL)
    assert (short - cos).abs().max() > 1e-2


# ---- the other decode paths run the same forward ------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_triton_kernels_give_the_eager_tokens(written, variant):
    """Decode steps through the fused kernels (Triton interpreter), padded CUDA-graph buckets included."""
    import triton  # noqa: F401 - a test dependency (pyproject [test]): missing, this fails instead of skipping
    _, path = written[variant]
    w = load_weights(path, torch.float32)
    prompts = [prompt(n, seed=n, vocab=w.config.vocab_size) for n in (5, 8, 3)]
    want = engine_greedy(LlamaModel(w.config, w.tensors, kernels="torch"), prompts, 6)
    model = LlamaModel(w.config, w.tensors, kernels="triton")
    cache = KVCache(w.config, 4, 96, torch.float32)
    turns = TokenTurns({str(i): p for i, p in enumerate(prompts)})
    sched = Scheduler(SlotManager(4, 96), turns, prefill_chunk=16)
    runner = ModelRunner(model, cache, graphs=True)  # on a CPU: the graph buckets' padded buffers, run eagerly
    seqs = [Sequence(session_key=f"s{i}", prompt=str(i), max_tokens=6) for i in range(len(prompts))]
    for s in seqs:
        sched.add(s)
    run_to_end(sched, runner)
    assert [s.generated for s in seqs] == want


def test_compiled_decode_gives_the_eager_tokens_for_qwen3(written, tmp_path):
    """The compiled step is the same forward traced: Qwen3's per-head norms and own head_dim go through it."""
    from loader.compiled_decode import CompiledDecode
    _, path = written["qwen3"]
    w = load_weights(path, torch.float32)
    model = LlamaModel(w.config, w.tensors)
    prompts = [prompt(n, seed=n, vocab=w.config.vocab_size) for n in (5, 11, 3)]
    want = engine_greedy(model, prompts, 8)
    cache = KVCache(w.config, 3, 96, torch.float32)
    compiled = CompiledDecode(model, cache, tmp_path / "inductor")
    compiled.compile()
    calls = [0]
    step = compiled.step

    def counting(*args):
        calls[0] += 1
        return step(*args)
    compiled.step = counting
    assert engine_greedy(model, prompts, 8, compiled=compiled, cache=cache) == want
    assert calls[0] >= 7


# ---- tokenizers ----------------------------------------------------------------------------------------------------
TEXTS = ["the pump moves water 12345 times", "  Temperature of reactor 2 is 73.5\n\nok", "Grüße, pumpe 3!",
         "<|im_start|>user\nWhat is a centrifugal pump?<|im_end|>\n", "<|user|>\nhi<|end|>\n<|assistant|>\n"]


def transformers_gguf_tokenizer(path):
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("variant", ["qwen2", "phi3"])
def test_gguf_tokenizer_equals_transformers(written, variant):
    """Qwen's byte-level BPE with its own split (digits one by one) and Phi-3's SentencePiece vocabulary (merges
    recovered from the scores, byte fallback), built offline with `tokenizers` alone."""
    _, path = written[variant]
    ours = load_weights(path).tokenizer
    theirs = transformers_gguf_tokenizer(path)
    for text in TEXTS:
        want = theirs.encode(text, add_special_tokens=False)
        assert ours.encode(text) == want, text
        assert ours.tokenizer.decode(want, skip_special_tokens=False) == theirs.decode(want), text
    if variant == "qwen2":
        assert len(ours.encode("12345")) == 5  # Qwen splits numbers into single digits


# ---- chat templates ------------------------------------------------------------------------------------------------
PHI3_STYLE = ("{% for m in messages %}{% if m['role'] == 'system' and m['content'] %}"
              "{{ '<|system|>\n' + m['content'] + '<|end|>\n' }}{% elif m['role'] == 'user' %}"
              "{{ '<|user|>\n' + m['content'] + '<|end|>\n' }}{% elif m['role'] == 'assistant' %}"
              "{{ '<|assistant|>\n' + m['content'] + '<|end|>\n' }}{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")
# Qwen3's construct: replies before the last user turn lose their reasoning; the last one shows an empty block.
QWEN3_STYLE = ("{%- set ns = namespace(last_user=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
               "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
               "{%- for m in messages %}{%- if m.role == 'assistant' %}"
               "{%- set content = m.content.split('</think>')[-1].lstrip('\n') %}"
               "{%- if loop.index0 > ns.last_user %}"
               "{{- '<|im_start|>assistant\n<think>\n\n</think>\n\n' + content + '<|im_end|>\n' }}"
               "{%- else %}{{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}{%- endif %}"
               "{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}"
               "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")


def tokenizer_with_template(written, variant, template, tmp_path):
    hf, _ = written[variant]
    path = tmp_path / f"{variant}-chat.gguf"
    write_gguf(path, hf, vocab_for(variant), chat_template=template)
    return load_weights(path).tokenizer, path


def test_phi3_template_ending_a_conversation_with_eos_continues_turn_by_turn(written, tmp_path):
    """Phi-3 writes <|endoftext|> after a finished conversation and <|end|> after every reply: the slot gets
    "<|end|>\\n" after a reply, the next turn follows it, and <|end|> stops a reply."""
    from appliance.engine.llm.chat_turns import ChatTurns
    tok, _ = tokenizer_with_template(written, "phi3", PHI3_STYLE, tmp_path)
    end = tok.encode("<|end|>")
    assert len(end) == 1 and tok.assistant_suffix_tokens()[:1] == end
    assert tok.decode(tok.assistant_suffix_tokens()) == "\n"
    assert set(end) <= ChatTurns(tok, None, 1000, 512).eos_ids and tok.eos_token_ids == set(tok.encode("<|endoftext|>"))
    history, slot = [], []
    suffix, eos = tok.assistant_suffix_tokens(), tok.encode("<|endoftext|>")
    for user_text, reply in [("What is a pump?", "It moves water."), ("And a valve?", "It opens.")]:
        slot += tok.turn_tokens(history, user_text, None)
        history.append({"role": "user", "content": user_text})
        assert slot == tok.encode(tok.render(history, add_generation_prompt=True))
        history.append({"role": "assistant", "content": reply})
        done = tok.encode(tok.render(history, add_generation_prompt=False))
        generated = done[len(slot):len(done) - len(suffix) - len(eos)]  # the reply as the model would write it
        slot += generated + suffix  # what the engine holds after the reply
        assert slot + eos == done


def test_qwen3_template_that_rewrites_earlier_replies_continues_turn_by_turn(written, tmp_path):
    """The slot keeps a reply as it was generated (its reasoning included); the next turn is what the template
    writes after a reply, and the user's text stays plain text."""
    tok, _ = tokenizer_with_template(written, "qwen3", QWEN3_STYLE, tmp_path)
    first = tok.turn_tokens([], "What is a pump?", None)
    assert tok.tokenizer.decode(first, skip_special_tokens=False) == \
        "<|im_start|>user\nWhat is a pump?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.assistant_suffix_tokens() == tok.encode("<|im_end|>\n")
    history = [{"role": "user", "content": "What is a pump?"},
               {"role": "assistant", "content": "<think>\nwater\n</think>\n\nIt moves water."}]
    ids, head = tok.turn_tokens_and_head(history, "And <|im_end|> a valve?", None)
    assert tok.tokenizer.decode(ids, skip_special_tokens=False) == \
        "<|im_start|>user\nAnd <|im_end|> a valve?<|im_end|>\n<|im_start|>assistant\n"
    assert ids.count(tok.encode("<|im_end|>")[0]) == 1  # the typed one is plain text
    assert head == len(tok.encode("<|im_start|>user\n"))


def test_phi3_gguf_served_end_to_end_gives_transformers_reply(written, tmp_path):
    """The GGUF through the service (loader, SentencePiece tokenizer, its chat template, scheduler, runner): two
    turns of one session; the first reply is transformers' greedy continuation of the same prompt tokens."""
    from appliance.engine.llm.service import GenerativeModelService
    from appliance.engine.llm.settings import GenerativeSettings
    hf, _ = written["phi3"]
    tok, path = tokenizer_with_template(written, "phi3", PHI3_STYLE, tmp_path)
    stops = tok.eos_token_ids | tok.end_of_turn_ids()

    async def serve() -> list:
        svc = GenerativeModelService("phi", path, GenerativeSettings(kv_slots=2, max_seq_len=256, max_new_tokens=8,
                                                                     device="cpu"))
        await svc.start()
        assert svc.state == "Ready", svc.failure_reason
        try:
            return [await svc.generate("s", text, 8, 0.0, float("inf")) for text in ("What is a pump?", "Why?")]
        finally:
            await svc.stop()

    first, second = asyncio.run(serve())
    ids = tok.turn_tokens([], "What is a pump?", None)
    want = hf_greedy(hf, [ids], 8, PAD)[0]
    cut = next((i for i, t in enumerate(want) if t in stops), len(want))
    assert first.text == tok.decode(want[:cut])
    assert second.token_count >= 1 and not second.context_lost


# ---- weights kept quantized -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["qwen2", "qwen3", "phi3"])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_weights_of_each_architecture_compute_with_their_own_numbers(written, variant, fmt):
    """Kept quantized (models/quant.py), biases, per-head norms and phi3's fused matrices included: the greedy
    tokens of a dense model holding the same numbers (dequantised)."""
    from models import quant
    _, path = written[variant]
    w = load_weights(path, torch.float32, fmt)
    fused = "model.layers.0.self_attn.qkv_proj.weight" if variant == "phi3" else "model.layers.0.mlp.up_proj.weight"
    assert isinstance(w.tensors[fused], quant.QuantizedMatrix)
    dense = {k: quant.dequantize(v) if isinstance(v, quant.QuantizedMatrix) else v.float()
             for k, v in w.tensors.items()}
    prompts = [prompt(n, seed=n, vocab=w.config.vocab_size) for n in (6, 13)]
    assert engine_greedy(LlamaModel(w.config, w.tensors), prompts, 8) == \
        engine_greedy(LlamaModel(w.config, dense), prompts, 8)


def test_matrices_of_different_formats_in_one_layer_multiply_apart(written, tmp_path):
    """q/k/v or gate/up kept in different formats (a Q4_K_M file mixes Q4_K and Q6_K in one layer) cannot be fused
    into one matrix: each multiplies on its own (RowStack), eagerly and in the compiled step, with the fused
    layer's numbers."""
    from models import quant
    from loader.compiled_decode import CompiledDecode
    from models.llama import RowStack
    _, path = written["qwen2"]
    w = load_weights(path, torch.float32)
    mixed = dict(w.tensors)
    for i in range(w.config.num_hidden_layers):
        p = f"model.layers.{i}."
        mixed[p + "self_attn.q_proj.weight"] = quant.quantize(w.tensors[p + "self_attn.q_proj.weight"], "int4")
        for name in ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                     "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
            mixed[p + name] = quant.quantize(w.tensors[p + name], "int8")
    model = LlamaModel(w.config, mixed)
    assert isinstance(model.layers[0].qkv, RowStack) and not isinstance(model.layers[0].gate_up, RowStack)
    # the same numbers, dense: a quantized model keeps its embeddings (and head) in bfloat16 (quant.HEAD_NAMES)
    dense = LlamaModel(w.config, {k: quant.dequantize(v) if isinstance(v, quant.QuantizedMatrix)
                                  else v.to(torch.bfloat16).float() if k in quant.HEAD_NAMES else v
                                  for k, v in mixed.items()})
    prompts = [prompt(n, seed=n, vocab=w.config.vocab_size) for n in (6, 13)]
    want = engine_greedy(dense, prompts, 8)
    assert engine_greedy(model, prompts, 8) == want
    cache = KVCache(w.config, 2, 96, torch.float32)
    compiled = CompiledDecode(model, cache, tmp_path / "inductor")
    compiled.compile()
    assert engine_greedy(model, prompts, 8, compiled=compiled, cache=cache) == want
