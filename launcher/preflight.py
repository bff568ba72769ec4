"""Bounded waits before torchrun starts: for a host name to resolve, or for a file to be complete.

Cluster managers publish the cluster before all of it exists: a Kubernetes pod's name resolves only
once the pod runs and its headless service has an endpoint; OCI Data Science fills in its node list as
nodes start. The launcher waits for these, prints a progress line every few seconds, and after the
time limit raises a one-line :class:`ConfigError` (exit 2, nothing started) naming what it waited for.
Standard library only; ``socket`` is imported only when a name is actually looked up.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Mapping
from typing import Callable, Optional, TypeVar

from launcher import streams
from launcher.errors import ConfigError, shown

T = TypeVar("T")
PROGRESS_EVERY = 5.0  # seconds between progress lines
POLL_EVERY = 0.5  # seconds between attempts


def _stderr(message: str) -> None:
    streams.write(sys.stderr, f"[ddp-launcher] {message}\n")


def wait_for(attempt: Callable[[], tuple[Optional[T], str]], what: str, timeout: float,
             log: Callable[[str], None] = _stderr, poll: float = POLL_EVERY,
             progress_every: float = PROGRESS_EVERY) -> T:
    """Call ``attempt`` until it returns a value; give up after ``timeout`` seconds.

    ``attempt`` returns ``(value, state)``: a value ends the wait, ``None`` means "not yet" and
    ``state`` says what is missing (it goes into the progress lines and the final error).
    Raises :class:`ConfigError` naming ``what``, how long it waited and the last state.
    """
    start = time.monotonic()
    next_progress = start + progress_every
    while True:
        value, state = attempt()
        if value is not None:
            return value
        now = time.monotonic()
        if now - start >= timeout:
            raise ConfigError(f"gave up waiting for {what} after {now - start:.0f} s (limit {timeout:g} s): {state}")
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


def port_answers(host: str, port: int, timeout: float = 1.0) -> bool:
    """True if a TCP connection to ``host:port`` is accepted within ``timeout`` (whoever accepts it)."""
    import socket  # only after a failed rendezvous

    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except (OSError, UnicodeError):
        return False


def no_rendezvous_reason(master: str, port: int, node_rank: int) -> str:
    """Why no rendezvous came, as far as this node can tell: the master's port answered or not."""
    if node_rank == 0:
        return "the other nodes did not all join"
    if port_answers(master, port):
        return (f"{master}:{port} answers but gave no rendezvous: another program may hold that port "
                "(or node 0 is still waiting for the other nodes)")
    return f"{master}:{port} never answered: is node 0 up, and is the port open between the hosts?"
