"""The probe file format now lives in :mod:`dynsteer.probefile.fileformat`; this path stays for code that imported
it (``examples/safety_monitor.py`` did)."""

from dynsteer.probefile.fileformat import PROBE_FILE_FORMAT, Calibration, Probe, ProbeMeta, load_probe, save_probe

__all__ = ["Calibration", "PROBE_FILE_FORMAT", "Probe", "ProbeMeta", "load_probe", "save_probe"]
