"""The job watch's typed messages (launcher/jobwatch/messages.py): decoding is total over any bytes, every
message round-trips, and the table in the module's docstring names every kind the decoder knows."""

from __future__ import annotations

import json
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from launcher.jobwatch import Event, messages
from launcher.jobwatch.watch import _as_message, _event

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

text = st.text(max_size=40)
node = st.integers(min_value=0, max_value=1 << 20)
json_value = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | text,
                          lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
                          max_leaves=8)
fields = st.dictionaries(text.filter(lambda k: k != "t"), json_value, max_size=4)

MESSAGES = st.one_of(
    st.builds(messages.Greeting, text),
    st.builds(messages.Hello, text, node, text, node, text),
    st.builds(messages.Refused, text),
    st.builds(messages.Failed, node, text, st.integers(min_value=-(1 << 31), max_value=1 << 31), text, st.booleans()),
    st.builds(messages.Done, node, text),
    st.builds(messages.Lost, node, text, text),
    st.builds(messages.Signal, st.sampled_from(["replaced", "end"])),
    st.builds(messages.GenStop, node, text),
    st.builds(messages.Fields, st.sampled_from(["hb", "gen_end", "gen", "hang"]), fields),
)


@FUZZ
@given(MESSAGES)
def test_every_message_round_trips(message):
    assert messages.decode(messages.encode(message)) == message


@FUZZ
@given(st.one_of(st.binary(max_size=300), json_value.map(lambda v: json.dumps(v).encode()),
                 st.builds(lambda t, f: json.dumps({"t": t, **f}).encode(),
                           st.sampled_from(sorted(messages.KINDS)) | text, fields)))
def test_any_bytes_decode_to_a_message_or_are_refused(data):
    try:
        message = messages.decode(data)
    except messages.Malformed as exc:
        assert str(exc)
        return
    assert type(message) in messages.Message.__args__
    assert messages.decode(messages.encode(message)) == message


def test_the_docstring_table_lists_every_kind():
    rows = {line.split()[0] for line in messages.__doc__.splitlines() if line[:1].isalpha() and "  " in line}
    assert set(messages.KINDS) <= rows, set(messages.KINDS) - rows


@FUZZ
@given(st.builds(Event, st.sampled_from(["failed", "lost"]), st.integers(min_value=0, max_value=7), text,
                 st.integers(min_value=1, max_value=255), text, st.booleans()))
def test_the_events_the_watch_relays_are_typed_messages(event):
    wire = _as_message(event)
    typed = messages.decode(messages.encode(messages.decode_object(wire)))
    assert typed.encode() == wire
    if event.kind == "failed":  # ``at``: when this host heard it (its own clock), never on the wire
        before = time.monotonic()
        heard = _event(wire, 8)
        assert heard._replace(at=event.at) == event and before <= heard.at <= time.monotonic()
