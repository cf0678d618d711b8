"""Deploy and rollback as the command line runs them: a version of a model is switched in only once it has loaded,
first in a worker process of its own (workers/trial.py, the serving code and the configuration's settings) and
then, when the appliance runs, in its serving worker (Admin/ReloadModel over OPC UA on loopback, through the
store's `candidate` link); a version that fails either is withdrawn and `current` never named it, so no restart
loads it. The versions on disk are appliance/model_store.py's.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from asyncua import ua

from .client import AdminUnreachable, call_admin
from .device import resolve_device
from .model_specs import model_spec
from .model_store import ModelStore
from .workers.trial import LoadFailed, trial_load, trial_policy


@dataclass(frozen=True)
class ReloadResult:
    done: bool
    message: str
    running: bool = True  # False: no appliance runs here (nothing to reload)


def request_reload(config, name: str, timeout_s: float = 600.0) -> ReloadResult:
    """Ask the running appliance on this box to reload the model (its candidate version while a deploy checks one,
    else `current`): Admin/ReloadModel over OPC UA on loopback, as the box's commissioning engineer (a certificate
    the local CA issues once, like `appliance call`'s commissioning operator)."""
    try:
        r = call_admin(config, "ReloadModel", [ua.Variant(name, ua.VariantType.String)], timeout_s)
    except AdminUnreachable as e:
        if e.reason == "no_pki":
            return ReloadResult(False, "the appliance has no PKI yet (never started): the version serves from its "
                                       "first start", running=False)
        return ReloadResult(False, "the appliance is not running: the version serves from its next start",
                            running=False)
    except (TimeoutError, OSError) as e:
        return ReloadResult(False, f"ReloadModel did not answer ({type(e).__name__})")
    if r.StatusCode.is_good():
        return ReloadResult(True, f"the appliance now serves version {r.OutputArguments[0].Value}")
    reason = getattr(r, "status_text", "")
    if reason:
        return ReloadResult(False, f"ReloadModel answered {r.StatusCode.name}: {reason}")
    return ReloadResult(False, f"ReloadModel answered {r.StatusCode.name} (the reason is in the appliance's log and "
                               "audit log)")


@dataclass(frozen=True)
class SwitchResult:
    ok: bool
    message: str  # what happened, for the engineer: the reason when the version was refused


def switch_checked(config, name: str, version: str, created: bool, trial_timeout_s: float = 600.0) -> SwitchResult:
    """Make `version` of model `name` serve, only once it has loaded: first in a worker process of its own (the
    serving code, the configuration's settings), then, when the appliance runs, in its serving worker through the
    `candidate` link. Either failing, the version is withdrawn (its copy removed when `created`) and the old one
    serves on, now and after any restart."""
    store = ModelStore(Path(config.server.state_dir))
    model = config.models[name]
    serving = store.serving_version(name)
    before = f"version {serving}" if serving else "the model of the configuration"
    spec = model_spec(model, config.engine, resolve_device(config.engine.device).split(" ")[0],
                      Path(config.server.state_dir), version=version)
    try:
        if spec.refused:
            raise LoadFailed(spec.refused)
        trial_load(spec, trial_policy(config), trial_timeout_s)
        store.propose(name, version)
        reload = request_reload(config, name)
        if reload.running and not reload.done:
            raise LoadFailed(f"the running appliance could not load it: {reload.message}")
    except LoadFailed as e:
        store.withdraw(name, version, remove=created)
        return SwitchResult(False, f"version {version} was not switched in, it does not load: {e}; {before} "
                                   "serves on" + (" (the rejected copy is deleted)" if created else ""))
    except BaseException:
        store.withdraw(name, version, remove=False)  # interrupted: `current` never changed
        raise
    store.switch(name, version, keep=model.keep_versions)
    return SwitchResult(True, ("reloaded: " if reload.done else "not reloaded: ") + reload.message)
