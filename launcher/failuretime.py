"""When a worker failed, by the two clocks there are, and which of two failures came first.

- ``record``: the exit record the launcher's bootstrap writes as the script ends with a non-zero code (an
  exception, ``sys.exit(3)``), or, with no better word, the generation's end. Exact: the worker writes it itself.
- ``death``: the kernel's word on the process's end (:mod:`launcher.deaths`), stamped by a watcher process woken
  by it: late by the kernel's wake-up of that process. The only clock of a worker that wrote no record (SIGKILL,
  SIGSEGV, ``os._exit``, an abort).

What the two clocks show, measured with gloo (two hosts, one rank each): a worker's sockets close as its process
ends, about half a second after its record (the interpreter's teardown), and a peer fails on them about 2 ms
later. So when one failure has only a death and the other a record:

- killed first (no record), the peer's lost-peer exception second: the death is 2 ms before the peer's record,
  and half a second (its teardown, or the stop that ends it) before the peer's death;
- an exception first, the peer's abort second (NCCL's error handling): the record is half a second before the
  abort's death, and the abort 2 ms after the raiser's death.

Each case is certain on one comparison and a 2 ms race on the other. :func:`earlier` takes either: the death
came first if it is before the record, or more than :data:`LAG` before the other's death.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

LAG = 0.1  # seconds: more than a death's stamp is late under load, less than an interpreter's teardown with torch


class FailedAt(NamedTuple):
    """When a worker failed: its record's time and its death's (``time.time()``, or node 0's clock), None: unknown."""

    record: Optional[float]
    death: Optional[float]

    def first(self) -> Optional[float]:
        """The earliest time known of it."""
        known = [t for t in self if t is not None]
        return min(known) if known else None


def earlier(a: FailedAt, b: FailedAt) -> bool:
    """Whether failure ``a`` came before failure ``b`` (see the module's docstring)."""
    if a.record is not None and b.record is not None:
        return a.record < b.record
    if a.record is None and b.record is None:
        return _or_first(a.death) < _or_first(b.death)
    if a.record is not None:
        return not earlier(b, a)
    if a.death is None:  # no word at all (no pidfds): an abrupt end comes first, as it usually does
        return True
    return a.death < b.record or (b.death is not None and a.death < b.death - LAG)  # type: ignore[operator]


def _or_first(value: Optional[float]) -> float:
    return float("-inf") if value is None else value
