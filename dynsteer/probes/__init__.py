"""Linear probes on the residual stream: collect activations from vLLM, fit, evaluate, calibrate, export.

A probe trained here is a ``(w, b)`` pair on one ``(layer, site)``; it is saved in the probe file format
(architecture §7) and maps exactly onto the in-graph gate (architecture §4, :func:`gate_params`).

Example:
    >>> from dynsteer.probes import LogisticProbe, collect, layer_sweep     # doctest: +SKIP
    >>> acts = collect(steerer, sentences, labels, layers=range(4, 30, 2))  # doctest: +SKIP
    >>> sweep = layer_sweep(acts, LogisticProbe)                            # doctest: +SKIP
    >>> print(sweep.table())                                                # doctest: +SKIP
"""

from dynsteer._deprecated import renamed
from dynsteer.probes.collect import Activations, align, chat_prompts, collect, collect_generated
from dynsteer.probes.estimators import DiffMeanProbe, LDAProbe, LinearProbe, LogisticProbe
from dynsteer.probes.latch import LatchCalibration, calibrate_ema_latch, ema_peaks
from dynsteer.probefile.fileformat import PROBE_FILE_FORMAT, Calibration, Probe, ProbeMeta, load_probe, save_probe
from dynsteer.probefile.gate import GateParams, gate, gate_logit, gate_params
from dynsteer.probes.metrics import (CalibrationWarning, LayerScore, LayerSweepResult, accuracy, auroc, calibrate,
                                     calibrate_threshold, calibration_curve, fpr_at, fpr_interval, layer_sweep,
                                     recall_at, recall_at_fpr)

__all__ = ["Activations", "Calibration", "CalibrationWarning", "DiffMeanProbe", "GateParams", "LDAProbe",
           "LatchCalibration", "LayerScore", "LayerSweepResult", "LinearProbe", "LogisticProbe", "PROBE_FILE_FORMAT",
           "Probe", "ProbeMeta", "accuracy", "align", "auroc", "calibrate", "calibrate_ema_latch",
           "calibrate_threshold", "calibration_curve", "chat_prompts", "collect", "collect_generated", "ema_peaks",
           "fpr_at", "fpr_interval", "gate", "gate_logit", "gate_params", "layer_sweep", "load_probe", "recall_at",
           "recall_at_fpr", "save_probe"]

# Old name kept for one release (``dynsteer.sweep.SweepResult`` is a sweep run's result).
__getattr__ = renamed(__name__, {"SweepResult": ("LayerSweepResult", LayerSweepResult)})
