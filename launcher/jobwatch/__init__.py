"""The launchers of one job watch each other: a failed or lost host stops the job everywhere.

Roles. Node 0's launcher runs a hub, bound on every interface; every other launcher connects to the
master address, retrying while its job runs (at most the rendezvous timeout), and reconnects with the
same identity when its connection breaks without a definite end. A failure or loss anywhere is
relayed by the hub to every host: every loss, and of the failures those that can change a host's root
cause (the first, the first primary one); the ends that follow, each host stopped because of the
first, are the hub's to log, not N-1 more messages to each of N-1 hosts.

Ports. By default the watch listens on the first free port of a short list derived from the job's
identity, in 61000-65499: above Linux's ephemeral ports (32768-60999) and far from every rendezvous
port rule (SLURM/PBS 20000-29999, torchrun's 29500 and the ``MASTER_PORT=29501`` habit), so it is never
the rendezvous port of a neighbouring job. Clients try the same list in order and accept only a hub
that answers with this job's identity: every host reaches the same hub, or none (then every host logs
that it runs without the watch, and a failure report says so). ``--watch-port`` gives one port.

Modules: :mod:`~launcher.jobwatch.watch` (framing, tags, connections and the loop both roles share),
:mod:`~launcher.jobwatch.hub` (node 0), :mod:`~launcher.jobwatch.client` (every other node),
:mod:`~launcher.jobwatch.messages` (the typed messages, with a table of every one: who sends it, when, and what
its receiver does) and :mod:`~launcher.jobwatch.restarts` (restarts in place: the generation messages, attached
to the watch as hang detection, :mod:`launcher.hangwatch`, attaches itself as its :class:`Extension`).

Protocol: newline-delimited JSON objects, each line at most :data:`MAX_LINE` bytes; a client's first line
is its ``hello`` {job, node, host, nnodes, nonce}, ``job`` the job's identity
(:func:`launcher.command.job_identity`: the platform's job name, the rendezvous endpoint and the node count, which
every host knows). The hub answers a hello of this job with its own ``hello``, then every event it has relayed
so far; a hello of another job gets ``refused`` and the connection is closed (logged once; neither job is
affected). The newest accepted hello of a node replaces its older connection (which is told ``replaced``): a
reconnection, no loss.

Authentication (optional): with a shared secret (``LAUNCHER_JOB_SECRET``, or ``--job-secret-file``),
every line after ``watch`` is ``<hex HMAC-SHA256> <json>``, the tag over the job's identity, both
nonces of the connection, the sender's role and the message, which carries a number that must grow:
a message from another job, another connection or a replay has no valid tag. A message without a
valid tag is dropped and logged once; it never stops the job. Without a secret, anyone who can reach
the port and knows the job's identity can stop the job, the same exposure as torchrun's TCPStore.

Failure detector. A definite end is a loss at once: a handshaken connection closed or reset without
``done`` or ``failed``. Silence only makes a host suspect (logged once, after :data:`SUSPECT_AFTER`
s); hearing it again clears it (logged); a host silent for the loss timeout (default
:data:`LOSS_TIMEOUT` s) is lost. The default survives a 10 s link outage plus TCP's retransmission
backoff, a 10 s SIGSTOP of a launcher, a 5 s VM pause and 10 s of CPU starvation, and stays below
Kubernetes' 40 s node-lost time; torch's c10d counts 15 s, which TCP backoff after a 10 s outage
exceeds. A launcher that finds itself paused or starved (a turn of its loop took over
:data:`PAUSED` s) restarts every silence clock: its own pause is no evidence against the others.
Junk never stops a job and never grows memory: a connection without a hello in
:data:`HANDSHAKE_TIMEOUT` s is closed, at most ``MAX_PENDING + nnodes`` such connections are held (the
oldest is dropped for a newer one), lines and send buffers are bounded, and a bad message from a
handshaken peer is dropped.

Any failure or loss elsewhere stops this host's workers at once (the stop path of
:mod:`launcher.supervise` with a grace period of at most :data:`REMOTE_GRACE` s: once a peer is gone
no collective-consistent checkpoint is possible, and a worker blocked in a collective never runs its
Python SIGTERM handler, so a longer grace period only delays the end). The job's root cause, which
every host's report starts with and whose exit code every host exits with, is the first failure that
is not a consequence of another (``primary``), else the first loss or failure seen; node 0's decision
(:mod:`~launcher.jobwatch.restarts`, with or without restarts) names the one primary host, by time; this
module hands the cause over as an :class:`Event` and :mod:`launcher.report` makes the verdict. A lost host counts
as killed by SIGKILL (exit code 137): from outside, power loss, a preempted VM and a dead network look
the same, and 137 is what platforms' retry policies already treat as "the machine went away".
After its own workers succeeded the hub relays for the others at most the loss timeout more.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Callable, Optional, Union

from launcher.command import address_of, job_identity, master_port, watch_ports
from launcher.groups import training_nodes, watch_place
from launcher.jobwatch import restarts
from launcher.jobwatch.client import Client
from launcher.jobwatch.hub import Hub, _Node
from launcher.jobwatch.watch import (
    ATTEMPT_TIMEOUT,
    HANDSHAKE_TIMEOUT,
    HEARTBEAT,
    LEAVE_WAIT,
    LOSS_TIMEOUT,
    LOST_CODE,
    MAX_LINE,
    MAX_OUT,
    MAX_PENDING,
    PAUSED,
    REMOTE_GRACE,
    REPORT_CHARS,
    REPORT_LINES,
    RETRY,
    SUSPECT_AFTER,
    Event,
    Extension,
    StopRequest,
    Watch,
    _Conn,
    report_head,
)

if TYPE_CHECKING:
    from launcher.cluster import Cluster
    from launcher.options import Options

__all__ = ["ATTEMPT_TIMEOUT", "HANDSHAKE_TIMEOUT", "HEARTBEAT", "LEAVE_WAIT", "LOSS_TIMEOUT", "LOST_CODE", "MAX_LINE",
           "MAX_OUT", "MAX_PENDING", "PAUSED", "REMOTE_GRACE", "REPORT_CHARS", "REPORT_LINES", "RETRY",
           "SUSPECT_AFTER", "Client", "Event", "Extension", "Hub", "Off", "StopRequest", "Watch", "_Conn", "_Node",
           "for_cluster", "job_identity", "report_head", "start"]


def _raise_file_limit(need: int) -> None:
    """Raise the soft limit of open files toward the hard one when it is below ``need``."""
    try:
        import resource
    except ImportError:  # not on this system: the default limit it is
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))



class Off(Watch):
    """Node 0 when no candidate port was free: no watch (the clients find no hub either); a failure
    report says so."""

    def _leave(self, message: dict, code: int) -> None:
        """Nobody to tell."""


def start(node: int, host: str, nnodes: int, master: str, port: Union[int, Sequence[int]], timeout: float,
          connect_for: float, log: Callable[[str], None], job: str = "",
          secret: Optional[bytes] = None, training: Optional[frozenset[int]] = None) -> Watch:
    """Start this host's watch (hub on node 0, else client); :class:`Off` if the hub cannot listen (logged).

    ``training``: the nodes that train, when not all do (the hub sends ``end`` when they are all done).

    ``port`` is the watch port, or the candidate ports in order (the hub listens on the first free
    one, clients look for this job's hub on each); ``job`` the job's identity (:func:`launcher.command.job_identity`),
    ``secret`` the shared secret that tags every message (None: none).
    """
    ports = (port,) if isinstance(port, int) else tuple(port)
    watch: Watch
    if node == 0:
        _raise_file_limit(2 * nnodes + MAX_PENDING + 64)
        problems = []
        for candidate in ports:
            try:
                listener = _listen(candidate, nnodes + MAX_PENDING)
            except OSError as exc:
                problems.append(f"{candidate}: {os.strerror(exc.errno) if exc.errno else exc}")
                continue
            watch = Hub(listener, candidate, node, host, nnodes, timeout, log, job=job, secret=secret)
            taken = f" (taken: {'; '.join(problems)})" if problems else ""
            log(f"job watch: hub on port {candidate}{taken}")
            break
        else:
            off = Off(node, host, nnodes, timeout, log)
            off.off = f"the hub could not listen on port {'; '.join(problems)}"
            log(f"job watch off: {off.off}; the other hosts find no hub and run without the watch too")
            restarts.attach(off)
            return off
    else:
        watch = Client(master, ports, time.monotonic() + connect_for, node, host, nnodes, timeout, log,
                       job=job, secret=secret)
    watch.training = training
    restarts.attach(watch)
    watch.thread.start()
    return watch


def _listen(port: int, backlog: int) -> socket.socket:
    backlog = max(128, backlog)
    if socket.has_dualstack_ipv6():  # every interface: the master address is one of them
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=backlog)
    return socket.create_server(("", port), backlog=backlog)


def for_cluster(cluster: Cluster, options: Options, log: Callable[[str], None],
                secret: Optional[bytes] = None) -> Watch:
    """The watch of this host's launcher (several nodes); :class:`Off` if the hub cannot listen (logged).

    Where only some hosts train, every host of the job is a node (:func:`launcher.groups.watch_place`)."""
    job = job_identity(cluster.job_name or "", cluster.master_addr or "", master_port(cluster, options),
                       cluster.nnodes)
    node, nnodes, hub = watch_place(cluster)
    return start(node, cluster.current_host, nnodes, address_of(hub, options.resolve),
                 watch_ports(cluster, options, job), options.loss_timeout, float(options.rdzv_timeout), log,
                 job=job, secret=secret, training=training_nodes(cluster))
