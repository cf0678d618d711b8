"""Constrained decoding: a task's output schema (JSON Schema text) compiled to a grammar, a matcher per sequence
(torch-free; the engine's sampler applies the masks, appliance/engine/llm/sampling.py).

The grammar engine is llguidance (what llama.cpp, vLLM and SGLang integrate; the measurement that chose it is in
docs/models.md). Its tokenizer is built from ours (models/tokenizer.py's `tokenizers` object, serialised: no
transformers at run time), once per loaded tokenizer (~0.2 s for a 49k vocabulary). Each distinct schema text is
compiled once and kept (a template matcher); every sequence gets a copy of it, which then consumes the sequence's
tokens, computes its next token mask (one bit per vocabulary entry) and the forced tokens that follow (jump-forward).
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

import llguidance

from core.errors import INVALID, InvalidArgument

MAX_SCHEMA_CHARS = 64 * 1024  # a task's schema is a few hundred characters; far above any legitimate one
SCHEMAS_KEPT = 64  # compiled schemas kept per engine (least recently used dropped first)
# Compact JSON: no free whitespace between tokens (fewer tokens, and no loop of spaces a sampler could wander into).
_JSON_OPTIONS = {"whitespace_flexible": False}


class Constraint:
    """One sequence's matcher: what it may sample next, what is forced, whether the document is complete."""

    __slots__ = ("matcher", "cut")

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher
        self.cut = False  # forced tokens the reply had no room for (MaxTokens): the document can never be whole

    def consume(self, token: int) -> bool:
        """Take a sampled token; False if the grammar refuses it (then the matcher is in its error state)."""
        return self.matcher.consume_token(token)

    def forced(self) -> list[int]:
        """The tokens the grammar allows no alternative to now (keys, punctuation, the rest of an enum value),
        consumed: the caller appends them to the reply."""
        tokens = self.matcher.compute_ff_tokens()
        if tokens and not self.matcher.consume_tokens(tokens):
            return []
        return tokens

    @property
    def complete(self) -> bool:
        """The document is whole and nothing may follow it (but the end of the turn)."""
        return self.matcher.is_stopped() and not self.matcher.is_error() and not self.cut

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()

    @property
    def failed(self) -> str:
        return self.matcher.get_error() if self.matcher.is_error() else ""


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class MaskFiller:
    """Fills the token masks of a step's constrained rows: one int32 bit array per row (bit i of word i // 32:
    token i allowed). Rows are computed in llguidance's thread pool when there are several."""

    def __init__(self, vocab_size: int):
        self.words = mask_words(vocab_size)
        self._executor: llguidance.LLExecutor | None = None

    def fill(self, constraints: list[Constraint]) -> np.ndarray:
        out = np.empty((len(constraints), self.words), dtype=np.int32)
        row_bytes = self.words * 4
        if len(constraints) == 1:
            constraints[0].matcher.unsafe_compute_mask_ptr(out.ctypes.data, row_bytes)
        else:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            self._executor.unsafe_compute_mask_ptr([(c.matcher, i) for i, c in enumerate(constraints)],
                                                   out.ctypes.data, row_bytes, len(constraints))
        return out


class GrammarBook:
    """The grammars of one loaded tokenizer: the llguidance tokenizer, and each schema compiled once."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: set[int]):
        """tokenizer: models.tokenizer.ChatTokenizer; vocab_size: the model's logits width (may exceed the
        tokenizer's: those ids are never allowed); eos_ids: the tokens that end a reply (allowed once the document
        is complete)."""
        self.source = tokenizer
        self.vocab_size = vocab_size
        self._ll = llguidance.LLTokenizer(tokenizer.tokenizer.to_str(), n_vocab=vocab_size,
                                          eos_token=sorted(eos_ids))
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # compiled from the event loop's threads, copied from the event loop

    def is_compiled(self, schema: str) -> bool:
        return schema in self._compiled

    def constraint(self, schema: str) -> Constraint:
        """A fresh matcher for `schema` (JSON Schema text); InvalidArgument if it is not a schema the grammar
        engine can compile."""
        with self._lock:
            template = self._compiled.get(schema)
            if template is not None:
                self._compiled.move_to_end(schema)
        if template is None:
            template = self._compile(schema)
            with self._lock:
                self._compiled[schema] = template
                while len(self._compiled) > SCHEMAS_KEPT:
                    self._compiled.popitem(last=False)
        return Constraint(template.deep_copy())

    def _compile(self, schema: str) -> llguidance.LLMatcher:
        if not isinstance(schema, str) or len(schema) > MAX_SCHEMA_CHARS:
            raise InvalidArgument(f"the output schema must be JSON text of at most {MAX_SCHEMA_CHARS} characters",
                                  0, INVALID)
        try:
            doc = json.loads(schema)
        except ValueError:
            raise InvalidArgument("the output schema is not JSON", 0, INVALID) from None
        if not isinstance(doc, dict):
            raise InvalidArgument("the output schema must be a JSON object", 0, INVALID)
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(doc, defaults=_JSON_OPTIONS)
        except ValueError as exc:
            raise InvalidArgument(f"the output schema cannot be compiled: {_short(exc)}", 0, INVALID) from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._ll)
        if is_error:
            raise InvalidArgument(f"the output schema cannot be compiled: {_short(messages[0])}", 0, INVALID)
        matcher = llguidance.LLMatcher(self._ll, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidArgument(f"the output schema cannot be compiled: {_short(matcher.get_error())}", 0,
                                  INVALID)
        return matcher


def _short(message: Any) -> str:
    text = str(message).strip().splitlines()[0] if str(message).strip() else "unknown error"
    return text[:200]
