"""Choose: score a prompt's candidate replies (torch-free: the request, and which slots its forwards use).

The engine thread runs a Choose between two steps (EngineLoop): the prompt, rendered as one user turn of no
conversation, is prefilled once into a slot; its keys and values are copied into the other slots it got (a copy of
the prompt's cache costs far less than recomputing it per option), and the options then run as the rows of one
forward (in groups when fewer slots than options were free), each row attending over the prompt in its own slot.
An option's score is the sum of its tokens' log-probabilities: the first from the prompt's last logits, the rest
from the option's own positions (ModelRunner.score_options). Nothing is sampled: the same call gives the same scores.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

_ids = itertools.count(1)


@dataclass(eq=False)
class ChooseRequest:
    prompt: str  # normalized (call_checks.check_generate)
    options: list[str]  # normalized (call_checks.check_options)
    deadline: float  # time.monotonic() seconds
    handle: Any = None  # thread_reply.Reply: the ChooseResult or the error
    request_id: int = field(default_factory=lambda: next(_ids))

    def slot_key(self, i: int) -> str:
        """The key of the i-th slot it holds while it runs (never a session's: those have no NUL)."""
        return f"\0choose:{self.request_id}:{i}"


def best(scores: list[float]) -> int:
    """The index of the highest score, the first on ties."""
    return max(range(len(scores)), key=lambda i: (scores[i], -i))
