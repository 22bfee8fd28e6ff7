"""A trained probe as the engine, policies and monitors read it: the probe file format (:mod:`.fileformat`) and the
logistic-probe ↔ in-graph gate identity (:mod:`.gate`). Training probes is :mod:`dynsteer.probes`, which sits above
the user API (it collects activations through a :class:`dynsteer.Steerer`); this room sits below the engine."""

from dynsteer.probefile.fileformat import PROBE_FILE_FORMAT, Calibration, Probe, ProbeMeta, load_probe, save_probe
from dynsteer.probefile.gate import GateParams, gate, gate_logit, gate_params

__all__ = ["Calibration", "GateParams", "PROBE_FILE_FORMAT", "Probe", "ProbeMeta", "gate", "gate_logit", "gate_params",
           "load_probe", "save_probe"]
