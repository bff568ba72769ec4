"""Which of two failures came first, by exit records and deaths (launcher/failuretime.py), within a host and
across hosts (node 0's root cause, launcher/restart.py).

The shapes are the ones measured with gloo (tests/test_restart_jobs.py runs them for real): a worker's sockets
close as its process ends, about 0.5 s after its exit record, and a peer fails on them about 2 ms later. A death's
stamp may be late by up to LAG under load; a record is never late. Both orders of every shape are checked with
every lag below LAG, and the comparison is a strict order whatever the values.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from launcher import codes, restart
from launcher.failuretime import LAG, FailedAt, earlier

TEARDOWN = 0.5  # a worker's record to its death (the interpreter's teardown with torch), measured
DETECT = 0.002  # a death to its peer's failure on the closed sockets, measured
lags = st.floats(min_value=0.0, max_value=LAG * 0.9)


@given(lags, lags)
def test_killed_first_then_the_peers_lost_peer_exception(lag_a: float, lag_b: float) -> None:
    # a: SIGKILLed at 0 (no record); b: raises at DETECT on the closed connection, dies after its teardown
    killed = FailedAt(None, 0.0 + lag_a)
    peer = FailedAt(DETECT, DETECT + TEARDOWN + lag_b)
    assert earlier(killed, peer) and not earlier(peer, killed)


@given(lags, lags)
def test_an_exception_first_then_the_peers_abort(lag_a: float, lag_b: float) -> None:
    # a: raises at 0, dies after its teardown; b: aborts (no record) DETECT after a's death
    raised = FailedAt(0.0, TEARDOWN + lag_a)
    aborted = FailedAt(None, TEARDOWN + DETECT + lag_b)
    assert earlier(raised, aborted) and not earlier(aborted, raised)


def test_records_decide_between_two_records_and_deaths_between_two_deaths() -> None:
    assert earlier(FailedAt(1.0, 9.0), FailedAt(2.0, 3.0))  # the records: deaths are only teardown's length
    assert earlier(FailedAt(None, 1.0), FailedAt(None, 1.5))
    assert earlier(FailedAt(None, None), FailedAt(None, 1.0))  # no pidfds: an abrupt end with no word is first
    assert earlier(FailedAt(None, None), FailedAt(1.0, 2.0))


times = st.one_of(st.none(), st.floats(min_value=-1e6, max_value=1e6, allow_nan=False))


@given(times, times, times, times)
def test_never_both_ways(r1, d1, r2, d2) -> None:  # type: ignore[no-untyped-def]
    a, b = FailedAt(r1, d1), FailedAt(r2, d2)
    assert not (earlier(a, b) and earlier(b, a))


def end(node: int, age: float, record_at, death_at, primary: bool = True) -> restart.End:  # type: ignore[no-untyped-def]
    return restart.End(node, f"algo-{node + 1}", 1, codes.WORKER_EXIT, "exit 1", "failed", primary, False,
                       age=age, at=100.0 - age, record_at=record_at, death_at=death_at)


def test_node_0_names_the_killed_host_whose_death_came_first_by_its_own_clock() -> None:
    # algo-2's worker killed at 99.000 (no record), algo-1's worker raised on the closed connection at 99.002 and
    # was stopped at 99.5 (the times as node 0 placed them on its clock)
    killed = end(1, age=1.0, record_at=None, death_at=99.0)
    peer = end(0, age=0.998, record_at=99.002, death_at=99.5)
    assert restart.root_cause([peer, killed]) is killed
    assert restart.root_cause([killed, peer]) is killed
    # the message whose failure has no clock at all is placed at its generation's end (``at``)
    late = end(1, age=0.1, record_at=None, death_at=None)
    assert restart.root_cause([peer, late]) is peer
    assert restart.failed_at(late) == FailedAt(99.9, None)
