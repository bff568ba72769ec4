"""Property-based fuzzing of every input parser (issue 12): any input gives a result or a ConfigError.

Never another exception, and a ConfigError is one line that quotes a bounded part of the input. Parsers:
resourceconfig.json (bytes), the SM_* variables, hyperparameters.json, the launcher's argv in both
forms with its LAUNCHER_* variables, and every platform module in ``launcher.platforms.ORDER`` with
random environments built from the variable names its own source mentions (so a new module is
covered the day it lands). Last, whatever hyperparameters a user passes reach the script exactly as
AWS's own ``sagemaker_training.mapping.to_cmd_args`` renders them.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import re
import signal
import socket
import sys
import tracemalloc
from typing import Callable

import pytest
from conftest import resolve_cluster
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sagemaker_training import mapping

from launcher import platforms
from launcher.cluster import Cluster, bad_host
from launcher.errors import ConfigError
from launcher.filereader import MAX_CONFIG_BYTES, read_bounded
from launcher.options import MAX_NPROC, MAX_RESTARTS, MAX_SECONDS, SPECS, parse_invocation
from launcher.platforms import oci, pbs, sagemaker
from launcher.platforms.base import HostView
from launcher.platforms.sagemaker import argv as aws_argv

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PER_PLATFORM = settings(FUZZ, max_examples=100)  # the number of platform modules grows: keep the file < 30 s
MAX_MESSAGE = 1000
OPTIONS = parse_invocation(["t.py"], {}).options

# Values as they come in variables and argv: any text (no NUL: neither can hold one), bytes that were
# not UTF-8 (Python shows them as lone surrogates), numbers of every kind, JSON lists, very deep JSON.
_text = st.text(st.characters(exclude_characters="\0"), max_size=20)
_undecodable = st.text(st.characters(min_codepoint=0xDC80, max_codepoint=0xDCFF), min_size=1, max_size=3)
_numbers = st.one_of(st.integers(-5, 10**13).map(str), st.sampled_from(
    ["0", "1", "2", "-1", " 3 ", "1e3", "inf", "nan", "1.5", "0x10", "٣", "9" * 5000, "1_000", ""]))
_hosts = st.sampled_from(["algo-1", "algo-2", "algo-10", "localhost", "127.0.0.1", "", " "])
_json_lists = st.lists(st.one_of(_hosts, _text, st.integers(), st.none()), max_size=5).map(json.dumps)
VALUES = st.one_of(_text, _undecodable, _numbers, _hosts, _json_lists,
                   st.builds(lambda h, p: f"{h}:{p}", _hosts, _numbers),
                   st.integers(1, 3000).map(lambda n: "[" * n), st.just("[" * 1500 + "]" * 1500))


def check_message(err: ConfigError, bounded: bool = True) -> None:
    """A ConfigError is one line that quotes a bounded part of the bad value.

    ``bounded=False`` for the platform-wide fuzz: platform modules may quote a path built from a
    variable (e.g. ``SAGEMAKER_BASE_DIR``) whole; there only the exception's class is the property.
    """
    message = str(err)
    assert message
    if bounded:
        assert "\n" not in message and len(message) < MAX_MESSAGE, message[:2000]


def check_cluster(cluster: Cluster) -> None:
    """What every platform promises about a cluster it returns."""
    assert isinstance(cluster, Cluster)
    assert cluster.nnodes >= 1 and 0 <= cluster.node_rank < cluster.nnodes
    assert 1 <= cluster.nproc_per_node <= MAX_NPROC
    assert bad_host(cluster) is None, cluster  # only host names and addresses: nothing a shell or a log reader misreads
    if cluster.hosts:
        assert list(cluster.hosts) == sorted(cluster.hosts) and len(cluster.hosts) == cluster.nnodes
        assert cluster.hosts[cluster.node_rank] == cluster.current_host


def resolve_or_refuse(platform, environ, dev_dir, options=OPTIONS, bounded=True):
    """The platform's cluster, or a well-formed ConfigError; any other exception fails the test."""
    try:
        cluster = resolve_cluster(environ, options, str(dev_dir), platform=platform)
    except ConfigError as err:
        check_message(err, bounded)
        return None
    check_cluster(cluster)
    return cluster


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """An empty /dev stand-in and a SageMaker base directory whose config files the tests rewrite."""
    root = tmp_path_factory.mktemp("fuzz")
    (root / "dev").mkdir()
    (root / "base" / "input" / "config").mkdir(parents=True)
    return root


# --- resourceconfig.json, the SM_* variables, hyperparameters.json -----------------------------

_resource_objects = st.fixed_dictionaries({}, optional={
    "hosts": st.one_of(st.lists(st.one_of(_hosts, _text, st.integers(), st.none()), max_size=6), _text, st.none()),
    "current_host": st.one_of(_hosts, _text, st.integers(), st.none()),
    "network_interface_name": st.one_of(_text, st.integers(), st.none()),
    "current_instance_type": st.one_of(_text, st.lists(_text)),
})
RESOURCE_BYTES = st.one_of(
    st.binary(max_size=64),
    _resource_objects.map(lambda d: json.dumps(d).encode()),
    _resource_objects.map(lambda d: json.dumps(d, ensure_ascii=False).encode("utf-8", "surrogatepass")),
    st.tuples(_resource_objects, st.integers(0, 40)).map(lambda t: json.dumps(t[0]).encode()[:t[1]]),
    st.lists(_resource_objects, max_size=2).map(lambda d: json.dumps(d).encode()),
)


@FUZZ
@given(content=RESOURCE_BYTES)
def test_resourceconfig_bytes(dirs, content):
    (dirs / "base" / "input" / "config" / "resourceconfig.json").write_bytes(content)
    environ = {"SAGEMAKER_BASE_DIR": str(dirs / "base")}
    cluster = resolve_or_refuse(sagemaker.PLATFORM, environ, dirs / "dev")
    if cluster is not None:
        assert cluster.master_addr == cluster.hosts[0]


SM_NAMES = ("SM_HOSTS", "SM_CURRENT_HOST", "SM_HOST_COUNT", "SM_CURRENT_HOST_RANK", "SM_MASTER_ADDR",
            "SM_NUM_GPUS", "SM_NUM_NEURONS", "SM_NETWORK_INTERFACE_NAME", "SM_CURRENT_INSTANCE_TYPE",
            "TRAINING_JOB_NAME")


@FUZZ
@given(environ=st.dictionaries(st.sampled_from(SM_NAMES), VALUES, max_size=len(SM_NAMES)),
       nproc=st.sampled_from([None, 1, 3]))
def test_sm_variables(dirs, environ, nproc):
    environ = {**environ, "SAGEMAKER_BASE_DIR": str(dirs / "no-such-base")}
    resolve_or_refuse(sagemaker.PLATFORM, environ, dirs / "dev", OPTIONS._replace(nproc_per_node=nproc))


_hp_values = st.one_of(_text, _numbers, _json_lists, st.just('"a b"'), st.just('{"a": 1}'), st.just("null"))
HP_BYTES = st.one_of(
    st.binary(max_size=64),
    st.dictionaries(_text, _hp_values, max_size=5).map(lambda d: json.dumps(d).encode()),
    st.dictionaries(_text, st.one_of(st.integers(), st.none(), st.lists(st.integers())), max_size=3).map(
        lambda d: json.dumps(d).encode()),
    st.lists(_text, max_size=3).map(lambda d: json.dumps(d).encode()),
)


@FUZZ
@given(content=HP_BYTES, argv=st.lists(st.one_of(_text, st.sampled_from(["--train-script", "t.py", "a", "b"])),
                                       max_size=8))
def test_hyperparameters_json(dirs, content, argv):
    (dirs / "base" / "input" / "config" / "hyperparameters.json").write_bytes(content)
    environ = {"SAGEMAKER_BASE_DIR": str(dirs / "base")}
    notes: list[str] = []
    try:
        repaired = sagemaker.PLATFORM.prepare_argv(argv, environ, notes)
    except ConfigError as err:
        check_message(err)
        return
    assert isinstance(repaired, list) and all(isinstance(word, str) for word in repaired)
    assert (repaired == argv) == (not notes)


@FUZZ
@given(raw=st.dictionaries(_text, st.one_of(_hp_values, VALUES), max_size=6))
def test_hyperparameter_decoding_and_rendering_match_aws(raw):
    decoded = aws_argv.decode(raw)
    user = aws_argv.user_hyperparameters(decoded)
    assert aws_argv.render_args(user) == mapping.to_cmd_args(user)


# --- the launcher's argv, both forms, and its LAUNCHER_* variables -----------------------------

_flags = sorted({flag for spec in SPECS for flag in spec.flags})
_prefixed = [p + spec.name.replace("_", sep) for spec in SPECS for p, sep in (("--launcher-", "-"),
                                                                              ("--launcher_", "_"))]
WORDS = st.one_of(st.sampled_from(_flags + _prefixed + ["--", "-", "--launcher-bogus", "t.py", "True", "false"]),
                  st.sampled_from(_flags).map(lambda f: f + "="), st.builds("{}={}".format, st.sampled_from(_flags),
                                                                                VALUES), VALUES)


@FUZZ
@given(argv=st.lists(WORDS, max_size=10),
       environ=st.dictionaries(st.sampled_from([spec.env for spec in SPECS]), VALUES, max_size=3))
def test_options_both_forms(argv, environ):
    try:
        inv = parse_invocation(argv, environ)
    except ConfigError as err:
        check_message(err)
        return
    o = inv.options
    assert inv.script and not inv.script.startswith("-")
    assert o.nproc_per_node is None or 1 <= o.nproc_per_node <= MAX_NPROC
    assert o.grace_period is None or (math.isfinite(o.grace_period) and 0 < o.grace_period <= MAX_SECONDS)
    assert 1 <= o.rdzv_timeout <= MAX_SECONDS and 0 <= o.max_restarts <= MAX_RESTARTS
    assert o.master_port is None or 1 <= o.master_port <= 65535
    if aws_argv.is_pairs_form(argv):  # the script's words are whole pairs of the argv, in order
        pairs = [tuple(argv[i:i + 2]) for i in range(0, len(argv), 2)]
        kept = [tuple(inv.script_args[i:i + 2]) for i in range(0, len(inv.script_args), 2)]
        assert all(pair in pairs for pair in kept)
        assert all(not key.startswith(("--launcher-", "--launcher_", "--train-script", "--train_script"))
                   for key, *_ in kept)


# --- every platform module, with its own variable names ----------------------------------------

_NAME = re.compile(r"\b[A-Z][A-Z0-9]*_[A-Z0-9_]*[A-Z0-9]\b|\b(?:RANK|HOSTNAME|HOME)\b")


def platform_names(platform) -> list[str]:
    """The environment variable names a platform's module mentions anywhere (code, docstrings)."""
    source = inspect.getsource(sys.modules[type(platform).__module__])
    return sorted(set(_NAME.findall(source)))


def _environments(names: list[str]):
    prefixes = sorted({name.split("_")[0] + "_" for name in names})
    generic = st.builds(str.__add__, st.sampled_from(prefixes), st.text("ABCDEFGHIJKLMNOPQRSTUVWXYZ_0123456789",
                                                                       min_size=1, max_size=12))
    return st.dictionaries(st.one_of(st.sampled_from(names), generic), VALUES, max_size=12)


PLATFORMS = [platform for platform, _ in platforms.ORDER]
ALL_NAMES = sorted({name for platform in PLATFORMS for name in platform_names(platform)})


@pytest.mark.parametrize("platform", PLATFORMS, ids=[p.name for p in PLATFORMS])
def test_each_platform(dirs, platform):
    names = platform_names(platform) or ["NO_NAMES"]

    @PER_PLATFORM
    @given(environ=_environments(names), nproc=st.sampled_from([None, 2]))
    def fuzz(environ, nproc):
        evidence = platform.detect(environ)
        assert isinstance(evidence, tuple) and all(isinstance(e, str) for e in evidence)
        resolve_or_refuse(platform, environ, dirs / "dev", OPTIONS._replace(nproc_per_node=nproc), bounded=False)

    fuzz()


@FUZZ
@given(environ=_environments(ALL_NAMES))
def test_detection_over_every_platforms_variables(dirs, environ):
    try:
        choice = platforms.choose(environ)
    except ConfigError as err:
        check_message(err, bounded=False)
        return
    resolve_or_refuse(choice.platform, environ, dirs / "dev", bounded=False)


# --- whatever a user passes reaches the script as AWS renders it -------------------------------

def _user_key(key: str) -> bool:
    return key not in ("train-script", "train_script") and not key.startswith(("launcher-", "launcher_"))


_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
              st.text(), st.sampled_from(["a b", "'q'", '"q"', "--dry-run", "--launcher-dry-run", "", " ", "é ü 字"])),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=8)
USER_HYPERPARAMETERS = st.dictionaries(
    st.one_of(st.text(max_size=12), st.sampled_from(["dry-run", "grace_period", "nproc-per-node", "b", "-", "--x"]))
    .filter(_user_key), _json, max_size=8)
LAUNCHER_HYPERPARAMETERS = st.fixed_dictionaries({}, optional={
    "launcher-grace-period": st.sampled_from([30, 2.5]), "launcher_nproc_per_node": st.integers(1, 8),
    "launcher-dry-run": st.booleans(), "launcher_max_restarts": st.integers(0, 3),
    "launcher-resolve": st.just({"algo-1": "127.0.0.1"})})


@FUZZ
@given(user=USER_HYPERPARAMETERS, ours=LAUNCHER_HYPERPARAMETERS, spelling=st.sampled_from(["train-script",
                                                                                          "train_script"]))
def test_generated_hyperparameters_reach_the_script_as_aws_renders_them(user, ours, spelling):
    argv = mapping.to_cmd_args({**user, **ours, spelling: "x.py"})  # AWS sorts every key together
    inv = parse_invocation(argv, {})
    assert aws_argv.is_pairs_form(argv) and inv.script == "x.py"
    assert list(inv.script_args) == mapping.to_cmd_args(user)
    o = inv.options
    assert o.grace_period == ours.get("launcher-grace-period")
    assert o.nproc_per_node == ours.get("launcher_nproc_per_node")
    assert o.dry_run is ours.get("launcher-dry-run", False)
    assert o.max_restarts == ours.get("launcher_max_restarts", 0)
    assert o.resolve == ours.get("launcher-resolve", {})


# --- files of every kind where a platform names a file ------------------------------------------

def _file_kind(root, kind: str, size: int):
    """A path under ``root`` that is a file of ``kind`` (made now), ``size`` bytes where a size applies."""
    path = root / f"obj-{kind.replace('/', '_')}-{size}"
    if os.path.lexists(path):
        return path
    if kind == "FIFO without a writer":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        SOCKETS.append(sock)
    elif kind in DEVICES:
        path.symlink_to(DEVICES[kind])
    elif kind == "sparse":
        with open(path, "wb") as fh:
            fh.truncate(size)
    elif kind == "symlink to a FIFO":
        path.symlink_to(_file_kind(root, "FIFO without a writer", 0))
    return path


SOCKETS: list = []
DEVICES = {"/dev/zero": "/dev/zero", "/dev/urandom": "/dev/urandom", "/dev/null": "/dev/null", "/dev/tty": "/dev/tty"}
KINDS = ["FIFO without a writer", "symlink to a FIFO", "directory", "socket", *DEVICES, "sparse"]
# The size bound: at the limit a sparse file is read (16 MiB of NULs: not a configuration); above it,
# sparse or not, it is refused from its size alone, before a byte is read.
SIZES = st.sampled_from([0, 1, MAX_CONFIG_BYTES - 1, MAX_CONFIG_BYTES, MAX_CONFIG_BYTES + 1, 1 << 30, 1 << 40])


def _readers(dirs, path) -> dict[str, Callable[[], object]]:
    """Every place a platform reads a file it is given, pointed at ``path``."""
    config = dirs / "kinds" / "input" / "config"
    host = HostView(dev_dir=str(dirs / "dev"), hostname="n1")
    for name in ("resourceconfig.json", "hyperparameters.json"):
        if os.path.lexists(config / name):
            (config / name).unlink()
    base = {"SAGEMAKER_BASE_DIR": str(dirs / "kinds")}

    def sagemaker_file(name: str) -> Callable[[], object]:
        def read() -> object:
            (config / name).symlink_to(path)
            if name == "hyperparameters.json":
                return sagemaker.PLATFORM.prepare_argv(["t.py"], base, [])
            return sagemaker.PLATFORM.resolve(base, host)
        return read

    return {
        "resourceconfig.json": sagemaker_file("resourceconfig.json"),
        "hyperparameters.json": sagemaker_file("hyperparameters.json"),
        "PBS_NODEFILE": lambda: pbs.PLATFORM.resolve({"PBS_NODEFILE": str(path), "PBS_JOBID": "1.srv"}, host),
        "CLUSTER_NODES_METADATA_FILE": lambda: oci.PLATFORM.resolve(
            {"CLUSTER_NODES_METADATA_FILE": str(path), "NODE_COUNT": "2", "NODE_RANK": "0"}, host),
        "read_bounded": lambda: read_bounded(str(path), MAX_CONFIG_BYTES, "the file"),
    }


@settings(FUZZ, max_examples=60)
@given(kind=st.sampled_from(KINDS), size=SIZES, reader=st.sampled_from(
    ["resourceconfig.json", "hyperparameters.json", "PBS_NODEFILE", "CLUSTER_NODES_METADATA_FILE", "read_bounded"]))
def test_files_of_every_kind_are_refused_at_once(dirs, kind, size, reader):
    """A FIFO, a device, a socket, a directory, a huge or sparse file where a platform reads a file: a
    one-line ConfigError naming it, at once (an alarm fails a read that blocks), in bounded memory."""
    (dirs / "kinds" / "input" / "config").mkdir(parents=True, exist_ok=True)
    path = _file_kind(dirs, kind, size if kind == "sparse" else 0)
    if kind == "/dev/tty" and not os.path.exists("/dev/tty"):
        return
    if kind == "sparse" and size <= MAX_CONFIG_BYTES and reader == "read_bounded":
        assert read_bounded(str(path), MAX_CONFIG_BYTES, "the file") == b"\0" * size  # within the bound: read
        return
    read = _readers(dirs, path)[reader]
    tracemalloc.start()
    signal.alarm(20)  # a read that blocks (a FIFO) would hang for ever: fail instead
    try:
        with pytest.raises(ConfigError) as refused:
            read()
    finally:
        signal.alarm(0)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    check_message(refused.value, bounded=False)
    assert "Traceback" not in str(refused.value)
    if kind != "sparse":
        assert "not a regular file" in str(refused.value) or "does not exist" in str(refused.value)
    # At most the bound's bytes are ever read; a file within it is parsed (decoded, split: a few copies).
    assert peak < 8 * MAX_CONFIG_BYTES, peak


@FUZZ
@given(content=st.binary(max_size=300), limit=st.integers(0, 400))
def test_read_bounded_returns_the_bytes_or_refuses_by_size(tmp_path_factory, content, limit):
    path = tmp_path_factory.mktemp("bounded") / "f"
    path.write_bytes(content)
    try:
        data = read_bounded(str(path), limit, "F")
    except ConfigError as err:
        assert len(content) > limit and "larger than" in str(err)
    else:
        assert data == content and len(content) <= limit


# a worker's exit record (launcher.bootstrap writes it; a script could write anything there): any bytes read as
# None or a record whose fields are each valid or None; a failure's time is the record's own "ended" when valid.
_json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                            lambda inner: st.lists(inner, max_size=3), max_leaves=5)


@FUZZ
@given(content=st.one_of(st.binary(max_size=200),
                         st.dictionaries(st.sampled_from(["code", "stderr_offset", "started", "ended", "x"]),
                                         _json_values).map(lambda d: json.dumps(d).encode())))
def test_exit_records_any_bytes(tmp_path_factory, content):
    from launcher.failure import failed_at, read_exit_record

    directory = tmp_path_factory.mktemp("exits")
    (directory / "42.json").write_bytes(content)
    record = read_exit_record(str(directory), 42)
    if record is None:
        assert failed_at(str(directory), 42) is None
        return
    assert type(record["code"]) is int and 0 <= record["code"] <= 255
    for key in ("started", "ended"):
        assert record[key] is None or (math.isfinite(record[key]) and record[key] > 0)
    when = failed_at(str(directory), 42)
    if record["code"] == 0:
        assert when is None
    else:
        assert when == (record["ended"] if record["ended"] is not None else os.stat(directory / "42.json").st_mtime)


# simulate's --fault HOST:KIND:AFTER[:SECONDS]: any text is a Fault or a one-line ConfigError, and every
# well-formed spec means what it says.
FAULT_HOSTS = ("algo-1", "algo-2")
_fault_kinds = st.sampled_from(["SIGKILL", "term", "9", "partition", "poweroff", "blip", "pause", "vmpause",
                                "starve", "saturate", "SIGNOPE", ""])
_fault_numbers = st.one_of(_numbers, st.floats(allow_nan=True, allow_infinity=True).map(repr),
                           st.integers(-3, 10**6).map(lambda n: f"step={n}"))


@FUZZ
@given(st.one_of(st.lists(st.one_of(_hosts, _fault_kinds, _fault_numbers, _text), min_size=0, max_size=6)
                 .map(":".join), _text))
def test_fault_specs_any_text(text):
    from launcher.simulate import Fault, parse_fault

    try:
        fault = parse_fault(text, FAULT_HOSTS)
    except ConfigError as err:
        check_message(err)
        return
    assert isinstance(fault, Fault) and fault.host in FAULT_HOSTS
    assert (fault.after is None) != (fault.step is None)
    assert fault.after is None or 0 <= fault.after < math.inf
    assert (fault.seconds is not None) == fault.transient == (len(text.split(":")) == 4)
    assert fault.seconds is None or 0 < fault.seconds < math.inf


@FUZZ
@given(st.sampled_from(FAULT_HOSTS), st.sampled_from(["blip", "pause", "vmpause", "starve", "saturate"]),
       st.one_of(st.floats(0, 86400), st.integers(0, 10**6).map(lambda n: f"step={n}")),
       st.floats(0.001, 86400))
def test_transient_fault_specs_mean_what_they_say(host, kind, after, seconds):
    from launcher.simulate import Fault, parse_fault

    fault = parse_fault(f"{host}:{kind}:{after}:{seconds!r}", FAULT_HOSTS)
    when = {"step": int(after[5:])} if isinstance(after, str) else {"after": after}
    assert fault == Fault(host, 0, kind=kind, seconds=seconds, **when) and fault.transient
