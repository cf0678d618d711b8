"""One Generate request as the engine sees it (torch-free)."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

_ids = itertools.count(1)


class SeqState(enum.Enum):
    WAITING = "waiting"  # queued, no slot yet
    PREFILL = "prefill"  # owns its slot; prompt tokens still being written to the cache
    DECODE = "decode"  # one token per step
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # end-of-sequence token
    LENGTH = "length"  # MaxTokens, or the text would exceed max_text_chars
    CONTEXT_FULL = "context_full"  # the slot has no position left
    DEADLINE = "deadline"  # a job's run reached jobs.timeout_s: the reply so far is its answer


@dataclass(eq=False)  # identity: two requests with equal fields are still two requests
class Sequence:
    session_key: str
    prompt: str
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    deadline: float = float("inf")  # time.monotonic() seconds: past it the request fails (DeadlineExceeded)
    finish_at: float = float("inf")  # a job's bound: past it the reply ends as it is (FinishReason.DEADLINE)
    request_id: int = field(default_factory=lambda: next(_ids))
    state: SeqState = SeqState.WAITING
    slot: int | None = None
    turn_start: int = 0  # tokens the slot held before this turn (rolled back to on cancel or failure)
    generated: list[int] = field(default_factory=list)  # tokens of the reply (end-of-sequence excluded)
    text: str = ""
    finish_reason: FinishReason | None = None
    context_lost: bool = False
    prompt_tokens: int = 0  # tokens this turn added before generation (template + prompt)
    shared_prefix: int = 0  # of a first turn: how many leading tokens every session shares (template head)
    save_prefix: tuple[int, ...] | None = None  # store the KV of this head once computed (prefix_index.Key)
    arrival: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    handle: Any = None  # the service's reply channel (future + loop)
    constraint: Any = None  # grammar.Constraint: the reply must match its schema (masked sampling, jump-forward)
    drafter: Any = None  # speculation.LookupDrafter while speculation proposes for this reply
    one_shot: bool = False  # a turn of no conversation (session ""): its slot is given back when it ends

    @property
    def is_finished(self) -> bool:
        return self.state is SeqState.FINISHED
