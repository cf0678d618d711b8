"""A GGUF file's vocabulary (`tokenizer.ggml.*`) as a `tokenizers` Tokenizer: byte-level BPE ("gpt2": Llama 3,
SmolLM2, Qwen) or a SentencePiece vocabulary with scores ("llama": Llama 2, Phi-3), built as transformers builds them
from a GGUF (integrations/gguf), offline. models/tokenizer.py's ChatTokenizer.from_gguf_metadata calls these."""
from __future__ import annotations

from functools import lru_cache

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

GGUF_TOKEN_TYPE_CONTROL = 3
GGUF_TOKEN_TYPE_USER_DEFINED = 4

# llama.cpp's `tokenizer.ggml.pre` names whose split differs from GPT-2's regex (which ByteLevel applies itself).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_BY_GGUF_PRE = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
                      "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}

def build_byte_level_bpe(tokens: list[str], merges: list[tuple[str, str]], token_types: list[int],
                         pre: str | None = None) -> Tokenizer:
    """A GPT-2-style byte-level BPE `tokenizers.Tokenizer` from a GGUF vocabulary, as transformers builds it:
    CONTROL tokens become special added tokens, USER_DEFINED ones plain added tokens."""
    alphabet = _byte_alphabet()
    spelling = _bytes_to_unicode()
    # Tokens stored as raw text (outside the byte alphabet) are respelled in it, as transformers does.
    vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False))
    split = _SPLIT_BY_GGUF_PRE.get(pre or "")
    if split:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # A "control" token spelled outside the byte alphabet is a llama.cpp mislabel: skip it (transformers does).
    special = [AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, token_types)
               if ty == GGUF_TOKEN_TYPE_CONTROL and set(t) <= alphabet]
    if special:
        tok.add_special_tokens(special)
    user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, token_types)
            if ty == GGUF_TOKEN_TYPE_USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens(user)
    return tok


def build_sentencepiece_bpe(tokens: list[str], scores: list[float], token_types: list[int],
                            merges: list[tuple[str, str]] | None, phi3: bool = False,
                            prefix_space: bool = True) -> Tokenizer:
    """A SentencePiece BPE vocabulary as GGUF stores it ("▁" for spaces, <0xXX> byte tokens, a score per token)
    as transformers builds it from a GGUF: BPE with byte fallback, merges recovered from the scores when the file
    has none, a "▁" prefix (Metaspace for Llama; for Phi-3 a normalizer, as transformers' phi3_tokenizer: the
    two differ only on text that starts with spaces), CONTROL tokens special, USER_DEFINED ones added."""
    vocab = {t: i for i, t in enumerate(tokens)}
    if merges is None:
        merges = _merges_from_scores(vocab, dict(zip(tokens, scores)))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    if phi3:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581",
                                                     prepend_scheme="first" if prefix_space else "never",
                                                     split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix_space or phi3 else []))
    special = [AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, token_types)
               if ty == GGUF_TOKEN_TYPE_CONTROL]
    if special:
        tok.add_special_tokens(special)
    user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, token_types)
            if ty == GGUF_TOKEN_TYPE_USER_DEFINED]
    if user:
        tok.add_tokens(user)
    return tok


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens of the vocabulary is a merge, ranked by the merged token's score
    (best first), ties by the pieces' lengths: transformers' generate_merges, which a GGUF's SentencePiece
    vocabulary (no merges stored) goes through."""
    merges = []
    for merged, score in scores.items():
        local = [(merged[:i], merged[i:], score) for i in range(1, len(merged))
                 if merged[:i] in vocab and merged[i:] in vocab]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@lru_cache(maxsize=1)
def _byte_alphabet() -> frozenset[str]:
    return frozenset(_bytes_to_unicode().values())
