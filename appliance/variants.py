"""A/B variants of a model: a stable split of callers by a hash of their identity, and promotion of one variant.

A caller's identity (client certificate + user, as for jobs and rate limits) hashed with the model's name gives a
number in [0, 100): the first variant whose cumulative weight exceeds it serves the caller, every time (sticky), and
the model's own path (variant "main") serves what the weights leave. Adding the model's name to the hash keeps the
splits of two models independent. A promotion (Admin/PromoteVariant) sends every caller to one variant at once; it
is kept in `state_dir/variants.json`, so it survives a restart, until the next promotion (an empty name restores
the configured split).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from core.config import MAIN_VARIANT

log = logging.getLogger(__name__)


def bucket(identity: str, model: str) -> float:
    """The caller's place in [0, 100) for this model: 64 bits of SHA-256, so uniform and stable across restarts."""
    digest = hashlib.sha256(f"{model}\0{identity}".encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64 * 100.0


def choose(identity: str, model: str, weights: dict[str, float]) -> str:
    """The variant that serves this caller: weights are percents in file order; MAIN_VARIANT gets the rest."""
    x, edge = bucket(identity, model), 0.0
    for name, weight in weights.items():
        edge += weight
        if x < edge:
            return name
    return MAIN_VARIANT


class Promotions:
    """Which variant each model's traffic was promoted to (absent: the configured split), kept on disk."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._promoted: dict[str, str] = {}
        try:
            data = json.loads(self.path.read_text())
            if isinstance(data, dict):
                self._promoted = {str(k): str(v) for k, v in data.items()}
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as e:
            log.error("cannot read %s (%s): every model serves its configured split", self.path.name, e)

    def get(self, model: str) -> str | None:
        return self._promoted.get(model)

    def set(self, model: str, variant: str | None) -> None:
        """Promote (or restore the split with None); written atomically before it takes effect."""
        promoted = dict(self._promoted)
        if variant:
            promoted[model] = variant
        else:
            promoted.pop(model, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as fh:
            json.dump(promoted, fh, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        self._promoted = promoted


class VariantRouter:
    """Which variant answers a caller (core.services.VariantRouting; the daemon builds one): the promoted one, else
    the caller's sticky share of the configured weights. The caller's identity comes down with the question; the
    variant's name goes back."""

    def __init__(self, weights: dict[str, dict[str, float]], promotions: Promotions):
        self.weights = weights  # model -> {variant -> percent}, file order; models without variants absent
        self.promotions = promotions

    @classmethod
    def for_config(cls, config) -> "VariantRouter":
        weights = {name: {v: c.weight for v, c in m.variants.items()} for name, m in config.models.items()
                   if m.variants}
        return cls(weights, Promotions(Path(config.server.state_dir) / "variants.json"))

    def variants(self, model: str) -> tuple[str, ...]:
        return tuple(self.weights.get(model, ()))

    def variant_for(self, model: str, identity: str) -> str:
        return self.promotions.get(model) or choose(identity, model, self.weights[model])

    def promote(self, model: str, variant: str | None) -> None:
        self.promotions.set(model, variant)


def request_promote(config, model: str, variant: str, timeout_s: float = 30.0) -> tuple[bool, str]:
    """`appliance models promote`: Admin/PromoteVariant over OPC UA on loopback as the box's commissioning engineer
    (the certificate `appliance models deploy` uses). (done, what happened)."""
    from asyncua import ua

    from .client import AdminUnreachable, call_admin

    try:
        r = call_admin(config, "PromoteVariant", [ua.Variant(model, ua.VariantType.String),
                                                  ua.Variant(variant, ua.VariantType.String)], timeout_s)
    except AdminUnreachable as e:
        return False, ("the appliance has no PKI yet (never started)" if e.reason == "no_pki"
                       else "the appliance is not running")
    if r.StatusCode.is_good():
        return True, (f"all traffic of {model} now goes to variant {variant}" if variant
                      else f"{model} serves its configured split again")
    return False, f"PromoteVariant answered {r.StatusCode.name}"
