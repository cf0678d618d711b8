"""A tiny random Llama saved as an HF directory (config.json, model.safetensors, a byte-level BPE tokenizer.json
trained here, a ChatML template): the test suite's generative model, built offline in about a second."""
from __future__ import annotations

import json

import torch
import transformers

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CORPUS = ["The pump runs at nominal speed.", "Valve 3 is open and the tank level is rising.",
          "Temperature of reactor two is stable.", "Alarm: pressure high in line four.",
          "What is a centrifugal pump? It moves fluid by rotation."] * 20
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
FAR = 1e9  # a deadline that never passes


def _tokenizer(directory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    return tok


def _hf_model(vocab: int, eos: int, seed: int, max_positions: int = 512):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                                   eos_token_id=eos, bos_token_id=None, pad_token_id=0,
                                   tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).eval()


def make_model_dir(directory, seed: int = 0, scripted: list[int] | None = None, endless: bool = False,
                   max_positions: int = 512):
    """A random tiny Llama; with `scripted`, weights that make it reply exactly those token ids, then <|im_end|>
    (attention and MLP outputs zeroed, so the next token is a function of the current one only); with `endless`,
    the scripted ids over and over, never <|im_end|> (a reply that runs until MaxTokens)."""
    directory.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(directory)
    vocab, eos = tok.get_vocab_size(), tok.token_to_id("<|im_end|>")
    model = _hf_model(vocab, eos, seed, max_positions)
    if scripted:
        with torch.no_grad():
            chain = [*scripted, scripted[0] if endless else eos]
            cls = torch.zeros(vocab, dtype=torch.long)  # class 0: any token not in the chain -> chain[0]
            for i, t in enumerate(scripted):
                cls[t] = i + 1  # token chain[i] -> chain[i+1]
            model.model.embed_tokens.weight.copy_(torch.nn.functional.one_hot(cls, 64).float())
            model.lm_head.weight.zero_()
            for c, nxt in enumerate(chain):
                model.lm_head.weight[nxt, c] = 10.0
            model.model.norm.weight.fill_(1.0)
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(str(directory))
    return tok
