"""Names renamed by issue 40 still work for one release: the old name is the new object, and looking it up warns."""

from __future__ import annotations

import importlib
import warnings

import numpy as np
import pytest

from dynsteer import Action, DynamicSteeringPolicy, ProbeGate, Rule

RENAMED = [("dynsteer", "Monitor", "ProbeGate"), ("dynsteer.policy", "Monitor", "ProbeGate"),
           ("dynsteer.monitor", "Monitor", "MonitorClient"), ("dynsteer.monitor.client", "Monitor", "MonitorClient"),
           ("dynsteer.commands", "Ack", "CommandAck"), ("dynsteer.probes", "SweepResult", "LayerSweepResult"),
           ("dynsteer.probes.metrics", "SweepResult", "LayerSweepResult")]


@pytest.mark.parametrize("module,old,new", RENAMED)
def test_old_name_is_the_new_object_and_warns(module: str, old: str, new: str) -> None:
    mod = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=rf"{module}\.{old} is deprecated.*use {module}\.{new}"):
        alias = getattr(mod, old)
    assert alias is getattr(mod, new)
    exported = vars(mod).get("__all__")  # the command schema has none
    assert exported is None or (old not in exported and new in exported)
    with pytest.raises(AttributeError):
        getattr(mod, old + "Nope")


def test_from_import_of_the_old_name_warns() -> None:
    with pytest.warns(DeprecationWarning, match="ProbeGate"):
        from dynsteer import Monitor  # noqa: F401
    with pytest.warns(DeprecationWarning, match="MonitorClient"):
        from dynsteer.monitor import Monitor as Client  # noqa: F401


def test_new_names_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        from dynsteer import ProbeGate as _  # noqa: F401
        from dynsteer.commands import CommandAck  # noqa: F401
        from dynsteer.monitor import MonitorClient  # noqa: F401
        from dynsteer.probes import LayerSweepResult  # noqa: F401


def test_a_gate_built_by_the_old_name_behaves_as_the_new() -> None:
    with pytest.warns(DeprecationWarning):
        from dynsteer import Monitor
    kw = dict(name="m", layer=1, direction=[0.6, 0.8], sharpness=2.0, threshold=0.5)
    old, new = Monitor(**kw), ProbeGate(**kw)
    assert old == new and hash(old) == hash(new) and isinstance(old, ProbeGate)
    assert old.model_dump_json() == new.model_dump_json()
    assert float(old.gate(np.array([3.0, 4.0]))) == float(new.gate(np.array([3.0, 4.0])))
    rules = [Rule(monitor="m", actions=[Action(kind="add", layer=2, vector=[1.0, 0.0])])]
    pol = DynamicSteeringPolicy(monitors=[old], rules=rules)
    assert pol == DynamicSteeringPolicy(monitors=[new], rules=rules)
    assert DynamicSteeringPolicy.from_yaml(pol.to_yaml()) == pol
    with pytest.raises(ValueError):
        Monitor(name="m", layer=1)   # validates as the new name does
