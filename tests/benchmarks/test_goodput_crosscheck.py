"""The simulator's step times stay within 25% of the published single-GPU measurements."""

from tokenlake.benchmarks.sim_crosscheck import REFERENCE, TOLERANCE, crosscheck


def test_step_times_match_published_measurements():
    rows = crosscheck()
    assert len(rows) == len(REFERENCE)
    bad = [r for r in rows if abs(r["error"]) > TOLERANCE]
    assert not bad, bad
