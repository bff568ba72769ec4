"""Bounded waits before torchrun starts: for a host name to resolve, or for a file to be complete.

Cluster managers publish the cluster before all of it exists: a Kubernetes pod's name resolves only
once the pod runs and its headless service has an endpoint; OCI Data Science fills in its node list as
nodes start. The launcher waits for these, prints a progress line every few seconds, and after the
time limit raises a one-line :class:`ConfigError` (exit 2, nothing started) naming what it waited for.
A stop signal during a wait (the platform stops the job, the user presses Ctrl-C) raises
:class:`~launcher.errors.Stopped`: the launch then ends as ``stopped`` (exit code 128 + the signal, its
outcome file written, nothing left) rather than dying where it stands. Standard library only; ``socket``
is imported only when a name is actually looked up.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Callable, Optional, TypeVar

from launcher import streams
from launcher.errors import ConfigError, Stopped, shown
from launcher.failure import signal_name
from launcher.supervise import STOP_SIGNALS

T = TypeVar("T")
PROGRESS_EVERY = 5.0  # seconds between progress lines
POLL_EVERY = 0.5  # seconds between attempts


def _stderr(message: str) -> None:
    streams.write(sys.stderr, f"[ddp-launcher] {message}\n")


@contextlib.contextmanager
def _stops_end_the_wait(what: str, start: float) -> Iterator[None]:
    """While the block runs in the main thread, a stop signal raises :class:`Stopped`."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, _frame: object) -> None:
        raise Stopped(f"stopped by {signal_name(signum)} while waiting for {what} "
                      f"({time.monotonic() - start:.0f} s), before torchrun started", signum)

    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def wait_for(attempt: Callable[[], tuple[Optional[T], str]], what: str, timeout: float,
             log: Callable[[str], None] = _stderr, poll: float = POLL_EVERY,
             progress_every: float = PROGRESS_EVERY) -> T:
    """Call ``attempt`` until it returns a value; give up after ``timeout`` seconds.

    ``attempt`` returns ``(value, state)``: a value ends the wait, ``None`` means "not yet" and
    ``state`` says what is missing (it goes into the progress lines and the final error).
    Raises :class:`ConfigError` naming ``what``, how long it waited and the last state; :class:`Stopped`
    when a stop signal comes meanwhile.
    """
    start = time.monotonic()
    next_progress = start + progress_every
    with _stops_end_the_wait(what, start):
        while True:
            value, state = attempt()
            if value is not None:
                return value
            now = time.monotonic()
            if now - start >= timeout:
                raise ConfigError(f"gave up waiting for {what} after {now - start:.0f} s (limit {timeout:g} s): "
                                  f"{state}")
            if now >= next_progress:
                log(f"waiting for {what}: {state} ({now - start:.0f} s of {timeout:g} s)")
                next_progress = now + progress_every
            time.sleep(min(poll, max(0.0, timeout - (now - start))))


def lookup(host: str) -> Optional[str]:
    """The first address ``host`` resolves to (None: not resolvable now)."""
    import socket  # only when a name is looked up

    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    return str(infos[0][4][0]) if infos else None


def wait_for_names(names: Iterable[str], resolve: Mapping[str, str], timeout: float,
                   log: Callable[[str], None] = _stderr,
                   resolver: Callable[[str], Optional[str]] = lookup) -> dict[str, str]:
    """Wait until every host name resolves (names in the ``--resolve`` map need no look-up).

    Returns name -> address. Raises :class:`ConfigError` naming the first host that never resolved.
    """
    found: dict[str, str] = {}
    for name in names:
        if name in resolve:
            found[name] = resolve[name]
            continue

        def attempt(name: str = name) -> tuple[Optional[str], str]:
            return resolver(name), "does not resolve yet"

        found[name] = wait_for(attempt, f"host name {shown(name)} to resolve", timeout, log)
    return found
