"""Driving the engine without a tokenizer, for benchmarks and tests: a TurnPolicy over raw token ids that
generates exactly `max_tokens` tokens (end-of-sequence ignored), and a loop that runs a scheduler to the end."""
from __future__ import annotations

from typing import Any

from appliance.engine.llm.sequence import FinishReason


class TokenTurns:
    """The prompt string of a Sequence names its token list in `turns`."""

    def __init__(self, turns: dict[str, list[int]] | None = None):
        self.turns: dict[str, list[int]] = dict(turns or {})

    def prepare(self, seq, slot, acquired) -> None:
        slot.tokens.extend(self.turns[seq.prompt])

    def accept(self, seq, slot, token: int) -> FinishReason | None:
        seq.generated.append(token)
        slot.tokens.append(token)
        return FinishReason.LENGTH if len(seq.generated) >= seq.max_tokens else None

    def close(self, seq, slot) -> None:
        pass


def run_to_end(scheduler: Any, runner: Any) -> int:
    """Steps until nothing is waiting or running; returns how many. A request the scheduler fails is an error here."""
    steps = 0
    while scheduler.has_work:
        plan = scheduler.schedule()
        if plan.failed:
            raise RuntimeError(f"requests failed: {[str(err) for _seq, err in plan.failed]}")
        scheduler.commit(plan, runner.run(plan))
        steps += 1
    return steps
