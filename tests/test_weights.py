"""load_weights on HF safetensors directories written by transformers itself."""
from __future__ import annotations

import json
import sys
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from loader.weights import expected_shapes, load_weights
from models.llama_config import LlamaConfig

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_tokenizer(directory: Path, template: str | None = CHATML) -> int:
    """A byte-level BPE trained here (well under a second) + tokenizer_config.json; returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the pump moves water through the pipe", "valve open, valve closed"] * 50, trainer)
    tok.save(str(directory / "tokenizer.json"))
    cfg = {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>", "special": True}}
    if template is not None:
        cfg["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tok.get_vocab_size()


def save_tiny_llama(directory: Path, tied: bool, shard: str | None = None, **overrides):
    """A random transformers LlamaForCausalLM saved with save_pretrained (safetensors); returns its state dict."""
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(directory)
    hf_config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                         rms_norm_eps=1e-6, tie_word_embeddings=tied, bos_token_id=1,
                                         eos_token_id=2, **overrides)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():  # norms are ones at init: make them say something
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(directory, **kwargs)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, hf_config


@pytest.fixture(scope="module")
def tiny_untied(tmp_path_factory):
    directory = tmp_path_factory.mktemp("untied")
    state, hf_config = save_tiny_llama(directory, tied=False, rope_parameters={"rope_type": "default",
                                                                                "rope_theta": 12345.0})
    return directory, state, hf_config


def test_tensors_equal_hf_state_dict(tiny_untied):
    directory, state, _ = tiny_untied
    lw = load_weights(directory)
    assert lw.source_format == "safetensors"
    assert set(lw.tensors) == set(state)  # lm_head included: not tied
    for name, tensor in state.items():
        assert lw.tensors[name].dtype == torch.float32
        assert torch.equal(lw.tensors[name], tensor), name


def test_config_fields(tiny_untied):
    directory, _, hf_config = tiny_untied
    c = load_weights(directory).config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (hf_config.vocab_size, 64, 96, 2)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 16)
    assert c.rope_theta == 12345.0  # transformers 5 writes rope_parameters
    assert "rope_parameters" in json.loads((directory / "config.json").read_text())
    assert c.rms_norm_eps == 1e-6 and c.max_position_embeddings == 256 and not c.tie_word_embeddings
    assert c.bos_token_id == 1 and 2 in c.eos_token_ids


def test_legacy_rope_theta_form(tmp_path, tiny_untied):
    directory, _, _ = tiny_untied
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    for f in directory.iterdir():
        (legacy / f.name).symlink_to(f)
    cfg = json.loads((directory / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = 500000.0
    (legacy / "config.json").unlink()
    (legacy / "config.json").write_text(json.dumps(cfg))
    assert load_weights(legacy).config.rope_theta == 500000.0


def test_tied_embeddings_have_no_lm_head(tmp_path):
    state, _ = save_tiny_llama(tmp_path / "tied", tied=True)
    lw = load_weights(tmp_path / "tied")
    assert lw.config.tie_word_embeddings and "lm_head.weight" not in lw.tensors
    assert set(lw.tensors) == set(state) - {"lm_head.weight"}
    assert torch.equal(lw.tensors["model.embed_tokens.weight"], state["model.embed_tokens.weight"])


def test_sharded_checkpoint(tmp_path):
    state, _ = save_tiny_llama(tmp_path / "sharded", tied=False, shard="50KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    lw = load_weights(tmp_path / "sharded")
    assert set(lw.tensors) == set(state)
    assert all(torch.equal(lw.tensors[k], v) for k, v in state.items())


def test_bf16_is_one_cast(tiny_untied):
    directory, state, _ = tiny_untied
    lw = load_weights(directory, torch.bfloat16)
    for name, tensor in state.items():
        assert lw.tensors[name].dtype == torch.bfloat16
        assert torch.equal(lw.tensors[name], tensor.to(torch.bfloat16)), name


def test_tokenizer_and_eos_from_the_directory(tmp_path, tiny_untied):
    directory, _, _ = tiny_untied
    gen = json.loads((directory / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, 0]
    d = tmp_path / "gen"
    d.mkdir()
    for f in directory.iterdir():
        if f.name != "generation_config.json":
            (d / f.name).symlink_to(f)
    (d / "generation_config.json").write_text(json.dumps(gen))
    lw = load_weights(d)
    tok = lw.tokenizer
    assert tok.eos_token_ids == {0, 2} and lw.config.eos_token_ids == [0, 2]
    assert tok.bos_token_id == 1 and tok.vocab_size == lw.config.vocab_size
    assert tok.decode(tok.encode("the pump moves water")) == "the pump moves water"
    assert tok.render([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def rss_anon_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon")


def test_matching_dtype_maps_the_file_without_a_copy(tmp_path):
    """~100 MB of fp32 weights: loading and reading every tensor adds almost no private (anonymous) memory, the
    pages are the file's; asking for bf16 adds the cast copy (half the size), which shows the measure works."""
    config = LlamaConfig(vocab_size=8192, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True)
    d = tmp_path / "big"
    d.mkdir()
    write_tokenizer(d)
    (d / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 8192, "hidden_size": 1024, "intermediate_size": 2048,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "tie_word_embeddings": True}))
    gen = torch.Generator().manual_seed(0)
    save_file({n: torch.randn(s, generator=gen) for n, s in expected_shapes(config).items()}, d / "model.safetensors")
    size_mib = (d / "model.safetensors").stat().st_size / 2**20
    assert size_mib > 90
    # Measured in a fresh process: in a long test run the allocator reuses memory freed by earlier tests, which
    # would hide the bf16 copy that shows the measure works.
    child = f"""
import gc, sys, torch
sys.path.insert(0, {str(Path(__file__).parent)!r}); sys.path.insert(0, {str(Path(__file__).parent.parent)!r})
from test_weights import rss_anon_mib
from loader.weights import load_weights
from pathlib import Path
d = Path({str(d)!r})
before = rss_anon_mib()
lw = load_weights(d)
total = sum(float(t.sum()) for t in lw.tensors.values())  # touch every page
grown = rss_anon_mib() - before
del lw
gc.collect()
before = rss_anon_mib()
lw16 = load_weights(d, torch.bfloat16)
print(grown, rss_anon_mib() - before, total == total)
"""
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    grown, grown16, finite = out.stdout.split()
    grown, grown16 = float(grown), float(grown16)
    assert finite == "True" and grown < 0.1 * size_mib, (grown, size_mib)
    assert 0.4 * size_mib < grown16 < 0.75 * size_mib, (grown16, size_mib)


def test_version_is_the_content_digest_computed_once_per_file_stamp(tmp_path, tiny_untied, monkeypatch):
    """The version (and every cache key) is the files' full sha256: an edit anywhere in a file changes it. It is
    computed once and remembered beside the caches while the file's size, mtime and inode agree."""
    import hashlib
    import os

    from loader import file_digest
    directory, _, _ = tiny_untied
    v = load_weights(directory).version
    assert len(v) == 12 and all(ch in "0123456789abcdef" for ch in v)
    assert load_weights(directory).version == v

    big = tmp_path / "w.bin"
    data = bytearray(3 << 20)
    big.write_bytes(data)
    memo = tmp_path / "memo"
    assert file_digest.file_digest(big, memo) == hashlib.sha256(data).hexdigest()
    hashed = []
    real = file_digest.file_sha256
    monkeypatch.setattr(file_digest, "file_sha256", lambda p: hashed.append(p) or real(p))
    assert file_digest.file_digest(big, memo) == hashlib.sha256(data).hexdigest() and hashed == []  # remembered
    data[(3 << 20) // 2] = 1  # a byte in the middle
    big.write_bytes(data)
    os.utime(big, ns=(1_000_000_000, 1_000_000_000))  # a new stamp
    assert file_digest.file_digest(big, memo) == hashlib.sha256(data).hexdigest() and len(hashed) == 1
    replaced = tmp_path / "w2.bin"
    replaced.write_bytes(data)
    os.replace(replaced, big)  # another file (inode) at the same path, same bytes: hashed again
    assert file_digest.file_digest(big, memo) == hashlib.sha256(data).hexdigest() and len(hashed) == 2


def test_bad_directories_are_refused(tmp_path, tiny_untied):
    directory, _, _ = tiny_untied
    with pytest.raises(ValueError):
        load_weights(tmp_path / "missing")
    d = tmp_path / "notllama"
    d.mkdir()
    for f in directory.iterdir():
        if f.name != "config.json":
            (d / f.name).symlink_to(f)
    cfg = json.loads((directory / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type"):
        load_weights(d)
    (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))  # a layer the file lacks
    with pytest.raises(ValueError, match="missing"):
        load_weights(d)
    (d / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 128}))
    with pytest.raises(ValueError, match="shape"):
        load_weights(d)
