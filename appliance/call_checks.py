"""The argument checks of Infer and Generate, in one place: the engine applies them to every request, and the UA
layer applies them before it starts a job, so StartInfer / StartGenerate refuse exactly what Infer / Generate
would, with the same status code and the same argument marked (torch-free).

`first` is the index of the first checked argument in the method's own argument list (StartGenerate's Prompt is
argument 1: ConversationId comes first).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from appliance.engine.llm.settings import MAX_PROMPT_BYTES, MAX_TEMPERATURE
from core.errors import INVALID, OUT_OF_RANGE, TYPE_MISMATCH, InvalidArgument


def check_samples(values, input_shape: Sequence[int], max_samples: int, first: int = 0) -> np.ndarray:
    """k samples back to back (1 <= k <= max_samples, finite) as a (k, *input_shape) float32 array."""
    try:
        flat = np.asarray(values, dtype=np.float32)  # Double[] is accepted and converted
    except (TypeError, ValueError):
        raise InvalidArgument("Input must be an array of Float or Double", first, TYPE_MISMATCH) from None
    if flat.ndim != 1:
        raise InvalidArgument("Input must be a one-dimensional array", first, OUT_OF_RANGE)
    sample_len = math.prod(input_shape)
    if flat.size == 0 or flat.size % sample_len:
        raise InvalidArgument(f"Input length {flat.size} is not a positive multiple of the sample length "
                              f"{sample_len}", first, OUT_OF_RANGE)
    k = flat.size // sample_len
    if k > max_samples:
        raise InvalidArgument(f"Input holds {k} samples; at most {max_samples} are allowed", first, OUT_OF_RANGE)
    if not np.isfinite(flat).all():
        raise InvalidArgument("Input holds NaN or Inf", first, OUT_OF_RANGE)
    return flat.reshape((k, *input_shape))


def check_generate(prompt, max_tokens, temperature, max_new_tokens: int, first: int = 0) -> str:
    """The prompt as it will be tokenized (NFKC, LF line ends), or InvalidArgument naming the argument. Whether
    the prompt fits the conversation's context is known only when its turn is admitted."""
    if not isinstance(prompt, str) or not prompt:
        raise InvalidArgument("Prompt must be a non-empty string", first, INVALID)
    try:
        size = len(prompt.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidArgument("Prompt is not valid UTF-8", first, INVALID) from None
    if size > MAX_PROMPT_BYTES:
        raise InvalidArgument(f"Prompt is {size} bytes; at most {MAX_PROMPT_BYTES} are allowed", first,
                              OUT_OF_RANGE)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= max_new_tokens:
        raise InvalidArgument(f"MaxTokens must be between 1 and {max_new_tokens}", first + 1, OUT_OF_RANGE)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or math.isnan(temperature) or not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise InvalidArgument(f"Temperature must be between 0 and {MAX_TEMPERATURE:g}", first + 2, OUT_OF_RANGE)
    from models.tokenizer import PromptRejected, normalize_prompt  # the tokenizer's own rule, one definition
    try:
        return normalize_prompt(prompt)
    except PromptRejected as e:
        raise InvalidArgument(str(e), first, INVALID) from None


def check_options(options, first: int = 1) -> list[str]:
    """Choose's options as they will be tokenized (NFKC, LF line ends): 1 to CHOOSE_MAX_OPTIONS strings, each
    non-empty and at most CHOOSE_MAX_OPTION_CHARS characters, or InvalidArgument marking Options (argument
    `first`)."""
    from core.model_port import CHOOSE_MAX_OPTION_CHARS, CHOOSE_MAX_OPTIONS
    from models.tokenizer import PromptRejected, normalize_prompt
    if isinstance(options, str) or not isinstance(options, (list, tuple)):
        raise InvalidArgument("Options must be an array of String", first, TYPE_MISMATCH)
    if not 1 <= len(options) <= CHOOSE_MAX_OPTIONS:
        raise InvalidArgument(f"Options must hold 1 to {CHOOSE_MAX_OPTIONS} strings", first, OUT_OF_RANGE)
    out = []
    for i, option in enumerate(options):
        if not isinstance(option, str) or not option:
            raise InvalidArgument(f"Options[{i}] must be a non-empty string", first, INVALID)
        if len(option) > CHOOSE_MAX_OPTION_CHARS:
            raise InvalidArgument(f"Options[{i}] is {len(option)} characters; at most {CHOOSE_MAX_OPTION_CHARS} "
                                  "are allowed", first, OUT_OF_RANGE)
        try:
            out.append(normalize_prompt(option))
        except PromptRejected as e:
            raise InvalidArgument(f"Options[{i}]: {e}", first, INVALID) from None
    return out


class CallChecks:
    """The checks as the UA layer is handed them (core.services.CallChecks; the daemon builds one): the engine's
    max_new_tokens bound, so StartGenerate, StartInfer and a task refuse at their start what the call would."""

    def __init__(self, max_new_tokens: int):
        self.max_new_tokens = max_new_tokens

    def samples(self, values, input_shape: Sequence[int], max_samples: int, first: int = 0) -> np.ndarray:
        return check_samples(values, input_shape, max_samples, first)

    def generate(self, prompt, max_tokens, temperature, first: int = 0) -> str:
        return check_generate(prompt, max_tokens, temperature, self.max_new_tokens, first)

    def task_text(self, name: str, value: str, index: int) -> None:
        """A task's String input under the prompt's own rule (control characters, bidi overrides), marked on its
        argument."""
        from models.tokenizer import PromptRejected, normalize_prompt
        try:
            normalize_prompt(value)
        except PromptRejected as e:
            raise InvalidArgument(f"{name}: {str(e).replace('the prompt holds', 'it holds')}", index, INVALID) \
                from None
