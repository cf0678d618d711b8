"""Classify and classifier alarms, from a tensor model's probabilities: engine- and server-independent.

`Classify(Input) -> (ClassIndex[], Label[], Confidence[], ModelVersion)` is Infer's output read as one probability
vector per sample (CONTRACT.md): the arg-max class, its label and its probability.

Class alarms are debounced and kept per source. A source is a mailbox or a caller identity that the model's YAML
`alarm_sources` names; every other caller is source `default`. Within a source, each result (one sample) either
shows an alarm class (predicted with at least `alarm_confidence`) or not; the class's alarm turns on after
`alarm_on_results` consecutive results showing it and off after `alarm_off_results` consecutive results without
it. A classifier's isolated false alarms (1.3 % of normal windows for the demo's) therefore raise nothing, and two
lines feeding one model never clear each other's alarms. `Alarms/<label>` is true while any source has it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

DEFAULT_SOURCE = "default"


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
    """One source's alarm classes, debounced: `update` answers what the latest result raised and cleared."""

    alarm_classes: list[int]
    threshold: float
    on_results: int = 3
    off_results: int = 3
    active: set[int] = field(default_factory=set)
    _shown: dict[int, int] = field(default_factory=dict)  # class -> consecutive results showing it
    _missing: dict[int, int] = field(default_factory=dict)  # class -> consecutive results without it

    def update(self, result: Classified) -> tuple[set[int], set[int]]:
        before = set(self.active)
        for c, p in zip(result.class_index, result.confidence):
            shown = c if c in self.alarm_classes and p >= self.threshold else None
            for a in self.alarm_classes:
                if a == shown:
                    self._shown[a] = self._shown.get(a, 0) + 1
                    self._missing[a] = 0
                    if self._shown[a] >= self.on_results:
                        self.active.add(a)
                else:
                    self._missing[a] = self._missing.get(a, 0) + 1
                    self._shown[a] = 0
                    if self._missing[a] >= self.off_results:
                        self.active.discard(a)
        return self.active - before, before - self.active


@dataclass(frozen=True)
class SourceUpdate:
    """What one result did: its classification, and the alarm classes it raised and cleared for its source and in
    the model's aggregate (`Alarms/<label>`: on while any source has it)."""
    result: Classified
    source: str
    raised: set[int]
    cleared: set[int]
    any_raised: set[int]
    any_cleared: set[int]


class ClassifierState:
    """One labelled model's classification of each result and its class alarms per source (the serve process keeps
    one). sources: source name -> a mailbox name, or an identity ('user:NAME', 'x509:THUMBPRINT')."""

    def __init__(self, labels: list[str], alarm_classes: list[int], threshold: float, on_results: int = 3,
                 off_results: int = 3, sources: dict[str, str] | None = None):
        self.labels = list(labels)
        self.alarm_classes = list(alarm_classes)
        sources = dict(sources or {})
        self._by_mailbox = {v: name for name, v in sources.items() if not _is_identity(v)}
        self._by_identity = {v: name for name, v in sources.items() if _is_identity(v)}
        self.sources = [DEFAULT_SOURCE, *sources]
        self.alarms = {s: ClassAlarms(list(alarm_classes), threshold, on_results, off_results) for s in self.sources}
        self.last: dict[str, Classified] = {}  # source -> its latest result

    def source_of(self, *, mailbox: str | None = None, identity: str | None = None) -> str:
        """The source a result belongs to: a named mailbox, a named identity, else `default`."""
        if mailbox is not None and mailbox in self._by_mailbox:
            return self._by_mailbox[mailbox]
        if identity is not None and identity in self._by_identity:
            return self._by_identity[identity]
        return DEFAULT_SOURCE

    def active(self, source: str | None = None) -> set[int]:
        """The classes active for a source, or for any source."""
        if source is not None:
            return set(self.alarms[source].active)
        return set().union(*(a.active for a in self.alarms.values()))

    def update(self, output, source: str = DEFAULT_SOURCE) -> SourceUpdate:
        result = classify(output, self.labels)
        any_before = self.active()
        raised, cleared = self.alarms[source].update(result)
        self.last[source] = result
        any_after = self.active()
        return SourceUpdate(result, source, raised, cleared, any_after - any_before, any_before - any_after)


def classifier_states(config) -> dict[str, ClassifierState]:
    """A ClassifierState for each tensor model with labels (what the daemon hands the UA server's alarms)."""
    return {name: ClassifierState(m.labels, m.alarm_class_indices, m.alarm_confidence, m.alarm_on_results,
                                  m.alarm_off_results, m.alarm_sources)
            for name, m in config.models.items() if m.kind == "tensor" and m.labels}


def _is_identity(value: str) -> bool:
    return value.startswith(("user:", "x509:"))
