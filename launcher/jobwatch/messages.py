"""The job watch's messages, typed: one class per kind, each with ``encode`` (the JSON object on the wire) and
``decode`` (from one; raises :class:`Malformed`).

Every line is one JSON object whose ``t`` names its kind (:mod:`launcher.jobwatch.watch` frames and tags it).
Directions: *hub* is node 0's launcher, *client* every other host's.

========  ===============  ==========================================  =====================  ==========================
kind      direction        fields                                      when                   the receiver
========  ===============  ==========================================  =====================  ==========================
watch     hub -> client    nonce                                       first line of every    answers with its hello
                                                                       connection (untagged)
hello     client -> hub    job, node, host, nnodes, nonce              after ``watch``        this job: answers hello,
                                                                                              sends what it relayed;
                                                                                              else ``refused``
hello     hub -> client    job, node (0), host, nnodes                 answer to a hello      joined (or rejoined)
refused   hub -> client    why                                         a hello of another     tries the next port
                                                                       job (untagged)
replaced  hub -> client    (none)                                      a newer connection of  drops this connection
                                                                       the node came
hb        both ways        extensions' fields (hang: ``age``); ``w``   every second           clears suspicion; hub:
                           (its time.time()); a client's also ``a``                           its ``clock_offset``
                           (least own clock - hub's ``w`` it read)
failed    both ways        kind, node, host, code, report, primary     a host's workers       records the cause, stops
                                                                       failed                 its workers; hub relays
done      both ways        node, host                                  a host's workers all   hub: that node is done;
                                                                       succeeded              client: may leave
lost      hub -> client    node, host, why                             hub lost a host        records the loss, stops
end       hub -> client    (none)                                      every training host    SIGTERM to its script
                                                                       is done (groups)
gen_end   client -> hub    gen, node, host, code, klass, key, head,    this host's torchrun   stamps it; first failure:
                           primary, progress, stopped, age, watched,   of generation ``gen``  ``gen_stop``; all in:
                           steps, record_at, death_at, ahead_gone, w   ended (restarts)       decides, sends ``gen``
gen_stop  hub -> client    gen, report                                 first failure of a     stops its workers of
                                                                       generation             that generation
gen       hub -> client    generation, restart, why, used, cause,      node 0's decision at   restarts (generation + 1)
                           fresh, cause_age                            a generation's end     or ends the job
hang      both ways        phase, ... (freeze, dump, verdict; frozen,  hang detection         :mod:`launcher.hangwatch`
                           stacks)
========  ===============  ==========================================  =====================  ==========================

With a secret every line but ``watch`` and ``refused`` also carries ``n``, a number that grows (see the package's
docstring). Decoding is total: any bytes decode to one of these classes or raise :class:`Malformed`.
"""

from __future__ import annotations

import json
from typing import Any, Callable, NamedTuple, Union

REPORT_CHARS = 600  # what a ``failed`` or ``gen_stop`` message carries of a host's report
HOST_CHARS = 100
NONCE_CHARS = 64


class Malformed(ValueError):
    """Bytes or an object that are no message of the job watch (its text says why)."""


def _int(obj: dict, key: str) -> int:
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise Malformed(f"{key} is no integer")
    return value


def _str(obj: dict, key: str, limit: int) -> str:
    value = obj[key]
    if not isinstance(value, str):
        raise Malformed(f"{key} is no string")
    return value[:limit]


def _bool(obj: dict, key: str) -> bool:
    value = obj[key]
    if not isinstance(value, bool):
        raise Malformed(f"{key} is no boolean")
    return value


class Hello(NamedTuple):
    """``watch`` (hub's nonce), or a ``hello``: a client's (with its nonce) or the hub's answer (nonce empty)."""

    job: str
    node: int
    host: str
    nnodes: int
    nonce: str

    def encode(self) -> dict:
        """As sent."""
        out = {"t": "hello", "job": self.job, "node": self.node, "host": self.host, "nnodes": self.nnodes}
        return {**out, "nonce": self.nonce} if self.nonce else out

    @classmethod
    def decode(cls, obj: dict) -> Hello:
        """From the wire."""
        return cls(_str(obj, "job", 1000), _int(obj, "node"), _str(obj, "host", HOST_CHARS), _int(obj, "nnodes"),
                   _str(obj, "nonce", NONCE_CHARS) if "nonce" in obj else "")


class Greeting(NamedTuple):
    """``watch``: the hub's first line on a connection."""

    nonce: str

    def encode(self) -> dict:
        """As sent."""
        return {"t": "watch", "nonce": self.nonce}

    @classmethod
    def decode(cls, obj: dict) -> Greeting:
        """From the wire."""
        return cls(_str(obj, "nonce", NONCE_CHARS))


class Refused(NamedTuple):
    """``refused``: a hello of another job."""

    why: str

    def encode(self) -> dict:
        """As sent."""
        return {"t": "refused", "why": self.why}

    @classmethod
    def decode(cls, obj: dict) -> Refused:
        """From the wire."""
        return cls(_str(obj, "why", 60))


class Failed(NamedTuple):
    """``failed``: a host's workers failed; ``primary`` False when another host looks like the cause."""

    node: int
    host: str
    code: int
    report: str
    primary: bool

    def encode(self) -> dict:
        """As sent (``kind`` too: the :class:`launcher.jobwatch.Event` it came from)."""
        return {"t": "failed", "kind": "failed", "node": self.node, "host": self.host, "code": self.code,
                "report": self.report, "primary": self.primary}

    @classmethod
    def decode(cls, obj: dict) -> Failed:
        """From the wire."""
        return cls(_int(obj, "node"), _str(obj, "host", HOST_CHARS), _int(obj, "code"),
                   _str(obj, "report", REPORT_CHARS), _bool(obj, "primary"))


class Done(NamedTuple):
    """``done``: a host's workers all succeeded."""

    node: int
    host: str

    def encode(self) -> dict:
        """As sent."""
        return {"t": "done", "node": self.node, "host": self.host}

    @classmethod
    def decode(cls, obj: dict) -> Done:
        """From the wire (the hub's own ``done`` to a client may carry nothing else)."""
        return cls(_int(obj, "node") if "node" in obj else 0, _str(obj, "host", HOST_CHARS) if "host" in obj else "")


class Lost(NamedTuple):
    """``lost``: the hub lost a host."""

    node: int
    host: str
    why: str

    def encode(self) -> dict:
        """As sent."""
        return {"t": "lost", "node": self.node, "host": self.host, "why": self.why}

    @classmethod
    def decode(cls, obj: dict) -> Lost:
        """From the wire."""
        return cls(_int(obj, "node"), _str(obj, "host", HOST_CHARS), _str(obj, "why", HOST_CHARS))


class Signal(NamedTuple):
    """A message with no fields of its own: ``replaced`` or ``end``."""

    kind: str

    def encode(self) -> dict:
        """As sent."""
        return {"t": self.kind}

    @classmethod
    def decode(cls, obj: dict) -> Signal:
        """From the wire."""
        return cls(obj["t"])


class GenStop(NamedTuple):
    """``gen_stop``: stop the workers of generation ``gen``."""

    gen: int
    report: str

    def encode(self) -> dict:
        """As sent."""
        return {"t": "gen_stop", "gen": self.gen, "report": self.report}

    @classmethod
    def decode(cls, obj: dict) -> GenStop:
        """From the wire."""
        return cls(_int(obj, "gen"), _str(obj, "report", REPORT_CHARS))


class Fields(NamedTuple):
    """A message whose fields belong to another module: ``hb`` (the extensions' fields), ``gen_end``
    (:class:`launcher.restart.End`), ``gen`` (:class:`launcher.restart.Decision`), ``hang``
    (:mod:`launcher.hangwatch`). ``fields``: every field but ``t``, checked by that module."""

    kind: str
    fields: dict

    def encode(self) -> dict:
        """As sent."""
        return {"t": self.kind, **self.fields}

    @classmethod
    def decode(cls, obj: dict) -> Fields:
        """From the wire."""
        return cls(obj["t"], {k: v for k, v in obj.items() if k != "t"})


Message = Union[Greeting, Hello, Refused, Failed, Done, Lost, Signal, GenStop, Fields]

KINDS: dict[str, Callable[[dict], Any]] = {
    "watch": Greeting.decode, "hello": Hello.decode, "refused": Refused.decode, "failed": Failed.decode,
    "done": Done.decode, "lost": Lost.decode, "replaced": Signal.decode, "end": Signal.decode,
    "gen_stop": GenStop.decode, "hb": Fields.decode, "gen_end": Fields.decode, "gen": Fields.decode,
    "hang": Fields.decode,
}


def decode_object(obj: object) -> Message:
    """A parsed JSON value as a message; raises :class:`Malformed`."""
    if not isinstance(obj, dict) or not isinstance(obj.get("t"), str):
        raise Malformed("no JSON object with a kind")
    decoder = KINDS.get(obj["t"])
    if decoder is None:
        raise Malformed(f"an unknown kind {obj['t'][:20]!r}")
    try:
        return decoder(obj)
    except KeyError as exc:
        raise Malformed(f"no {exc.args[0]}") from None


def decode(line: bytes) -> Message:
    """One line (without its tag) as a message; raises :class:`Malformed` and nothing else."""
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
        raise Malformed("garbage") from None
    return decode_object(obj)


def encode(message: Message) -> bytes:
    """One message as its line's body (compact JSON, no newline)."""
    return json.dumps(message.encode(), separators=(",", ":")).encode()
