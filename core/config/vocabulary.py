"""A generative model's vocabulary (the text of every token id) read from its file without loading it: what
check-config compares between a model and its draft model (`speculation: draft`). Torch-free: a GGUF file's
`tokenizer.ggml.tokens` through the gguf package's reader, an HF directory's tokenizer.json as JSON."""
from __future__ import annotations

import json
from pathlib import Path


def token_texts(path: Path) -> list[str]:
    """Token id -> text (ids no token has: ""). OSError / ValueError / KeyError when the file cannot say."""
    if path.is_dir():
        return _hf_tokens(path / "tokenizer.json")
    import gguf
    field = gguf.GGUFReader(path, "r").fields.get("tokenizer.ggml.tokens")
    if field is None:
        raise ValueError("the file has no tokenizer.ggml.tokens")
    return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]


def _hf_tokens(file: Path) -> list[str]:
    data = json.loads(file.read_text(encoding="utf-8"))
    ids = {int(i): t for t, i in data["model"]["vocab"].items()}
    ids.update({int(a["id"]): a["content"] for a in data.get("added_tokens", [])})
    texts = [""] * (max(ids) + 1 if ids else 0)
    for i, t in ids.items():
        texts[i] = t
    return texts


def vocabulary_difference(model: Path, draft: Path) -> str | None:
    """Why a draft model's tokens are not the model's (size, or the first id whose text differs); None if equal."""
    a, b = token_texts(model), token_texts(draft)
    if len(a) != len(b):
        return f"its vocabulary has {len(b)} tokens, the model's {len(a)}"
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first is not None:
        return f"token {first} is {b[first]!r} in it, {a[first]!r} in the model's"
    return None
