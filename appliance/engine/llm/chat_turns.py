"""The TurnPolicy of chat conversations: how one Generate call becomes tokens in its session's slot and when it ends.

A reply under a grammar (seq.constraint) ends when its document is complete; each sampled token is consumed by the
matcher, and the tokens the grammar forces after it (keys, punctuation, the rest of an enum value) are appended at
once (jump-forward): the scheduler feeds such a stretch in one step as a prefill chunk instead of one decode step per
token."""
from __future__ import annotations

import logging
from typing import Any

from appliance.engine.llm.sequence import FinishReason, Sequence
from appliance.engine.llm.slots import Acquired, Slot
from core.errors import EngineFailure

log = logging.getLogger(__name__)


class ChatTurns:
    """The TurnPolicy of chat conversations: template tokens per turn, stop rules, the assistant suffix."""

    def __init__(self, tokenizer: Any, system_prompt: str | None, max_text_chars: int, max_seq_len: int,
                 jump_forward: bool = True):
        self.tokenizer = tokenizer
        self.jump_forward = jump_forward
        self.system_prompt = system_prompt
        self.max_text_chars = max_text_chars
        self.max_seq_len = max_seq_len
        # The template's end-of-turn token ends a reply too (Phi-3's <|end|> is not the file's eos <|endoftext|>).
        self.eos_ids = set(tokenizer.eos_token_ids) | tokenizer.end_of_turn_ids()
        self.suffix = list(tokenizer.assistant_suffix_tokens())

    def prepare(self, seq: Sequence, slot: Slot, acquired: Acquired) -> None:
        try:
            ids, head = self.tokenizer.turn_tokens_and_head(slot.history, seq.prompt, self.system_prompt)
        except Exception as exc:  # a template that cannot render this conversation
            log.warning("chat template failed: %r", exc)
            raise EngineFailure("the model's chat template could not render this conversation") from None
        seq.shared_prefix = head if not slot.tokens else 0  # only a first turn starts with the shared head
        slot.tokens.extend(ids)
        if seq.constraint is not None and self.jump_forward:  # the document's forced opening, prefilled with the
            forced = seq.constraint.forced()                      # prompt (at least one token sampled after it)
            if len(forced) > seq.max_tokens - 1:
                forced, seq.constraint.cut = forced[:max(0, seq.max_tokens - 1)], True
            seq.generated.extend(forced)
            slot.tokens.extend(forced)
            seq.text = self.tokenizer.decode(seq.generated)

    def accept(self, seq: Sequence, slot: Slot, token: int) -> FinishReason | None:
        constraint = seq.constraint
        if token in self.eos_ids and (constraint is None or constraint.accepting):
            return FinishReason.LENGTH if constraint is not None and constraint.cut else FinishReason.STOP
        tokens = [token]
        if constraint is not None:
            if not constraint.consume(token):  # the mask allowed it, so this is a bug: never a Good answer
                log.error("grammar refused a token its mask allowed: %s", constraint.failed)
                return FinishReason.LENGTH
            if self.jump_forward and not constraint.complete:
                tokens += constraint.forced()
        room = seq.max_tokens - len(seq.generated)  # >= 1: a reply ends as it reaches max_tokens
        cut = len(tokens) > room
        tokens = tokens[:room]
        text = self.tokenizer.decode(seq.generated + tokens)
        if len(text) > self.max_text_chars:  # stop before the text would exceed what the PLC can hold
            return FinishReason.LENGTH
        seq.generated.extend(tokens)
        slot.tokens.extend(tokens)
        seq.text = text
        if cut or (constraint is not None and constraint.cut):  # forced tokens past MaxTokens: not whole
            return FinishReason.LENGTH
        if constraint is not None and constraint.complete:
            return FinishReason.STOP
        return FinishReason.LENGTH if len(seq.generated) >= seq.max_tokens else None

    def close(self, seq: Sequence, slot: Slot) -> None:
        # The end-of-turn marker the template writes after a reply (the sampled EOS itself was not kept), so the
        # next turn's template tokens follow a well-formed conversation.
        if len(slot.tokens) + len(self.suffix) <= self.max_seq_len:
            slot.tokens.extend(self.suffix)
        slot.history += [{"role": "user", "content": seq.prompt}, {"role": "assistant", "content": seq.text}]
