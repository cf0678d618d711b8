"""Classify and classifier alarms over the shipped TE classifier on held-out Tennessee Eastman windows."""
from __future__ import annotations

import importlib.util

import numpy as np
import onnxruntime as ort
import pytest

from appliance.classify import ClassAlarms, Classified, ClassifierState, classify
from core.config import demo_config
from models import te_classifier as te

needs_data = pytest.mark.skipif(importlib.util.find_spec("bibmon") is None,
                                reason="Tennessee Eastman data (bibmon==1.2.0) not installed")


@needs_data
def test_classify_on_held_out_windows_equals_argmax_of_infer_and_names_the_labels():
    model = demo_config().models["te-classifier"]
    session = ort.InferenceSession(str(te.ONNX_PATH), providers=["CPUExecutionProvider"])
    x = np.concatenate([te.load_te_test_windows(f)[0][::97] for f in (0, 1, 4, 6, 14)])
    probs = session.run(["probabilities"], {"input": x})[0]
    result = classify(probs.ravel().tolist(), model.labels)  # Infer's flat Float[] output
    assert result.class_index == probs.argmax(axis=1).tolist()
    assert result.label == [model.labels[i] for i in result.class_index]
    assert np.allclose(result.confidence, probs.max(axis=1))
    assert {"normal", "IDV1 A-C feed ratio step", "IDV6 A feed loss"} <= set(result.label)


@needs_data
def test_a_fault_class_raises_its_alarm_and_normal_data_clears_it():
    model = demo_config().models["te-classifier"]
    session = ort.InferenceSession(str(te.ONNX_PATH), providers=["CPUExecutionProvider"])
    alarms = ClassAlarms(model.alarm_class_indices, model.alarm_confidence)
    normal = te.load_te_test_windows(0)[0][:4]
    fault6 = te.load_te_test_windows(6)[0][-4:]  # A feed loss, detected at recall 1.0

    def run(x):
        return alarms.update(classify(session.run(["probabilities"], {"input": x})[0].ravel(), model.labels))

    assert run(normal) == (set(), set()) and alarms.active == set()
    raised, cleared = run(fault6)
    assert raised == {6} and cleared == set() and alarms.active == {6}
    assert run(fault6) == (set(), set())  # stays active, not raised again
    assert run(normal) == (set(), {6}) and alarms.active == set()


def test_a_class_below_the_confidence_threshold_or_not_listed_raises_nothing():
    alarms = ClassAlarms([1, 2], threshold=0.8, on_results=1, off_results=1)
    assert alarms.update(Classified([1], ["a"], [0.79])) == (set(), set())
    assert alarms.update(Classified([3], ["c"], [0.99])) == (set(), set())
    assert alarms.update(Classified([0, 2], ["n", "b"], [0.9, 0.8])) == ({2}, set())


def test_classify_splits_a_flat_output_per_sample_and_breaks_ties_to_the_lowest_class():
    out = classify([0.5, 0.5, 0.0, 0.1, 0.2, 0.7], ["a", "b", "c"])
    assert out == Classified([0, 2], ["a", "c"], [0.5, pytest.approx(0.7)])


def shown(*classes: int) -> Classified:
    return Classified(list(classes), [str(c) for c in classes], [0.9] * len(classes))


def test_an_alarm_turns_on_after_on_results_in_a_row_and_off_after_off_results_without():
    alarms = ClassAlarms([5], threshold=0.5, on_results=3, off_results=2)
    assert alarms.update(shown(5, 5)) == (set(), set())  # two in a row: not yet
    assert alarms.update(shown(0)) == (set(), set())  # the run is broken: counting starts over
    assert alarms.update(shown(5, 5)) == (set(), set())
    assert alarms.update(shown(5)) == ({5}, set())  # the third in a row, across calls
    assert alarms.update(shown(0, 5, 0)) == (set(), set())  # isolated others do not clear it
    assert alarms.update(shown(0)) == (set(), {5})  # the second without it in a row does


def test_each_source_keeps_its_own_alarms_and_the_aggregate_is_any_source():
    state = ClassifierState(["n", "a", "b"], [1, 2], 0.5, on_results=2, off_results=2,
                            sources={"line3": "box3", "line4": "user:s7-line4"})
    assert state.sources == ["default", "line3", "line4"]
    assert state.source_of(mailbox="box3") == "line3" and state.source_of(identity="user:s7-line4") == "line4"
    assert state.source_of(mailbox="other") == state.source_of(identity="user:else") == "default"
    probs = {0: [1, 0, 0], 1: [0, 1, 0]}
    u = state.update(probs[1] * 2, "line3")
    assert (u.raised, u.any_raised) == ({1}, {1})
    u = state.update(probs[0] * 3, "line4")  # another line's normal results clear nothing of line3's
    assert u.cleared == set() and u.any_cleared == set() and state.active("line3") == {1}
    u = state.update(probs[1] * 2, "default")
    assert u.raised == {1} and u.any_raised == set()  # already on for the model
    u = state.update(probs[0] * 2, "line3")
    assert u.cleared == {1} and u.any_cleared == set() and state.active() == {1}  # default still has it
    assert state.last["line3"].class_index == [0, 0] and state.last["default"].class_index == [1, 1]
