"""The measured pipeline bubble of each schedule (Narayanan et al. 2021, section 2.2; Huang et al. 2019).

The real executor and point-to-point messages run on 4 ranks with model chunks whose forward and backward
take a fixed time (they sleep, so ranks sharing 2 cores do not compete for the CPU).  The bubble is the
slowest rank's step time minus the ranks' mean compute time, over that compute time.  The remaining gap to
the formula is the latency of the point-to-point hops on the critical path (about 1 ms each on loopback
gloo here, more when other jobs load the CPU), so stages take 100 / 200 ms.
"""
import pytest

from pp_workers import measure_bubble
from podscale.runtime.launcher import launch


def test_measured_bubble():
    """The real executor and point-to-point messages on 4 ranks, with stages that take a fixed time:
    the measured bubble is within 10% of (p - 1) / m (GPipe, 1F1B) and (p - 1) / (v m) (interleaved)."""
    p, m = 4, 8
    cases = [dict(schedule="gpipe", m=m, v=1, t_f=0.075, t_b=0.15, steps=3),
             dict(schedule="1f1b", m=m, v=1, t_f=0.075, t_b=0.15, steps=3),
             dict(schedule="interleaved", m=m, v=2, t_f=0.075, t_b=0.15, steps=3)]
    results = launch(measure_bubble, (cases,), nproc=p)
    seen = {}
    for c in results[0]:
        expected = (p - 1) / (c["v"] * c["m"])
        # step 1 also sets up connections; other jobs on the machine can only add delay, so the least
        # of the other steps is the schedule's own bubble
        measured = min(c["bubbles"][1:])
        seen[c["schedule"]] = (round(measured, 4), expected)
        assert measured == pytest.approx(expected, rel=0.10), (c["schedule"], c["bubbles"], expected)
    print(seen)
