"""``dynsteer probe train|eval``: the probes module from the shell (activations in, a probe file and a report out).

``train`` chooses the layer by cross-validation on a training split (:func:`dynsteer.probes.layer_sweep`), reports
every layer on the held-out rest, calibrates a threshold at a target FPR on the held-out split
(:func:`dynsteer.probes.calibrate`) and writes the probe file. ``eval`` scores a probe file on (other) labelled
activations. Both print a table and can write the figures as JSON (``--report``).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Optional

import numpy as np
import typer

probe_app = typer.Typer(help="Train and evaluate linear probes on captured activations.", no_args_is_help=True)

METHODS = {"logistic": "LogisticProbe", "diffmean": "DiffMeanProbe", "lda": "LDAProbe"}


def load_input(source: Path, labels: Optional[Path], site: Optional[str], reduce: str,
               model_id: Optional[str]) -> Any:
    """An activations file (``.npz``) or a capture folder with a labels CSV."""
    from dynsteer.probes.io import activations_from_captures, load_activations, read_labels

    if not source.exists():
        raise typer.BadParameter(f"{source} does not exist", param_hint="ACTIVATIONS")
    try:
        if source.is_dir():
            acts = activations_from_captures(source, None if labels is None else read_labels(labels), site=site,
                                             reduce=reduce, model_id=model_id or "")
        else:
            acts = load_activations(source)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="ACTIVATIONS") from None
    if model_id:
        acts.model_id = model_id
    if acts.y is None:
        raise typer.BadParameter("the activations have no labels (a capture folder needs --labels tags.csv)",
                                 param_hint="ACTIVATIONS")
    if set(np.unique(acts.y).tolist()) - {0, 1}:
        raise typer.BadParameter(f"labels must be 0/1, got {sorted(np.unique(acts.y).tolist())}",
                                 param_hint="ACTIVATIONS")
    return acts


def _write(report: Optional[Path], record: dict[str, Any]) -> None:
    if report is not None:
        report.write_text(json.dumps(record, indent=2) + "\n")


_SOURCE = typer.Argument(..., help="activations file (.npz from dynsteer.probes.io.save_activations) or a capture "
                                   "folder (filesystem consumer root)")
_LABELS = typer.Option(None, help="capture folder: CSV of tag,label (0/1)")
_SITE = typer.Option(None, help="capture folder: the site to read when captures hold several")
_REDUCE = typer.Option("last", help="capture folder: one row per request from its last position or the mean")


@probe_app.command()
def train(
    source: Path = _SOURCE,
    out: Path = typer.Option(..., "--out", "-o", help="probe file to write (.safetensors)"),
    labels: Optional[Path] = _LABELS,
    site: Optional[str] = _SITE,
    reduce: str = _REDUCE,
    layer: Optional[list[int]] = typer.Option(None, "--layer", help="only these layers (repeatable; default: all)"),
    method: str = typer.Option("logistic", help="logistic | diffmean | lda"),
    target_fpr: float = typer.Option(0.05, help="calibrate the threshold to this FPR on the held-out split"),
    test_size: float = typer.Option(0.3, help="held-out fraction (never used to choose the layer)"),
    cv: int = typer.Option(5, help="cross-validation folds on the training split"),
    seed: int = typer.Option(0, help="split seed"),
    model_id: Optional[str] = typer.Option(None, help="model id recorded in the probe file (default: the data's)"),
    report: Optional[Path] = typer.Option(None, help="write the figures as JSON here"),
) -> None:
    """Fit a probe per layer, choose the layer by CV, calibrate on held-out data, write the probe file."""
    from rich.console import Console

    from dynsteer.probes import estimators
    from dynsteer.probes.collect import Activations
    from dynsteer.probefile.fileformat import save_probe
    from dynsteer.probes.metrics import calibrate, layer_sweep, recall_at

    if method not in METHODS:
        raise typer.BadParameter(f"choose one of {', '.join(METHODS)}", param_hint="--method")
    acts = load_input(source, labels, site, reduce, model_id)
    if layer:
        missing = sorted(set(layer) - set(acts.X))
        if missing:
            raise typer.BadParameter(f"layers {missing} are not in the data (it has {acts.layers})",
                                     param_hint="--layer")
        acts = Activations(X={k: acts.X[k] for k in layer}, y=acts.y, site=acts.site, model_id=acts.model_id,
                           hidden_size=acts.hidden_size, positions=acts.positions, n_positions=acts.n_positions)
    console = Console()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            sweep = layer_sweep(acts, getattr(estimators, METHODS[method]), test_size=test_size, seed=seed, cv=cv)
            best = sweep.best_layer
            y_test = np.asarray(acts.y)[sweep.test_idx]
            cal = calibrate(sweep.test_scores[best], y_test, target_fpr)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="ACTIVATIONS") from None
    save_probe(out, sweep.estimators[best], model_id=acts.model_id, layer=best, site=acts.site, calibration=cal,
               extra={"trained_on": Path(source).name, "n_train": str(len(sweep.train_idx))})
    console.print(sweep.table())
    s = sweep.scores[best]
    recall = recall_at(sweep.test_scores[best], y_test, cal.threshold)
    lo, hi = cal.fpr_interval or (float("nan"), float("nan"))
    console.print(f"chosen layer {best} ({acts.site}): cv AUROC {s.cv_auroc_mean:.4f} ± {s.cv_auroc_std:.4f} on "
                  f"{len(sweep.train_idx)} training samples; held-out AUROC {s.auroc:.4f} on {len(sweep.test_idx)}")
    console.print(f"threshold {cal.threshold:.4g} at target FPR {target_fpr:g}: held-out FPR {cal.fpr:.3f} "
                  f"(95 % interval [{lo:.3f}, {hi:.3f}], {cal.n_negatives} negatives), recall {recall:.3f}")
    for w in caught:
        console.print(f"[yellow]warning:[/yellow] {w.message}")
    console.print(f"wrote {out}")
    _write(report, {"probe": str(out), "method": method, "site": acts.site, "model_id": acts.model_id,
                    "layer": best, "separable": sweep.separable, "n_train": int(len(sweep.train_idx)),
                    "n_test": int(len(sweep.test_idx)),
                    "layers": {str(k): vars(v) for k, v in sorted(sweep.scores.items())},
                    "calibration": cal.model_dump(mode="json"), "recall_at_threshold": recall,
                    "warnings": [str(w.message) for w in caught]})


@probe_app.command("eval")
def evaluate(
    probe_file: Path = typer.Argument(..., help="probe file (.safetensors)"),
    source: Path = _SOURCE,
    labels: Optional[Path] = _LABELS,
    site: Optional[str] = _SITE,
    reduce: str = _REDUCE,
    report: Optional[Path] = typer.Option(None, help="write the figures as JSON here"),
) -> None:
    """Score a probe file on labelled activations: AUROC, accuracy, FPR and recall at its threshold."""
    from rich.console import Console
    from rich.table import Table

    from dynsteer.probefile.fileformat import load_probe
    from dynsteer.probes.metrics import accuracy, auroc, fpr_at, fpr_interval, recall_at

    try:
        probe = load_probe(probe_file)
    except (ValueError, OSError) as exc:
        raise typer.BadParameter(str(exc), param_hint="PROBE_FILE") from None
    acts = load_input(source, labels, site or probe.site, reduce, None)
    if probe.layer not in acts.X:
        raise typer.BadParameter(f"the probe reads layer {probe.layer}; the data has layers {acts.layers}",
                                 param_hint="ACTIVATIONS")
    if acts.site != probe.site:
        raise typer.BadParameter(f"the probe reads site {probe.site!r}; the data is at {acts.site!r}",
                                 param_hint="ACTIVATIONS")
    X, y = acts.X[probe.layer], np.asarray(acts.y)
    if X.shape[1] != probe.meta.hidden_size:
        raise typer.BadParameter(f"the probe has hidden size {probe.meta.hidden_size}; the data {X.shape[1]}",
                                 param_hint="ACTIVATIONS")
    scores = probe.decision_function(X)
    threshold = probe.meta.calibration.threshold if probe.meta.calibration is not None else 0.0
    negatives = int(np.sum(y == 0))
    fp = int(np.sum(scores[y == 0] > threshold))
    lo, hi = fpr_interval(fp, negatives)
    record = {"probe": str(probe_file), "layer": probe.layer, "site": probe.site, "n": int(len(y)),
              "n_negatives": negatives, "auroc": auroc(y, scores) if len(np.unique(y)) == 2 else None,
              "threshold": threshold, "calibrated": probe.meta.calibration is not None,
              "accuracy": accuracy(y, probe.predict(X)), "fpr": fpr_at(scores, y, threshold),
              "fpr_interval": [lo, hi], "recall": recall_at(scores, y, threshold)}
    if probe.meta.calibration is not None:
        record["target_fpr"] = probe.meta.calibration.target_fpr
    table = Table(title=f"{probe_file.name}: layer {probe.layer} ({probe.site}) on {len(y)} samples")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in ("auroc", "accuracy", "threshold", "fpr", "recall"):
        value = record[key]
        table.add_row(key, "n/a" if value is None else f"{value:.4f}")
    table.add_row("fpr 95 % interval", f"[{lo:.3f}, {hi:.3f}] ({negatives} negatives)")
    Console().print(table)
    _write(report, record)
