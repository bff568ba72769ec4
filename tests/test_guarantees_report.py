"""The failure report always gets out, with the worker's exit code and the real root cause.

Unit tests for the parts (torchrun's failure table, the report writer, the bounded stderr tail and
output pump) and real launcher runs: an output directory where the report cannot be written, an
exception text that UTF-8 cannot encode, a rank that exits on its own while torchrun SIGTERMs the other.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import shutil
import subprocess
import threading
import time

import pytest
from conftest import PYTHON, assert_gone, free_port, launcher_env
from hypothesis import given, settings
from hypothesis import strategies as st
from test_launcher_processes import WORKER, job_pids, make_host, start_launcher

from launcher import failure
from launcher.cluster import Cluster
from launcher.command import Launch
from launcher.outcome import Outcome
from launcher.supervise import Sink, StderrTail, _pump

# torchrun 2.14.1's own words for: rank 1 sys.exit(7)ed, torchrun then SIGTERMed rank 0 (captured).
EXIT7_ROOT = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\x20
============================================================
w.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-22_20:03:29
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 4461)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 4461
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_20:03:29
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 7 (pid: 4462)\x20
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================""".splitlines()


def swapped(lines):
    """The same table as torchrun prints it when the timestamp tie goes the other way."""
    text = "\n".join(lines)
    first = text[text.index("[1]:"):text.index("\n----", text.index("[1]:"))]
    root = text[text.index("[0]:"):text.index("\n====", text.index("[0]:"))]
    text = text.replace(first, "@@A").replace(root, "@@B")
    return text.replace("@@A", root.replace("[0]:", "[1]:")).replace("@@B", first.replace("[1]:", "[0]:")).splitlines()


def launch_in(tmp_path):
    fields = {"argv": (), "env_changes": {}, "env_removed": (), "run_dir": str(tmp_path),
              "error_file": str(tmp_path / "torchrun_error.json"), "log_dir": str(tmp_path / "logs")}
    return Launch(**{k: v for k, v in fields.items() if k in Launch._fields})


CLUSTER = Cluster(platform="sagemaker", nnodes=1, node_rank=0, nproc_per_node=2, current_host="algo-1",
                  master_addr="algo-1")


# --- torchrun's failure table: every entry, never torchrun's own SIGTERM ----------------------------

@pytest.mark.parametrize("order", ["exit-first", "sigterm-first"])
def test_root_cause_is_the_rank_that_failed_on_its_own(tmp_path, order):
    lines = EXIT7_ROOT if order == "exit-first" else swapped(EXIT7_ROOT)
    entries = failure.parse_failures(["[rank0]: noise", *lines])
    assert len(entries) == 2
    table_root = entries[0]["rank"]
    assert table_root == ("1 (local_rank: 1)" if order == "exit-first" else "0 (local_rank: 0)")
    outcome = Outcome(returncode=1, pid=1, stderr_tail=lines)
    cause = failure.find_root_cause(outcome, launch_in(tmp_path))
    assert (cause.rank, cause.local_rank, cause.exitcode) == (1, 1, 7)
    assert failure.exit_code(outcome, cause) == 7
    report = failure.compose_report(CLUSTER, outcome, cause, 7)
    assert report.startswith("algo-1: rank 1 (local rank 1) exited with code 7")


def test_only_sigterms_keep_the_tables_root_cause():
    lines = swapped([line.replace("exitcode  : 7 (pid: 4462) ", "exitcode  : -15 (pid: 4462)")
                     for line in EXIT7_ROOT])
    entries = failure.parse_failures(lines)
    assert [failure._exitcode(e) for e in entries] == [-15, -15]
    assert failure.pick_root_cause(entries) is entries[0]


def test_a_real_signal_beats_torchruns_sigterm(tmp_path):
    lines = swapped([line.replace("exitcode  : 7 (pid: 4462) ", "exitcode  : -9 (pid: 4462)")
                     for line in EXIT7_ROOT])
    cause = failure.find_root_cause(Outcome(returncode=1, pid=1, stderr_tail=lines), launch_in(tmp_path))
    assert (cause.rank, cause.exitcode, cause.exception) == (1, -9, "killed by SIGKILL")


def test_multiline_tracebacks_and_error_files_per_entry(tmp_path):
    err = tmp_path / "rank1_error.json"
    err.write_text(json.dumps({"message": {"message": "ValueError: from the file",
                                           "extraInfo": {"py_callstack": "Traceback:\n  here\nValueError: x"}}}))
    lines = swapped(EXIT7_ROOT)
    at = next(i for i, line in enumerate(lines) if "exitcode  : 7" in line)
    lines[at + 1] = f"  error_file: {err}"
    lines[at + 2:at + 3] = ["  traceback : Traceback (most recent call last):", "    rank : 3 (local_rank: 3)",
                            "  ValueError: x"]
    entries = failure.parse_failures(lines)
    assert entries[1]["traceback"].splitlines()[1:] == ["    rank : 3 (local_rank: 3)", "  ValueError: x"]
    assert entries[1]["rank"] == "1 (local_rank: 1)"  # a field-like traceback line stays in the traceback
    cause = failure.find_root_cause(Outcome(returncode=1, pid=1, stderr_tail=lines), launch_in(tmp_path))
    assert (cause.rank, cause.exception) == (1, "ValueError: from the file")


# --- bounded reads of what workers wrote -----------------------------------------------------------

def test_oversized_or_malformed_error_files_fall_back(tmp_path):
    path = tmp_path / "error.json"
    for content in ["[1, 2]", '"text"', '{"message": {"extraInfo": 5}}', "{bad"]:
        path.write_text(content)
        got = failure.read_error_file(str(path))
        assert got is None or got["traceback"] == "", content
    path.write_text(json.dumps({"message": "x" * (failure.ERROR_FILE_LIMIT + 10)}))
    assert failure.read_error_file(str(path)) is None
    path.write_text(json.dumps({"message": "RuntimeError: small"}))
    assert failure.read_error_file(str(path))["exception"] == "RuntimeError: small"


def test_log_tail_is_bounded_and_still_finds_the_cause(tmp_path):
    import tracemalloc

    log = tmp_path / "logs" / "run" / "attempt_0" / "0" / "stderr.log"
    log.parent.mkdir(parents=True)
    with open(log, "wb") as fh:
        for _ in range(64):
            fh.write(b"y" * (1 << 20))  # 64 MiB without a newline
        fh.write(b"\nTraceback (most recent call last):\n  File \"w.py\", line 3\nKeyError: 'the real one'\n")
    tracemalloc.start()
    text = failure.worker_stderr(str(tmp_path / "logs"), 0)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 * failure.LOG_TAIL_BYTES, peak
    assert failure._last_exception_line(text) == "KeyError: 'the real one'"
    assert max(len(line) for line in text.splitlines()) <= failure.LOG_LINE_CHARS


# --- the stderr tail and the pump ------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\r", b"")), max_size=30),
       st.integers(1, 5), st.integers(1, 8))
def test_stderr_tail_is_the_last_lines_capped_however_chunked(chunks, lines, cap):
    tail = StderrTail(lines, cap)
    for chunk in chunks:
        tail.feed(chunk)
    whole = b"".join(chunks).split(b"\n")
    if whole[-1] == b"":
        whole.pop()
    expected = [line[:cap].decode("utf-8", "replace") for line in whole[-lines:]]
    assert tail.lines() == expected


def test_huge_lines_before_the_table_cannot_push_it_out():
    tail = StderrTail()
    for _ in range(200):
        tail.feed(b"z" * 65536)  # one 12 MiB line
    for line in EXIT7_ROOT:
        tail.feed(line.encode() + b"\n")
    assert sum(len(line) for line in tail.lines()) <= 400 * 2048
    assert failure.pick_root_cause(failure.parse_failures(tail.lines()))["rank"] == "1 (local_rank: 1)"


class _Broken:
    def __init__(self):
        self.calls = 0

    def write(self, _data):
        self.calls += 1
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        pass


def test_pump_keeps_draining_when_our_stream_is_gone():
    writer = subprocess.Popen([PYTHON, "-c", "import sys\nfor _ in range(160): sys.stdout.buffer.write(b'x' * 65536)"],
                              stdout=subprocess.PIPE)
    sink, tail = _Broken(), StderrTail()
    pump = threading.Thread(target=_pump, args=(writer.stdout, sink, tail), daemon=True)
    pump.start()
    assert writer.wait(timeout=30) == 0  # 10 MiB written: it would block on a full pipe if we stopped reading
    pump.join(timeout=10)
    assert not pump.is_alive() and sink.calls == 1
    assert tail.lines() == ["x" * 2048]
    assert_gone([writer.pid])


def test_pump_passes_bytes_on_before_a_newline():
    read_fd, write_fd = os.pipe()
    got = []

    class Sink:
        def write(self, data):
            got.append(data)

        def flush(self):
            pass

    pump = threading.Thread(target=_pump, args=(os.fdopen(read_fd, "rb"), Sink(), None), daemon=True)
    pump.start()
    os.write(write_fd, b"no newline yet")
    deadline = time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    os.close(write_fd)
    pump.join(timeout=5)
    assert got and got[0] == b"no newline yet"


def test_a_closed_sink_lets_nothing_of_the_job_follow_the_report():
    """The report ends stderr: once supervise closes the sinks, what a pump still copies (a pipe that a
    process outside the tree holds, a pump starved of CPU) is dropped, and a write under way (our reader
    is slow: the destination is full) finishes before close returns."""
    source_read, source_write = os.pipe()
    dest_read, dest_write = os.pipe()
    os.set_blocking(dest_write, False)
    filler = 0
    with contextlib.suppress(BlockingIOError):
        while True:
            filler += os.write(dest_write, b"f" * 4096)
    os.set_blocking(dest_write, True)
    destination = os.fdopen(dest_write, "wb")
    sink = Sink(destination)
    pump = threading.Thread(target=_pump, args=(os.fdopen(source_read, "rb"), sink, None), daemon=True)
    pump.start()
    os.write(source_write, b"before the report\n")
    deadline = time.monotonic() + 30
    while not sink._lock.locked():  # the pump's write is under way, blocked on the full destination
        assert time.monotonic() < deadline, "the pump never wrote"
        time.sleep(0.01)
    closer = threading.Thread(target=sink.close, daemon=True)
    closer.start()
    closer.join(timeout=0.5)
    assert closer.is_alive(), "close returned while a write was still under way"
    got = bytearray()
    while closer.is_alive():  # our slow reader catches up
        if select.select([dest_read], [], [], 0.05)[0]:
            got += os.read(dest_read, 1 << 16)
    os.write(source_write, b"after the report\n")
    os.close(source_write)
    pump.join(timeout=30)
    assert not pump.is_alive()
    destination.close()
    while True:
        chunk = os.read(dest_read, 1 << 16)
        if not chunk:
            break
        got += chunk
    os.close(dest_read)
    assert bytes(got) == b"f" * filler + b"before the report\n"
    assert sink.dropped == len(b"after the report\n")


# --- the writer: atomic, best text, never raises ---------------------------------------------------

def test_unencodable_text_is_written_escaped(tmp_path):
    path = tmp_path / "output" / "failure"
    report = "algo-1: rank 0\nFileNotFoundError: " + os.fsdecode(b"/data/\xff.txt")
    assert failure.write_failure_file(str(path), report) is None
    assert path.read_bytes() == b"algo-1: rank 0\nFileNotFoundError: /data/\\udcff.txt"
    assert os.listdir(path.parent) == ["failure"]


def test_limit_is_in_bytes_and_cuts_at_a_character(tmp_path):
    path = tmp_path / "failure"
    assert failure.write_failure_file(str(path), "é" * 3000, 4096) is None
    data = path.read_bytes()
    assert len(data) == 4096 and data.decode("utf-8") == "é" * 2048
    assert failure.write_failure_file(str(path), "a" * 10 + "€", 12) is None
    assert path.read_bytes() == b"a" * 10


@pytest.mark.parametrize("blocker", ["directory", "under-a-file"])
def test_unwritable_destination_says_why_and_never_raises(tmp_path, blocker):
    if blocker == "directory":
        path = tmp_path / "output" / "failure"
        path.mkdir(parents=True)
    else:
        (tmp_path / "output").write_text("a file where the directory should be")
        path = tmp_path / "output" / "failure"
    problem = failure.write_failure_file(str(path), "the report")
    assert problem and "\n" not in problem and ("Error" in problem)
    assert sorted(os.listdir(tmp_path)) == ["output"]  # no temporary file left anywhere
    if blocker == "directory":
        assert os.listdir(path) == []


def test_readers_never_see_an_empty_or_partial_report(tmp_path):
    path = tmp_path / "failure"
    reports = [(str(i) * 1000)[:1000] for i in range(10)]
    failure.write_failure_file(str(path), reports[0])
    seen, stop = set(), threading.Event()

    def read():
        while not stop.is_set():
            seen.add(path.read_text())

    reader = threading.Thread(target=read)
    reader.start()
    for i in range(300):
        failure.write_failure_file(str(path), reports[i % 10])
    stop.set()
    reader.join()
    assert seen <= set(reports) and len(seen) > 1
    assert os.listdir(tmp_path) == ["failure"]


def _in_mount_namespace(script: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``sh -c script`` in a private mount namespace (its mounts vanish with it)."""
    if not shutil.which("unshare") or os.geteuid() != 0:
        pytest.skip("needs root and unshare for a private mount namespace")
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *args],
                          capture_output=True, text=True, timeout=120, env=launcher_env())


WRITERS = {  # every file a platform reads while the launcher may write it: one writer (launcher/filewriter.py)
    "failure": ("from launcher import failure; import sys; "
                "print(failure.write_failure_file(sys.argv[1], 'new report', 4096))",
                "new report"),
    "outcome": ("from launcher import report; import sys; print(report.write_outcome(sys.argv[1], {'new': 1}))",
                '{\n  "new": 1\n}\n'),
}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_bind_mounted_file_is_overwritten_in_place(tmp_path, writer):
    """Kubernetes' /dev/termination-log is a bind-mounted file: it cannot be replaced, only written."""
    target, source = tmp_path / "termination-log", tmp_path / "host-file"
    target.write_text("")
    source.write_text("old text that is longer than what is written now")
    code, written = WRITERS[writer]
    proc = _in_mount_namespace('mount --bind "$1" "$2" && exec "$3" -c "$4" "$2"',
                               str(source), str(target), PYTHON, code)
    assert proc.returncode == 0 and proc.stdout.strip() == "None", proc.stderr
    assert source.read_text() == written


# gloo's own words when a peer's connection closes: two characters, seven bytes of UTF-8 at its end
GLOO_PEER_CLOSED = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
                    "[127.0.0.1]:37277. This is typically caused by a remote worker crashing. Check the logs of "
                    "the remote worker before reporting an error. GLHF! \U0001f3d6\ufe0f")


@settings(max_examples=300, deadline=None)
@given(text=st.text(st.characters(blacklist_categories=("Cc",)) | st.sampled_from("\n\udcff\U0001f3d6\ufe0f"),
                    max_size=300),
       limit=st.integers(1, 400))
def test_the_report_shown_is_the_report_written_whatever_its_characters(tmp_path_factory, text, limit):
    """The failure file and stderr's last lines are one text: cut at ``limit`` bytes of UTF-8 at a
    character (so at most ``limit`` characters too), unencodable characters escaped the same way in both."""
    import io
    import sys

    from launcher import report

    path = tmp_path_factory.mktemp("out") / "failure"
    err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    real, sys.stderr = sys.stderr, err
    try:
        report.deliver(report.Verdict("worker_exit", 7), text, report.Clock(0.0), None, str(path), limit,
                       ("algo-1", 0, 2, "sagemaker"))
    finally:
        sys.stderr = real
    shown = err.buffer.getvalue()
    if not path.exists():  # nothing fits (an empty report, or a first character longer than the limit)
        assert shown == b""
        assert not text or len(text[0].encode("utf-8", "backslashreplace")) > limit
        return
    written = path.read_bytes()
    assert shown == written + b"\n"
    assert len(written) <= limit and len(written.decode("utf-8")) <= limit
    assert text.encode("utf-8", "backslashreplace").startswith(written)


def test_a_report_cut_inside_gloos_emoji_ends_the_same_in_the_file_and_on_stderr(tmp_path, capfdbinary):
    """Found by CI: a 1024-character report whose traceback held gloo's "GLHF! \U0001f3d6\ufe0f" was printed cut
    at 1024 characters and written cut at 1024 bytes: the two ended on different lines."""
    from launcher import report

    text = ("algo-2: rank 2 (local rank 0) exited with code 7\nthen algo-1: rank 0 (local rank 0) exited with code 1\n"
            + GLOO_PEER_CLOSED + "\n" + "  File \"/venv/torch/autograd/graph.py\", line 1072, in backward\n" * 30)
    report.deliver(report.Verdict("worker_exit", 7), text, report.Clock(0.0), None, str(tmp_path / "failure"), 1024,
                   ("algo-1", 0, 2, "sagemaker"))
    shown = capfdbinary.readouterr().err
    written = (tmp_path / "failure").read_bytes()
    assert len(written) <= 1024 and shown.endswith(written + b"\n")
    assert "GLHF! \U0001f3d6\ufe0f" in written.decode("utf-8")


def test_print_report_survives_a_closed_or_broken_stderr():
    code = ("import os, sys\nfrom launcher import failure\n"
            "os.close(2) if sys.argv[1] == 'closed' else None\n"
            "failure.print_report('report \\udcff', ['note'])\nprint('survived')")
    for how in ("closed", "broken"):
        proc = subprocess.Popen([PYTHON, "-c", code, how], env=launcher_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        if how == "broken":
            proc.stderr.close()  # nobody reads stderr: writing to it gets EPIPE
        out = proc.stdout.read()
        assert proc.wait(timeout=30) == 0 and out == b"survived\n", how
        if how == "closed":
            assert proc.stderr.read() == b""


# --- real launcher runs ----------------------------------------------------------------------------

RECORD_PIDS = """\
import json, os, sys
with open(os.path.join(os.environ["WORKER_RECORD_DIR"], "rank%s.json" % os.environ["RANK"]), "w") as fh:
    json.dump({"rank": int(os.environ["RANK"]), "pid": os.getpid(), "ppid": os.getppid()}, fh)
"""


def run_host(tmp_path, args, wrap=None, nproc=1):
    base = make_host(tmp_path, "algo-1", ["algo-1"])
    argv = ["--nproc-per-node", str(nproc), *args]
    if wrap is None:
        proc = start_launcher(base, argv, free_port(), ["algo-1"])
    else:  # the launcher's own process, exec'd after the wrapper set up its mount namespace
        env = launcher_env(SAGEMAKER_BASE_DIR=str(base), WORKER_RECORD_DIR=str(base / "records"),
                           LAUNCHER_MASTER_PORT=str(free_port()), LAUNCHER_RESOLVE="algo-1=127.0.0.1")
        (base / "output").mkdir(exist_ok=True)
        proc = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", wrap, "sh",
                                 str(base / "output"), PYTHON, "-m", "launcher", *argv],
                                env=env, cwd=str(base), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _out, err = proc.communicate(timeout=120)
    torchrun = re.search(r"torchrun started as pid (\d+)", err)
    assert_gone(job_pids(proc, base) | ({int(torchrun.group(1))} if torchrun else set()))
    return base, proc.returncode, err


def report_on_stderr(err, first_line):
    """The report's lines: from ``first_line`` to the end of stderr; the launcher did not crash."""
    lines = err.rstrip("\n").splitlines()
    assert first_line in lines, err[-3000:]
    assert "launcher/cli.py" not in err and "launcher/failure.py" not in err
    return lines[lines.index(first_line):]


@pytest.mark.job
@pytest.mark.parametrize("blocker", ["read-only-mount", "directory"])
def test_unwritable_output_still_reports_with_the_workers_code(tmp_path, blocker):
    wrap = None
    if blocker == "read-only-mount":
        if not shutil.which("unshare") or os.geteuid() != 0:
            pytest.skip("needs root and unshare for a private read-only bind mount")
        wrap = 'mount --bind -o ro "$1" "$1" && touch "$1/probe" 2>/dev/null && exit 99; shift; exec "$@"'
    else:
        (tmp_path / "algo-1" / "output" / "failure").mkdir(parents=True)
    base, code, err = run_host(tmp_path, [WORKER, "--exit-code", "7", "--fail-rank", "0"], wrap)
    assert code == 7, err[-3000:]  # 99 would mean the mount was writable: the test would prove nothing
    report = report_on_stderr(err, "algo-1: rank 0 (local rank 0) exited with code 7")
    assert report == ["algo-1: rank 0 (local rank 0) exited with code 7"]  # nothing else is known
    lines = err.splitlines()
    why = [i for i, line in enumerate(lines) if "could not write the failure report" in line]
    assert len(why) == 1 and str(base / "output" / "failure") in lines[why[0]]
    assert ("Read-only file system" if blocker == "read-only-mount" else "directory") in lines[why[0]]
    assert lines[why[0] + 1] == report[0]  # said just before the report
    assert not os.path.isfile(base / "output" / "failure")


@pytest.mark.job
def test_unencodable_exception_text_reaches_file_and_stderr(tmp_path):
    script = tmp_path / "bad_name.py"
    script.write_text(
        RECORD_PIDS + "from torch.distributed.elastic.multiprocessing.errors import record\n\n"
        "@record\ndef main():\n"
        "    raise FileNotFoundError('no such file: ' + os.fsdecode(b'/data/\\xff\\xfe.txt'))\n\n"
        "main()\n")
    base, code, err = run_host(tmp_path, [str(script)])
    assert code == 1, err[-3000:]
    text = (base / "output" / "failure").read_bytes().decode("utf-8")
    assert text.splitlines()[:2] == ["algo-1: rank 0 (local rank 0) exited with code 1",
                                     "FileNotFoundError: no such file: /data/\\udcff\\udcfe.txt"]
    assert "bad_name.py" in text
    assert report_on_stderr(err, text.splitlines()[0]) == text.rstrip("\n").splitlines()


@pytest.mark.job
def test_closed_stdout_neither_blocks_torchrun_nor_changes_the_code(tmp_path):
    """Whoever read the launcher's stdout went away: worker output keeps draining, the report gets out."""
    script = tmp_path / "chatty.py"
    script.write_text(RECORD_PIDS + "for i in range(200000):\n    print('progress line', i)\nsys.exit(7)\n")
    base = make_host(tmp_path, "algo-1", ["algo-1"])
    proc = start_launcher(base, ["--nproc-per-node", "1", str(script)], free_port(), ["algo-1"])
    proc.stdout.close()  # 4 MB of stdout to a pipe nobody reads: EPIPE for the launcher
    proc.stdout = None
    try:
        _out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()  # its watchdog then kills torchrun and the worker
        proc.communicate()
        assert_gone(job_pids(proc, base))
        pytest.fail("the launcher hung: torchrun blocked on a full stdout pipe nobody drained")
    assert proc.returncode == 7, err[-3000:]
    report = report_on_stderr(err, "algo-1: rank 0 (local rank 0) exited with code 7")
    assert report == (base / "output" / "failure").read_text().splitlines()
    assert len(job_pids(proc, base)) == 3  # the launcher, torchrun, the worker
    assert_gone(job_pids(proc, base))


@pytest.mark.job
def test_rank_exiting_on_its_own_is_the_cause_not_torchruns_sigterm(tmp_path):
    """Rank 1 exits 7 (no error file: record passes SystemExit through); torchrun SIGTERMs rank 0."""
    base, code, err = run_host(tmp_path, [WORKER, "--exit-code", "7", "--fail-rank", "1", "--steps", "100000",
                                          "--step-sleep", "0.01"], nproc=2)
    assert code == 7, err[-3000:]
    assert (base / "output" / "failure").read_text().startswith("algo-1: rank 1 (local rank 1) exited with code 7")
    assert "SIGTERM" in err  # torchrun did stop rank 0 with a SIGTERM

