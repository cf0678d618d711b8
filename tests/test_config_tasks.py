"""`models.NAME.tasks` and `mailboxes.NAME.task` in the YAML: what is accepted, and each refusal named by file, line
and key (a schema outside the supported subset, a template naming an unknown input, an enum the tokenizer cannot
spell, bounds against the engine's); the schema the engine decodes under, and an answer read back typed."""
from __future__ import annotations

import json

import pytest

from appliance.cli import main
from core.config import ConfigError, demo_config, load_config, load_config_text
from core.task_answers import AnswerInvalid, json_schema, read_answer

GOOD = """\
models:
  chat:
    kind: generative
    path: builtin:smollm2
    tasks:
      triage:
        prompt: "Alarm {Text} on line {Line} ({Urgent})"
        inputs:
          Text: {type: String, max_length: 200}
          Line: {type: Int32, minimum: 1, maximum: 12}
          Urgent: {type: Boolean}
        output:
          Severity: {type: enum, values: [low, medium, high]}
          StopLine: {type: Boolean}
          Code: {type: Int32, minimum: 0, maximum: 99}
          Temperature: {type: Double, minimum: -40, maximum: 200.5}
          Reason: {type: String, max_length: 80, required: false}
        max_tokens: 96
mailboxes:
  hmi: {model: chat, task: triage}
"""


def errors(text: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config_text(text, source="t.yaml")
    return e.value.errors


def with_task(body: str, extra: str = "") -> str:
    return ("models:\n  chat:\n    kind: generative\n    path: builtin:smollm2\n    tasks:\n      t:\n"
            + "".join(f"        {line}\n" for line in body.strip("\n").splitlines()) + extra)


def test_a_task_is_read_in_order_with_its_defaults():
    cfg = load_config_text(GOOD)
    task = cfg.models["chat"].tasks["triage"]
    assert list(task.inputs) == ["Text", "Line", "Urgent"]
    assert list(task.output) == ["Severity", "StopLine", "Code", "Temperature", "Reason"]
    assert task.effective_max_tokens == 96 and task.temperature == 0.0
    assert task.prompt_for({"Text": "hot", "Line": 3, "Urgent": True}) == "Alarm hot on line 3 (true)"
    assert cfg.mailboxes["hmi"].task == "triage"
    schema = json_schema(task)
    assert schema == {
        "type": "object", "additionalProperties": False,
        "required": ["Severity", "StopLine", "Code", "Temperature"],
        "properties": {"Severity": {"type": "string", "enum": ["low", "medium", "high"]},
                       "StopLine": {"type": "boolean"},
                       "Code": {"type": "integer", "minimum": 0, "maximum": 99},
                       "Temperature": {"type": "number", "minimum": -40.0, "maximum": 200.5},
                       "Reason": {"type": "string", "maxLength": 80}}}
    assert list(schema["properties"]) == list(task.output)  # the fields' order is the arguments' order


def test_the_demo_has_a_task_and_its_mailbox():
    cfg = demo_config()
    assert list(cfg.models["assistant"].tasks) == ["alarm-triage"]
    assert cfg.mailboxes["alarm-triage"].task == "alarm-triage"


@pytest.mark.parametrize("body, expected", [
    ('prompt: "x {Nope}"\ninputs: {A: {type: String}}\noutput: {B: {type: Boolean}}',
     "t.yaml:7: models.chat.tasks.t.prompt: the template names {Nope}, which is not an input of the task (inputs: A)"),
    ('prompt: "x {A:.2f}"\ninputs: {A: {type: Double}}\noutput: {B: {type: Boolean}}',
     "t.yaml:7: models.chat.tasks.t.prompt: a replacement field takes no format or conversion"),
    ('prompt: "x {A} {"\ninputs: {A: {type: String}}\noutput: {B: {type: Boolean}}',
     "t.yaml:7: models.chat.tasks.t.prompt: the template is malformed"),
    ('prompt: "x"\ninputs: {A: {type: String}}\noutput: {B: {type: Boolean}}',
     "models.chat.tasks.t.inputs.A: input 'A' is not used by the prompt template"),
    ('prompt: "{A}"\ninputs: {A: {type: String}}\noutput: {B: {type: object}}',
     "t.yaml:9: models.chat.tasks.t.output.B.type: type 'object' is outside the supported subset"),
    ('prompt: "{A}"\ninputs: {A: {type: String}}\noutput: {B: {type: array}}',
     "t.yaml:9: models.chat.tasks.t.output.B.type: type 'array' is outside the supported subset"),
    ('prompt: "{A}"\ninputs: {A: {type: String}}\noutput: {B: {type: String, pattern: "[a-z]+"}}',
     "t.yaml:9: models.chat.tasks.t.output.B.pattern: unknown key 'pattern' in field 'B'"),
    ('prompt: "{A}"\ninputs: {A: {type: String}}\noutput: {B: {type: String, max_length: 255}}',
     "t.yaml:9: models.chat.tasks.t.output.B.max_length: expected an integer in [1, 254] or null, got 255"),
    ('prompt: "{A}"\ninputs: {A: {type: String}}\noutput: {B: {type: Boolean, values: [a]}}',
     "t.yaml:9: models.chat.tasks.t.output.B.values: values applies to enum only"),
    ('prompt: "{A}"\ninputs: {A: {type: String}}\noutput: {B: {type: enum}}',
     "t.yaml:9: models.chat.tasks.t.output.B.values: an enum needs its values"),
    ('prompt: "{A}"\ninputs: {A: {type: String}}\noutput: {B: {type: enum, values: [a, a]}}',
     "t.yaml:9: models.chat.tasks.t.output.B.values[1]: 'a' is listed twice"),
    ('prompt: "{A}"\ninputs: {A: {type: String}}\noutput: {B: {type: Int32, minimum: 5, maximum: 1}}',
     "t.yaml:9: models.chat.tasks.t.output.B.maximum: expected a number >= minimum (5), got 1"),
    ('prompt: "{A}"\ninputs: {A: {type: String}}\noutput: {B: {type: Int32, maximum: 3000000000}}',
     "t.yaml:9: models.chat.tasks.t.output.B.maximum: expected an Int32"),
    ('prompt: "{A}"\ninputs: {A: {type: Float}}\noutput: {B: {type: Boolean}}',
     "t.yaml:8: models.chat.tasks.t.inputs.A.type: expected one of String, Int32, Double, Boolean, got 'Float'"),
    ('prompt: "{A}"\ninputs: {A: {type: String}}\noutput: {}',
     "t.yaml:9: models.chat.tasks.t.output: expected a non-empty mapping of field names"),
    ('prompt: "{A}"\ninputs: {A: {type: String}}\noutput: {Done: {type: Boolean}}',
     "t.yaml:9: models.chat.tasks.t.output.Done: a field name must be a PLC identifier"),
    ('prompt: "{A}"\ninputs: {A: {type: String}}\noutput: {bad-name: {type: Boolean}}',
     "t.yaml:9: models.chat.tasks.t.output.bad-name: a field name must be a PLC identifier"),
    ('prompt: "{A}"\ninputs: {A: {type: String}}\noutput: {A: {type: Boolean}}',
     "models.chat.tasks.t.output.A: 'A' is both an input and an output field"),
    ('prompt: "{A}"\ninputs: {A: {type: String}}\noutput: {B: {type: Boolean}}\nmax_tokens: 600',
     "t.yaml:10: models.chat.tasks.t.max_tokens: expected an integer <= engine.max_new_tokens (512), got 600"),
    ('prompt: "{A}"\ninputs: {A: {type: String, max_length: 16382}}\noutput: {B: {type: Boolean}}',
     "t.yaml:8: models.chat.tasks.t.inputs: the prompt with every input at its max_length may take"),
    ('prompt: "{A}"\ninputs: {A: {type: String}}\noutput: {B: {type: String}, C: {type: String}, '
     'D: {type: String}}',
     "t.yaml:9: models.chat.tasks.t.output: the longest answer may take"),
])
def test_a_bad_task_is_refused_with_file_line_and_key(body, expected):
    problems = errors(with_task(body))
    assert any(p.startswith(expected) or expected in p for p in problems), problems


def test_tasks_belong_to_generative_models_and_a_mailbox_names_one_of_its_models_tasks():
    problems = errors("models:\n  te:\n    kind: tensor\n    path: builtin:te-classifier\n    tasks: {}\n")
    assert problems == ["t.yaml:5: models.te.tasks: tasks applies to generative models only (this model is kind "
                        "tensor)"]
    problems = errors(GOOD.replace("hmi: {model: chat, task: triage}", "hmi: {model: chat, task: triag}"))
    assert problems == ["t.yaml:20: mailboxes.hmi.task: expected a task of model 'chat' (triage), got 'triag'"]
    problems = errors(GOOD.replace("hmi: {model: chat, task: triage}",
                                   "hmi: {model: chat, task: triage, max_tokens: 8}"))
    assert problems == ["t.yaml:20: mailboxes.hmi.max_tokens: a task's mailbox runs the task with the task's own "
                        "max_tokens (models.chat.tasks.triage.max_tokens)"]


def _word_level_model(directory):
    """A model directory whose tokenizer knows whole words only (no byte fallback): it cannot spell 'überdruck'."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {"[UNK]": 0, '"': 1, "low": 2, "high": 3, "<|im_end|>": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split('"', behavior="isolated")
    tok.decoder = decoders.Fuse()  # tokens read back side by side
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (directory / "config.json").write_text("{}")
    return directory


def test_check_config_refuses_an_enum_the_tokenizer_cannot_spell(tmp_path, capsys):
    _word_level_model(tmp_path / "words")
    text = ("models:\n  chat:\n    kind: generative\n    path: words\n    tasks:\n      t:\n"
            "        prompt: \"{A}\"\n        inputs: {A: {type: String}}\n"
            "        output:\n          Level:\n            type: enum\n            values: [low, überdruck, high]\n")
    (tmp_path / "a.yaml").write_text(text)
    load_config(tmp_path / "a.yaml")  # serving does not read the tokenizer here: the engine loads it with the model
    assert main(["check-config", str(tmp_path / "a.yaml")]) == 2
    err = capsys.readouterr().err
    assert (f"{tmp_path / 'a.yaml'}:12: models.chat.tasks.t.output.Level.values[1]: the model's tokenizer cannot "
            "spell 'überdruck'") in err
    assert "values[0]" not in err and "values[2]" not in err  # what it can spell passes
    (tmp_path / "a.yaml").write_text(text.replace("überdruck, ", ""))
    assert main(["check-config", str(tmp_path / "a.yaml")]) == 0


def test_an_answer_is_read_back_typed_and_checked_again():
    task = load_config_text(GOOD).models["chat"].tasks["triage"]
    doc = {"Severity": "high", "StopLine": True, "Code": 7, "Temperature": 80.5}
    assert read_answer(task, json.dumps(doc)) == {**doc, "Reason": ""}
    for bad in ({**doc, "Severity": "urgent"}, {**doc, "Code": 100}, {**doc, "Code": 1.5}, {**doc, "StopLine": 1},
                {**doc, "Extra": 1}, {k: v for k, v in doc.items() if k != "Code"}, {**doc, "Reason": "x" * 81},
                {**doc, "Temperature": 300}):
        with pytest.raises(AnswerInvalid):
            read_answer(task, json.dumps(bad))
    with pytest.raises(AnswerInvalid):
        read_answer(task, '{"Severity": "high"')
