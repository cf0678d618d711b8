"""Settings that contradict each other are refused, and what the address space advertises holds: the demo
classifier's MaxSamples (64) samples of 1,040 floats (66,560 values, beyond security.limits.max_array_length 65,536)
are accepted as Float[] and as Double[], tried as a PLC would over SignAndEncrypt; a max_samples written in the YAML
that does not fit in max_message_size is refused with file, line and key, and the default follows from the limit."""
from __future__ import annotations

import numpy as np
import pytest
from asyncua import ua

from appliance.client import connect
from core.config import ConfigError, load_config_text
from attack_tools import close
from harness import RunningAppliance
from uaclient import arg_statuses, call, read, run, status_name


def test_a_message_size_too_small_for_max_samples_is_refused(tmp_path):
    text = "security:\n  limits:\n    max_message_size: 262144\nmodels:\n  te:\n    kind: tensor\n" \
           "    path: builtin:te-classifier\n    max_samples: 40\n"
    with pytest.raises(ConfigError) as e:
        load_config_text(text, "a.yaml", tmp_path)
    assert "a.yaml:8: models.te.max_samples: 40 samples of 1040 values do not fit" in str(e.value)
    assert "expected at most 31" in str(e.value)
    ok = load_config_text(text.replace("max_samples: 40", "max_samples: 31"), "a.yaml", tmp_path)
    assert ok.models["te"].max_samples == 31
    default = load_config_text(text.replace("    max_samples: 40\n", ""), "a.yaml", tmp_path)
    assert default.models["te"].max_samples == 31  # the default 64 follows from the limits: what fits


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    a = RunningAppliance(tmp_path_factory.mktemp("max_samples") / "state",
                         {"te-classifier": {"kind": "tensor", "path": "builtin:te-classifier"}})
    a.operator = a.issue("plc", "operator")
    yield a
    a.stop()


def test_max_samples_samples_are_always_accepted(app):
    assert app.config.security.limits.max_array_length == 65536

    async def go():
        client = await connect(app.endpoint, *app.operator)
        try:
            most = await read(client, "Models", "te-classifier", "MaxSamples")
            shape = await read(client, "Models", "te-classifier", "InputShape")
            values = np.random.default_rng(0).standard_normal(most * int(np.prod(shape))).tolist()
            as_float = await call(client, "te-classifier", "Infer", [ua.Variant(values, ua.VariantType.Float)])
            as_double = await call(client, "te-classifier", "Infer", [ua.Variant(values, ua.VariantType.Double)])
            extra = values + values[:int(np.prod(shape))]
            too_many = await call(client, "te-classifier", "Infer", [ua.Variant(extra, ua.VariantType.Float)])
            return most, shape, as_float, as_double, too_many
        finally:
            await close(client)

    most, shape, as_float, as_double, too_many = run(go())
    assert most == 64 and list(shape) == [20, 52] and most * 20 * 52 > 65536
    assert status_name(as_float) == "Good" and len(as_float.OutputArguments[0].Value) == 64 * 22
    assert status_name(as_double) == "Good"
    assert status_name(too_many) == "BadInvalidArgument" and arg_statuses(too_many) == ["BadOutOfRange"]
