"""Classify and classifier alarms, from a tensor model's probabilities: engine- and server-independent.

`Classify(Input) -> (ClassIndex[], Label[], Confidence[], ModelVersion)` is Infer's output read as one probability
vector per sample (CONTRACT.md): the arg-max class, its label and its probability. `ClassAlarms` turns each result
into the set of `alarm_classes` that are active (Alarms/<label>): a class is active while the latest result
predicts it for some sample with at least `alarm_confidence`, and clears with the first result that does not.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Classified:
    class_index: list[int]
    label: list[str]
    confidence: list[float]


def classify(output: np.ndarray | list[float], labels: list[str]) -> Classified:
    """Per sample of a flat Infer output (k x len(labels) values): arg-max class, its label, its probability.
    Ties go to the lowest class index (numpy's argmax), as arg-max over Infer's output does."""
    probs = np.asarray(output, dtype=np.float64).reshape(-1, len(labels))
    index = probs.argmax(axis=1)
    return Classified([int(i) for i in index], [labels[i] for i in index],
                      [float(p) for p in probs[np.arange(len(index)), index]])


@dataclass
class ClassAlarms:
    """Which alarm classes are active; `update` answers what was raised and what cleared by the latest result."""

    alarm_classes: list[int]
    threshold: float
    active: set[int] = field(default_factory=set)

    def update(self, result: Classified) -> tuple[set[int], set[int]]:
        now = {c for c, p in zip(result.class_index, result.confidence)
               if c in self.alarm_classes and p >= self.threshold}
        raised, cleared = now - self.active, self.active - now
        self.active = now
        return raised, cleared


class ClassifierState:
    """One labelled model's classification of each result and its class alarms (the serve process keeps one)."""

    def __init__(self, labels: list[str], alarm_classes: list[int], threshold: float):
        self.labels = list(labels)
        self.alarms = ClassAlarms(list(alarm_classes), threshold)

    def update(self, output) -> tuple[Classified, set[int], set[int]]:
        result = classify(output, self.labels)
        raised, cleared = self.alarms.update(result)
        return result, raised, cleared
