"""A chat template rendered the way HF does: a sandboxed jinja2 environment with trim_blocks/lstrip_blocks,
`raise_exception`, `strftime_now` and a `tojson` that keeps unicode.

The template comes from a model file, so it is untrusted: it renders in jinja2's ImmutableSandboxedEnvironment (no
attribute starting with '_', no mutation of the messages, no file loader), within a time limit (a tracer on the
template's own frames stops a loop that runs too long), with size limits on `*`, `**`, `%`/format widths and the
output; every failure is a ChatTemplateError.
"""
from __future__ import annotations

import datetime
import functools
import json
import re
import sys
import time
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

RENDER_TIMEOUT_S = 1.0  # a chat template renders in well under 10 ms; a template that runs 1 s is hostile or broken
MAX_RENDER_CHARS = 1 << 20  # longest rendering: a whole conversation of max_seq_len tokens is ~10-50k characters
MAX_POWER_EXPONENT = 4096  # `**` beyond this is refused (2 ** 10 ** 9 would compute for minutes)
_HUGE_WIDTH = re.compile(r"%[-+ #0]*\*|%[-+ #0]*\d{7,}|\{[^{}]*:[^{}]*\d{7,}")  # %9999999s, %*s, {:>9999999}

class ChatTemplateError(jinja2.exceptions.TemplateError):
    """The chat template failed, was refused by the sandbox or ran past a limit; the message says which."""


class ChatTemplateSecurityError(ChatTemplateError, jinja2.sandbox.SecurityError):
    """The sandbox refused something the template tried (an internal attribute, a mutation, a huge size)."""


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson HTML-escapes; HF's keeps the text as is.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _LimitedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The immutable sandbox, plus size limits on the operations that allocate in one step."""

    intercepted_binops = frozenset({"*", "**", "%"})

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_RENDER_CHARS:
                    raise jinja2.sandbox.SecurityError(f"a repetition of more than {MAX_RENDER_CHARS} items")
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > MAX_POWER_EXPONENT:
            raise jinja2.sandbox.SecurityError(f"an exponent above {MAX_POWER_EXPONENT}")
        if operator == "%" and isinstance(left, str) and _HUGE_WIDTH.search(left):
            raise jinja2.sandbox.SecurityError("a format width of a million characters or more")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        _check_arguments((*args, *kwargs.values()))
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value):
        if isinstance(getattr(value, "__self__", None), str):  # "{:>999999999}".format: the width is in the str
            _check_arguments((value.__self__,))
        return super().wrap_str_format(value)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # filters are called directly by the compiled template (not through `call`): check their arguments too
        self.filters = {name: _checked_filter(f) for name, f in self.filters.items()}


def _check_arguments(values) -> None:
    for value in values:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_RENDER_CHARS:
            raise jinja2.sandbox.SecurityError(f"an argument above {MAX_RENDER_CHARS} (e.g. a width)")
        if isinstance(value, str) and _HUGE_WIDTH.search(value):
            raise jinja2.sandbox.SecurityError("a format width of a million characters or more")


def _checked_filter(f):
    @functools.wraps(f)  # keeps jinja's pass_context / pass_environment marks
    def checked(*args, **kwargs):
        _check_arguments((*args, *kwargs.values()))
        return f(*args, **kwargs)
    return checked


def render_limited(template: jinja2.Template, timeout_s: float, context: dict) -> str:
    """Render within `timeout_s` seconds and MAX_RENDER_CHARS characters; ChatTemplateError otherwise.

    The time limit is a tracer on this thread that sees only the template's own compiled frames (filename
    "<template>"): each line they run checks the clock, so a loop of any depth stops at the deadline, and Python
    code outside the template runs untraced. One C-level step cannot be interrupted; the size limits above keep
    each such step small."""
    deadline = time.monotonic() + timeout_s

    def in_template(frame, event, arg):
        if time.monotonic() > deadline:
            raise ChatTemplateError(f"chat template: rendering took longer than {timeout_s:g} s")
        return in_template

    def on_call(frame, event, arg):
        return in_template if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        parts, size = [], 0
        for part in template.generate(**context):
            size += len(part)
            if size > MAX_RENDER_CHARS:
                raise ChatTemplateError(f"chat template: the rendering exceeds {MAX_RENDER_CHARS} characters")
            parts.append(part)
        return "".join(parts)
    except ChatTemplateError:
        raise
    except jinja2.sandbox.SecurityError as e:
        raise ChatTemplateSecurityError(f"chat template: {e.message or 'refused by the sandbox'}") from None
    except jinja2.exceptions.TemplateError as e:  # raise_exception(), undefined names
        raise ChatTemplateError(f"chat template: {e.message or type(e).__name__}") from None
    except RecursionError:
        raise ChatTemplateError("chat template: recursion too deep") from None
    except Exception as e:  # e.g. 1/0 or a TypeError inside the template: the template is broken
        raise ChatTemplateError(f"chat template: {type(e).__name__}: {e}") from None
    finally:
        sys.settrace(previous)


def compile_template(source: str) -> jinja2.Template:
    env = _LimitedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _checked_filter(_tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
