"""New model and security keys: labels (inline or a file beside the model), alarm_classes, drift, rate_limits.
Every mistake is reported with its file, line and key, like the rest of the configuration."""
from __future__ import annotations

import shutil

import pytest
from test_config import errors_of, load  # the same helpers: file t.yaml, every error placed

from core.config import RateLimit, demo_config
from models.te_classifier import ONNX_PATH


def te(extra: str, path: str = "builtin:te-classifier") -> str:
    return f"models:\n  te:\n    kind: tensor\n    path: {path}\n" + extra  # extra keys start on line 5


LABELS_22 = "[" + ", ".join(["normal"] + [f"f{i}" for i in range(1, 22)]) + "]"


def test_the_demo_classifier_has_its_22_labels_the_detectable_faults_as_alarm_classes_and_drift_on():
    model = demo_config().models["te-classifier"]
    assert len(model.labels) == 22 and model.labels[0] == "normal"
    assert model.labels[1].startswith("IDV1 ") and model.labels[21].startswith("IDV21 ")
    # every fault but IDV3, IDV9 and IDV15, which the classifier cannot tell from normal operation
    assert model.alarm_class_indices == [c for c in range(1, 22) if c not in (3, 9, 15)]
    assert model.alarm_confidence == 0.5 and (model.alarm_on_results, model.alarm_off_results) == (3, 3)
    assert model.drift.window == 100 and model.drift.test == "ks" and model.drift.threshold == 2.0
    assert model.drift_reference_path == ONNX_PATH.with_name("te_classifier.drift.json")


def test_labels_inline_and_alarm_classes_by_label_or_index():
    model = load(te(f"    labels: {LABELS_22}\n    alarm_classes: [f3, 4]\n    alarm_confidence: 0.9\n")).models["te"]
    assert model.labels[3] == "f3" and model.alarm_class_indices == [3, 4] and model.alarm_confidence == 0.9


def test_a_labels_file_is_read_beside_the_model_skipping_comments_and_blank_lines(tmp_path):
    shutil.copy(ONNX_PATH, tmp_path / "m.onnx")
    (tmp_path / "classes.txt").write_text("# header\n" + "\n".join(f"c{i}" for i in range(22)) + "\n\n")
    model = load(te("    labels: classes.txt\n", path="m.onnx"), base_dir=tmp_path).models["te"]
    assert model.labels == [f"c{i}" for i in range(22)]


def test_a_label_count_that_differs_from_the_models_output_width_is_refused_on_the_labels_line():
    (error,) = errors_of(te("    labels: [normal, fault]\n"))
    assert error == ("t.yaml:5: models.te.labels: 2 labels, but the model answers 22 values per sample: give one "
                     "label per output")


@pytest.mark.parametrize("content", [b"not a model", b""], ids=["not-protobuf", "empty-graph"])
def test_a_model_file_that_cannot_be_read_is_left_to_the_engine(tmp_path, content):
    """Labels and max_samples need the file's shapes: a file that is no ONNX model skips those checks (the engine
    reports the model Failed with the reason when it loads it) instead of failing the configuration."""
    (tmp_path / "m.onnx").write_bytes(content)
    model = load(te("    labels: [normal, fault]\n", path="m.onnx"), base_dir=tmp_path).models["te"]
    assert model.labels == ["normal", "fault"]


@pytest.mark.parametrize("content, why", [
    ("", "it holds no label"),
    ("a\nb\na\n", "'a' is listed twice"),
    ("x" * 65 + "\n", "is not 1-64 printable characters"),
])
def test_a_bad_labels_file_is_named_with_the_reason(tmp_path, content, why):
    shutil.copy(ONNX_PATH, tmp_path / "m.onnx")
    (tmp_path / "l.txt").write_text(content)
    (error,) = errors_of(te("    labels: l.txt\n", path="m.onnx"), base_dir=tmp_path)
    assert error.startswith(f"t.yaml:5: models.te.labels: labels file {tmp_path / 'l.txt'}: ") and why in error


def test_a_missing_labels_file_is_reported(tmp_path):
    shutil.copy(ONNX_PATH, tmp_path / "m.onnx")
    (error,) = errors_of(te("    labels: nope.txt\n", path="m.onnx"), base_dir=tmp_path)
    assert error.startswith("t.yaml:5: models.te.labels: cannot read the labels file ") and "nope.txt" in error


@pytest.mark.parametrize("extra, expected", [
    ("    alarm_classes: [3]\n", ["t.yaml:5: models.te.alarm_classes: alarm_classes needs labels"]),
    (f"    labels: {LABELS_22}\n    alarm_classes: [22, f99]\n",
     ["t.yaml:6: models.te.alarm_classes[0]: class index 22 is out of range: the model has 22 labels (0..21)",
      "t.yaml:6: models.te.alarm_classes[1]: 'f99' is not one of the labels; did you mean 'f9'?"]),
    ("    labels: [a, a]\n", ["t.yaml:5: models.te.labels[1]: 'a' is listed twice (first on line 5)"]),
    ("    labels: [a, a]\n    alarm_classes: [a]\n",  # one error: the labels' own
     ["t.yaml:5: models.te.labels[1]: 'a' is listed twice (first on line 5)"]),
    ("    alarm_confidence: 0\n", ["t.yaml:5: models.te.alarm_confidence: expected a number in (0, 1], got 0"]),
    ("    drift: {window: 5, test: chi2}\n",
     ["t.yaml:5: models.te.drift.test: expected one of psi, ks, got 'chi2'",
      "t.yaml:5: models.te.drift.window: expected an integer in [10, 1000000], got 5"]),
    ("    keep_versions: 1\n", ["t.yaml:5: models.te.keep_versions: expected an integer in [2, 1000], got 1"]),
    ("    drift: {windw: 50}\n",
     ["t.yaml:5: models.te.drift.windw: unknown key 'windw' in models.te.drift; did you mean 'window'? valid keys: "
      "window, test, threshold, adwin_delta, reference"]),
])
def test_classifier_key_mistakes_carry_line_and_key(extra, expected):
    assert sorted(errors_of(te(extra))) == sorted(expected)


def test_classifier_keys_belong_to_tensor_models_only():
    text = "models:\n  chat:\n    kind: generative\n    path: builtin:smollm2\n    labels: [a]\n    drift: null\n"
    assert errors_of(text) == [
        "t.yaml:5: models.chat.labels: labels applies to tensor models only (this model is kind generative)",
        "t.yaml:6: models.chat.drift: drift applies to tensor models only (this model is kind generative)"]


def test_rate_limits_per_role_and_per_client_default_to_none_and_are_checked():
    cfg = load(te(""))
    limits = cfg.security.rate_limits
    assert (limits.monitor, limits.operator, limits.engineer, limits.per_client) == (None, None, None, None)
    cfg = load("security:\n  rate_limits:\n    operator: {calls_per_s: 2.5, burst: 5}\n    per_client: null\n"
               + te(""))
    assert cfg.security.rate_limits.operator == RateLimit(calls_per_s=2.5, burst=5)
    errors = errors_of("security:\n  rate_limits:\n    operator: {calls_per_s: -1}\n    admin: {}\n" + te(""))
    assert sorted(errors) == [
        "t.yaml:3: security.rate_limits.operator.burst: missing required key 'burst': expected an integer in "
        "[1, 1000000]",
        "t.yaml:3: security.rate_limits.operator.calls_per_s: expected a number in (0, 1000000], got -1",
        "t.yaml:4: security.rate_limits.admin: unknown key 'admin' in security.rate_limits; valid keys: monitor, "
        "operator, engineer, security_admin, per_client"]
