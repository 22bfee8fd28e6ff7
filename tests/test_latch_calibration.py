"""EMA-latch calibration for per-token monitors (dynsteer.probes.latch) against the controller it calibrates."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynsteer.controllers import EMALatch
from dynsteer.controllers.sync import run_controller
from dynsteer.probes import calibrate_ema_latch, ema_peaks

scores = st.lists(st.floats(-20, 20, allow_nan=False, width=32), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(scores, st.floats(0.01, 1.0))
def test_peak_is_where_the_controller_engages(seq, alpha):
    """An EMA latch with on = the reply's peak engages on that reply; a hair above it never does."""
    _, (peak,) = ema_peaks(np.array(seq), np.zeros(len(seq), int), alpha)
    assert max(run_controller(EMALatch(alpha=alpha, on=peak, off=-1e9, scale=1.0), seq)) == 1.0
    above = peak + 1e-9 * max(1.0, abs(peak))
    assert max(run_controller(EMALatch(alpha=alpha, on=above, off=-1e9, scale=1.0), seq)) == 0.0


def test_peaks_follow_rows_per_reply():
    logits = np.array([1.0, 5.0, -3.0, 0.0, 4.0])
    ids, peaks = ema_peaks(logits, np.array([7, 3, 7, 3, 7]), alpha=0.5)
    assert list(ids) == [3, 7]
    # reply 3: 5, then 0.5*0 + 0.5*5 = 2.5; reply 7: 1, -1, 1.5
    assert peaks.tolist() == [5.0, 1.5]


def test_separable_replies_get_a_threshold_between_them():
    rng = np.random.default_rng(0)
    logits, groups, targeted = [], [], []
    for g in range(40):
        hit = g % 2 == 0
        n = int(rng.integers(5, 30))
        logits.append(rng.normal(3.0 if hit else -3.0, 1.0, n))
        groups += [g] * n
        targeted += [hit] * n
    logits = np.concatenate(logits)
    cal = calibrate_ema_latch(logits, np.array(groups), np.array(targeted), alpha=0.1)
    ids, peaks = ema_peaks(logits, np.array(groups), 0.1)
    hit = ids % 2 == 0
    assert cal.recall == 1.0 and cal.specificity == 1.0 and (cal.n_targeted, cal.n_other) == (20, 20)
    assert peaks[~hit].max() < cal.on_logit <= peaks[hit].min()
    assert cal.on == pytest.approx(1.0 / (1.0 + np.exp(-cal.on_logit)))
    # the controller, fed each reply with units converted back (identity here: score = logit), agrees reply by reply
    for g, want in zip(ids, hit):
        seq = logits[np.array(groups) == g].tolist()
        fired = max(run_controller(EMALatch(alpha=0.1, on=cal.on_logit, off=-1e9, scale=1.0), seq)) > 0
        assert fired == want


def test_overlap_is_cut_where_the_worse_of_recall_and_specificity_is_best():
    # peaks 0..9 for the others, 5..14 for the targeted (alpha 1: a reply's peak is its largest score): cutting at
    # 6.5 or 7.5 misclassifies 3 of one kind and 2 of the other; nothing does better than min = 0.7
    logits = np.concatenate([np.arange(10.0), np.arange(5.0, 15.0)])
    cal = calibrate_ema_latch(logits, np.arange(20), np.arange(20) >= 10, alpha=1.0)
    assert min(cal.recall, cal.specificity) == pytest.approx(0.7)
    assert cal.recall + cal.specificity == pytest.approx(1.5)
    assert cal.on_logit in (6.5, 7.5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(targeted=np.array([1, 0, 1, 1])), "constant within each reply"),
    (dict(targeted=np.array([1, 1, 1, 1])), "both kinds"),
    (dict(targeted=np.array([1, 1, 0, 0]), alpha=0.0), "alpha"),
])
def test_bad_input_names_the_field(kwargs, match):
    args = dict(logits=np.array([0.0, 1.0, 2.0, 3.0]), groups=np.array([0, 0, 1, 1]), alpha=0.5) | kwargs
    with pytest.raises(ValueError, match=match):
        calibrate_ema_latch(**args)
