"""The language model's tokenizer plus its chat template: text <-> token ids, and the tokens of one chat turn.

Built from a HF `tokenizer.json` (+ `tokenizer_config.json` / `chat_template.jinja`) or from GGUF metadata
(`tokenizer.ggml.*`, its vocabulary built by models/gguf_vocab.py). The chat template comes from a model file, so it
is untrusted: it renders in models/chat_template.py's sandbox, and every failure is a ChatTemplateError. What a user
typed goes through `normalize_prompt` first (NFKC, control characters refused).
"""
from __future__ import annotations

import json
import unicodedata
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from models.chat_template import RENDER_TIMEOUT_S, ChatTemplateError, compile_template, render_limited
from models.gguf_vocab import build_byte_level_bpe, build_sentencepiece_bpe

# Stands in for the user's text to find where a template puts it (private-use characters: in no real prompt).
_CONTENT_MARKER = "\ue000content\ue001"
_REPLY_MARKER = "\ue002reply\ue003"

# Characters refused in a prompt: control characters other than tab/newline/carriage return (a PLC that sends them
# has a bug, and stripping would change the text silently), bidirectional overrides and isolates ("Trojan Source":
# text that displays differently from what the model reads), and private-use characters (no meaning to a model;
# the tokenizer uses two of them as an internal marker).
_BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")



class PromptRejected(ValueError):
    """A prompt that is refused; the message names the first offending character and its position (no internals)."""


def normalize_prompt(text: str) -> str:
    """What a user typed, ready to tokenize: Unicode NFKC (full-width and compatibility forms become their plain
    equivalents, so "ｐｕｍｐ" and "pump" tokenize alike), CR LF and CR become LF; PromptRejected for control,
    bidi-override and private-use characters (refused, not stripped: see _BIDI_CONTROLS)."""
    text = unicodedata.normalize("NFKC", text).replace("\r\n", "\n").replace("\r", "\n")
    for i, ch in enumerate(text):
        category = unicodedata.category(ch)
        if (category == "Cc" and ch not in "\t\n") or category in ("Cs", "Co") or ch in _BIDI_CONTROLS:
            kind = {"Cc": "a control character", "Cs": "a lone surrogate", "Co": "a private-use character"}.get(
                category, "a bidirectional override")
            raise PromptRejected(f"the prompt holds {kind} (U+{ord(ch):04X}) at character {i + 1}")
    return text


class ChatTokenizer:
    """Token ids for text and chat turns. Thread-safe for encode/decode (the `tokenizers` objects are)."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None, bos_token_id: int | None,
                 eos_token_ids: set[int], template_tokens: dict[str, str] | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template or None
        self.bos_token_id = bos_token_id
        self.eos_token_ids = set(eos_token_ids)
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        # bos_token, eos_token, ... as strings: chat templates refer to them.
        self.template_tokens = dict(template_tokens or {})
        # A twin that reads special-token text as plain text, for what a user typed (see turn_tokens).
        self._literal = Tokenizer.from_str(tokenizer.to_str())
        self._literal.encode_special_tokens = True
        self._template = compile_template(self.chat_template) if self.chat_template else None
        self.render_timeout_s = RENDER_TIMEOUT_S
        self._reply_end_cache: tuple[tuple[int, ...], str] | None = None
        self._special_cache: set[int] | None = None

    # ---- construction ----------------------------------------------------------------------------------------
    @classmethod
    def from_directory(cls, directory: Path, extra_eos_ids: set[int] | None = None) -> "ChatTokenizer":
        """From an HF model directory: tokenizer.json, tokenizer_config.json and, if there, chat_template.jinja."""
        tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        cfg_path = directory / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.exists() else {}
        template = _template_from_config(cfg.get("chat_template"))
        jinja_path = directory / "chat_template.jinja"  # transformers 5 saves the template on its own
        if jinja_path.exists():
            template = jinja_path.read_text(encoding="utf-8")
        names = {k: _token_content(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        names = {k: v for k, v in names.items() if v is not None}
        bos_id = tokenizer.token_to_id(names["bos_token"]) if "bos_token" in names else None
        eos_ids = set(extra_eos_ids or ())
        if "eos_token" in names and tokenizer.token_to_id(names["eos_token"]) is not None:
            eos_ids.add(tokenizer.token_to_id(names["eos_token"]))
        return cls(tokenizer, template, bos_id, eos_ids, names)

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> "ChatTokenizer":
        """From a GGUF file's metadata (values as `ReaderField.contents()` gives them)."""
        kind = meta.get("tokenizer.ggml.model")
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
        if kind == "gpt2":
            tokenizer = build_byte_level_bpe(tokens, merges, types, meta.get("tokenizer.ggml.pre"))
        elif kind == "llama":
            scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
            tokenizer = build_sentencepiece_bpe(
                tokens, scores, types, merges or None, phi3=meta.get("general.architecture") == "phi3",
                prefix_space=bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
        else:
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (supported: byte-level BPE 'gpt2', "
                             "SentencePiece 'llama')")

        def token_at(key: str) -> tuple[int | None, str | None]:
            idx = meta.get(f"tokenizer.ggml.{key}")
            return (int(idx), tokens[int(idx)]) if idx is not None and 0 <= int(idx) < len(tokens) else (None, None)

        bos_id, bos = token_at("bos_token_id")
        eos_id, eos = token_at("eos_token_id")
        eot_id, _ = token_at("eot_token_id")  # end-of-turn, where a file names one
        names = {"bos_token": bos, "eos_token": eos, "unk_token": token_at("unknown_token_id")[1],
                 "pad_token": token_at("padding_token_id")[1]}
        eos_ids = {i for i in (eos_id, eot_id) if i is not None}
        return cls(tokenizer, meta.get("tokenizer.chat_template"), bos_id, eos_ids,
                   {k: v for k, v in names.items() if v is not None})

    # ---- text <-> ids ----------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Ids of `text`; nothing added. Special-token text (e.g. "<|im_start|>") becomes the special token."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_literal(self, text: str) -> list[int]:
        """Ids of `text` as plain text: "<|im_end|>" in it is not the control token (a user's words)."""
        return self._literal.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # ---- chat ------------------------------------------------------------------------------------------------
    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat template applied to `messages`. Without a template: the contents concatenated (documented
        fallback for base models; no roles, no generation prompt)."""
        if self._template is None:
            return "".join(str(m.get("content", "")) for m in messages)
        return render_limited(self._template, self.render_timeout_s,
                              dict(messages=messages, add_generation_prompt=add_generation_prompt,
                                   **self.template_tokens))

    def turn_tokens(self, history: list[dict], user_text: str, system_prompt: str | None) -> list[int]:
        return self.turn_tokens_and_head(history, user_text, system_prompt)[0]

    def turn_tokens_and_head(self, history: list[dict], user_text: str, system_prompt: str | None
                             ) -> tuple[list[int], int]:
        """Tokens to append to a slot holding `history` (its replies as generated, each followed by
        `assistant_suffix_tokens()`) so that it then holds history + this user turn + the generation prompt, and
        how many of its leading tokens come before the user's text and are tokenized on their own (the same for
        every prompt: a shared prefix; 0 when the template altered the text). Empty history: the whole prompt (the
        template's default system prompt included, or `system_prompt` when given).

        The new turn is what the template writes after the last reply, found with a marker in that reply's place:
        a template may render earlier replies differently once the conversation goes on (Qwen3 drops their
        reasoning) or end a finished conversation with an eos (Phi-3); the slot keeps the replies as they were
        generated and gets only the new turn. What the user typed is tokenized as plain text: "<|im_end|>" inside
        a prompt is not the control token, so a prompt cannot forge turns. ChatTemplateError where a template
        cannot be continued this way.
        """
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + list(history)
        if history and history[-1].get("role") == "assistant":
            shown = messages[:-1] + [{**messages[-1], "content": _REPLY_MARKER}]
            reply_end = self._reply_end()[1]

            def suffix_with(content: str) -> str:
                after = self.render(shown + [{"role": "user", "content": content}], add_generation_prompt=True)
                if after.count(_REPLY_MARKER) != 1:
                    raise ChatTemplateError("chat template: the last reply does not appear once in the rendering")
                rest = after[after.index(_REPLY_MARKER) + len(_REPLY_MARKER):]
                if not rest.startswith(reply_end):
                    raise ChatTemplateError("chat template: what follows a reply depends on the next turn")
                return rest[len(reply_end):]
        else:
            before = self.render(messages, add_generation_prompt=False) if history else ""

            def suffix_with(content: str) -> str:
                after = self.render(messages + [{"role": "user", "content": content}], add_generation_prompt=True)
                if not after.startswith(before):
                    raise ChatTemplateError("chat template is not prefix-stable")
                return after[len(before):]

        suffix = suffix_with(user_text)
        # Where the template put the user's text: render once more with a marker in its place.
        marked = suffix_with(_CONTENT_MARKER)
        if marked.count(_CONTENT_MARKER) == 1:
            head, tail = marked.split(_CONTENT_MARKER)
            if head + user_text + tail == suffix:  # inserted verbatim
                return self._encode_turn(head, user_text, tail)
        return self.encode(suffix), 0  # the template altered the text (e.g. trimmed it): tokenize it whole

    def _encode_turn(self, head: str, user_text: str, tail: str) -> tuple[list[int], int]:
        """The turn tokenized whole, as transformers tokenizes a rendered chat (a SentencePiece vocabulary marks
        the start of every piece of text it is given, so pieces tokenized apart would differ), unless the user's
        text then holds a special token: it is tokenized apart, as plain text. And the count of leading tokens
        that lie within the template's head."""
        start, end = len(head), len(head) + len(user_text)
        whole = self.tokenizer.encode(head + user_text + tail, add_special_tokens=False)
        special = self._special_ids()
        if not any(i in special and a < end and b > start for i, (a, b) in zip(whole.ids, whole.offsets)):
            return whole.ids, sum(1 for _a, b in whole.offsets if b <= start)
        head_ids = self.encode(head)
        return (head_ids + self._literal.encode(user_text, add_special_tokens=False).ids
                + self.encode(tail)), len(head_ids)

    def _special_ids(self) -> set[int]:
        if self._special_cache is None:
            self._special_cache = {i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special}
        return self._special_cache

    def assistant_suffix_tokens(self) -> list[int]:
        """What the template writes after an assistant reply's text when the conversation goes on, e.g. the ids of
        "<|im_end|>\n" (Phi-3: "<|end|>\n", not the "<|endoftext|>" it writes at the end of a whole
        conversation). When the template ends replies with an end-of-turn token, this starts with it (a slot whose
        generation stopped on it needs only the rest). Empty without a template."""
        return list(self._reply_end()[0])

    def end_of_turn_ids(self) -> set[int]:
        """The special token the template closes a reply with (e.g. <|im_end|>, Phi-3's <|end|>), which ends a
        generated reply as the eos tokens do; empty when replies end otherwise."""
        suffix = self.assistant_suffix_tokens()
        return {suffix[0]} if suffix and suffix[0] in self._special_ids() else set()

    def _reply_end(self) -> tuple[tuple[int, ...], str]:
        """(ids, text) of what follows a reply when another user turn comes: the tokens that rendering shares
        with a conversation ending after the reply (found token by token, so an eos that only ends a whole
        conversation is left out without cutting a token in two)."""
        if self._template is None:
            return (), ""
        if self._reply_end_cache is None:
            first = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _REPLY_MARKER}]
            ended = self.render(first, add_generation_prompt=False)
            going_on = self.render(first + [{"role": "user", "content": "and then?"}], add_generation_prompt=True)
            ended, going_on = (t[t.rindex(_REPLY_MARKER) + len(_REPLY_MARKER):] for t in (ended, going_on))
            a = self.tokenizer.encode(ended, add_special_tokens=False)
            b = self.tokenizer.encode(going_on, add_special_tokens=False)
            n = 0
            while n < min(len(a.ids), len(b.ids)) and a.ids[n] == b.ids[n]:
                n += 1
            self._reply_end_cache = (tuple(b.ids[:n]), going_on[:b.offsets[n - 1][1]] if n else "")
        return self._reply_end_cache


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):  # AddedToken serialised as {"content": ...}
        return value.get("content")
    return value if isinstance(value, str) else None


def _template_from_config(value: Any) -> str | None:
    if isinstance(value, list):  # HF named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return value if isinstance(value, str) else None
