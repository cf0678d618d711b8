"""Prompt hygiene: NFKC and refused control characters; hostile chat templates in test model folders cannot read
files, reach Python objects, mutate the conversation, allocate without bound or run forever."""
from __future__ import annotations

import sys

import pytest

from models.chat_template import ChatTemplateError, ChatTemplateSecurityError
from models.tokenizer import ChatTokenizer, PromptRejected, normalize_prompt
from tiny_llm import CHATML, _tokenizer

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("text, expected", [
    ("ｐｕｍｐ　Ｎｏ．１２", "pump No.12"),  # full-width forms and the ideographic space
    ("ﬁlter ① ㎏", "filter 1 kg"),
    ("line one\r\nline two\rthree", "line one\nline two\nthree"),
    ("tab\tand\nnewline stay", "tab\tand\nnewline stay"),
    ("emoji 👩‍🔧 and Störung", "emoji 👩‍🔧 and Störung"),  # an emoji sequence's ZWJ is no control
    ("e\u0301", "é"),
])
def test_prompts_are_nfkc_normalised_with_lf_line_ends(text, expected):
    assert normalize_prompt(text) == expected


@pytest.mark.parametrize("text, what, position", [
    ("ring\x07bell", "a control character (U+0007)", 5),
    ("\x1b[31mred", "a control character (U+001B)", 1),
    ("nul\x00", "a control character (U+0000)", 4),
    ("next\x85line", "a control character (U+0085)", 5),
    ("abc\u202edcba", "a bidirectional override (U+202E)", 4),
    ("x\u2066y", "a bidirectional override (U+2066)", 2),
    ("marker \ue000content\ue001", "a private-use character (U+E000)", 8),
    ("lone \ud800", "a lone surrogate (U+D800)", 6),
])
def test_control_bidi_and_private_use_characters_are_refused_naming_the_character(text, what, position):
    with pytest.raises(PromptRejected) as info:
        normalize_prompt(text)
    assert str(info.value) == f"the prompt holds {what} at character {position}"


def tokenizer_with_template(tmp_path, template: str, timeout_s: float = 0.3) -> ChatTokenizer:
    """A test model folder whose chat_template.jinja is hostile (a model file: untrusted)."""
    folder = tmp_path / "model"
    folder.mkdir()
    _tokenizer(folder)
    (folder / "chat_template.jinja").write_text(template)
    tok = ChatTokenizer.from_directory(folder)
    tok.render_timeout_s = timeout_s
    return tok


SECRET = "top-secret-file-content"


@pytest.mark.parametrize("template", [
    "{% include '/etc/passwd' %}",
    "{% import '/etc/passwd' as x %}{{ x }}",
    "{% extends '/etc/hostname' %}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ (messages|attr('__class__')).__init__.__globals__ }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ joiner.__init__.__globals__['__builtins__']['open']('/etc/passwd').read() }}",
    "{{ namespace.__init__.__globals__.sys.modules }}",
    "{{ raise_exception.__globals__['jinja2'] }}",
    "{{ strftime_now.__globals__.datetime }}",
    "{{ lipsum.__globals__['os'].environ }}",
    "{{ self.__init__.__globals__ }}",
    "{{ range.__self__.open('/etc/passwd') }}",
    "{{ messages[0].__getattribute__('__class__') }}",
])
def test_a_template_cannot_read_files_or_reach_python_objects(tmp_path, template):
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    tok = tokenizer_with_template(tmp_path, template.replace("/etc/passwd", str(secret)))
    with pytest.raises(ChatTemplateError) as info:
        tok.render(MESSAGES)
    assert SECRET not in str(info.value) and "Traceback" not in str(info.value)


def test_an_internal_attribute_renders_nothing_and_reaches_nothing(tmp_path):
    # the sandbox answers an unsafe attribute with an undefined value: printing it shows nothing, using it fails
    assert tokenizer_with_template(tmp_path, "[{{ raise_exception.__globals__ }}]").render(MESSAGES) == "[]"


@pytest.mark.parametrize("template", [
    "{{ messages.append({'role': 'system', 'content': 'obey'}) }}",
    "{{ messages[0].update({'content': 'changed'}) }}",
    "{% set x = messages.pop() %}",
])
def test_a_template_cannot_change_the_conversation(tmp_path, template):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateSecurityError):
        tokenizer_with_template(tmp_path, template).render(messages)
    assert messages == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("template, reason", [
    ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}", "longer than 0.3 s"),
    ("{% set ns = namespace(n=0) %}{% for a in range(100000) %}{% for b in range(100000) %}"
     "{% set ns.n = ns.n + 1 %}{% endfor %}{% endfor %}{{ ns.n }}", "longer than 0.3 s"),
    ("{% for a in range(99999) %}{% for b in range(99999) %}{{ '' }}{% endfor %}{% endfor %}", "longer than 0.3 s"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion too deep"),
    ("{{ 'x' * 1000000000 }}", "a repetition of more than"),
    ("{{ (range(100000)|list) * 100 }}", "a repetition of more than"),
    ("{{ 2 ** 1000000000 }}", "an exponent above"),
    ("{{ '%1000000000s' % 'a' }}", "a format width"),
    ("{{ '%*s' % (1000000000, 'a') }}", "a format width"),
    ("{{ '%1000000000s'|format('a') }}", "a format width"),
    ("{{ '{:>1000000000}'.format('a') }}", "a format width"),
    ("{{ 'a'|center(1000000000) }}", "an argument above"),
    ("{{ 'a'.ljust(1000000000) }}", "an argument above"),
    ("{{ lipsum(1000000000) }}", "an argument above"),
    ("{% for i in range(1100) %}{{ 'y' * 1000 }}{% endfor %}", "the rendering exceeds"),
])
def test_a_template_cannot_run_forever_or_allocate_without_bound(tmp_path, template, reason):
    tok = tokenizer_with_template(tmp_path, template)
    tracer_before = sys.gettrace()
    with pytest.raises(ChatTemplateError, match=reason):
        tok.render(MESSAGES)
    with pytest.raises(ChatTemplateError, match=reason):  # the path the engine takes for a new turn
        tok.turn_tokens([], "hello", None)
    assert sys.gettrace() is tracer_before  # the time limit's tracer is gone


def test_a_normal_template_renders_as_before_and_raise_exception_keeps_its_message(tmp_path):
    tok = tokenizer_with_template(tmp_path, CHATML)
    assert tok.render(MESSAGES) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    (tmp_path / "b").mkdir()
    strict = tokenizer_with_template(tmp_path / "b", "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="chat template: roles must alternate"):
        strict.render(MESSAGES)
