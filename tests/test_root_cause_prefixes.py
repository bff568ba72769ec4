"""The root cause is found whatever torch and the launcher put before a worker's lines.

torch's excepthook (after ``init_process_group``) prefixes every line of an uncaught exception's
traceback with ``[rankN]: ``; the launcher's copy adds ``[rankN]:`` (torchrun's ``--tee`` its own
``[default0]:``); C++ log lines start ``[W1125 03:04:05.123 ...]``. A hypothesis test over those
prefixes, then real runs of a script that raises after ``init_process_group``, with and without
``@record``, on 1 host and on 2: line 2 of every host's report is the exception, a peer's "Connection
closed by peer" is never a host's own cause, and the hosts agree on the exit code.
"""

from __future__ import annotations

import threading

import pytest
from conftest import assert_gone, free_port
from hypothesis import given
from hypothesis import strategies as st
from test_launcher_processes import job_pids, make_host, start_launcher

from launcher import failure

NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}(\.[A-Za-z_][A-Za-z0-9_]{0,10}){0,3}", fullmatch=True)
SUFFIXES = st.sampled_from(["Error", "Exception", "Interrupt", "Exit", "Failure"])
MESSAGES = st.text(st.characters(blacklist_categories=("Cc", "Cs")), max_size=80)
PREFIX = st.one_of(
    st.integers(0, 10**6).map(lambda n: f"[rank{n}]:"),  # the launcher's copy (launcher/workerlogs.py)
    st.integers(0, 10**6).map(lambda n: f"[rank{n}]: "),  # torch's excepthook
    st.integers(0, 999).map(lambda n: f"[default{n}]:"),  # torchrun's own tee prefix
    st.tuples(st.from_regex(r"[a-z_]{1,12}", fullmatch=True), st.integers(0, 99)).map(lambda t: f"[{t[0]}{t[1]}]:"))
PREFIXES = st.lists(PREFIX, max_size=4).map("".join)
LOG_TEMPLATE = st.tuples(st.sampled_from("IWEF"), st.integers(0, 9999)).map(
    lambda t: f"[{t[0]}{t[1]:04d} 03:04:05.123456789 4242 socket.cpp:207] ")


@given(prefixes=PREFIXES, name=NAMES, suffix=SUFFIXES, message=MESSAGES)
def test_the_exception_line_is_found_under_any_prefixes(prefixes, name, suffix, message):
    line = f"{name}{suffix}: {message}".rstrip()
    assert failure.exception_line(prefixes + line) == line.strip()
    traceback = "\n".join(prefixes + part for part in
                          ["Traceback (most recent call last):", '  File "t.py", line 3, in <module>',
                           "    main()", line])
    assert failure._last_exception_line(traceback + "\n" + prefixes + "rank done") == line.strip()


@given(prefixes=PREFIXES, template=LOG_TEMPLATE, name=NAMES, suffix=SUFFIXES, message=MESSAGES)
def test_a_log_line_that_names_an_error_is_never_the_exception(prefixes, template, name, suffix, message):
    assert failure.exception_line(f"{prefixes}{template}{name}{suffix}: {message}") == ""


@given(prefixes=PREFIXES, text=st.text(max_size=100))
def test_stripping_removes_only_prefixes(prefixes, text):
    stripped = failure.strip_prefixes(prefixes + text)
    assert text.endswith(stripped)  # only prefixes go: what is left is the end of the text


SCRIPT = """\
import os, sys, time
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


def main():
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    for step in range(100000):
        if rank == int(sys.argv[1]) and step == 3:
            raise ValueError(f"bad batch on rank {rank} at step {step}")
        tensor = torch.ones(1)
        dist.all_reduce(tensor)
        time.sleep(0.05)


if __name__ == "__main__":
    (record(main) if sys.argv[2] == "record" else main)()
"""


def hosts_run(tmp_path, names, fail_rank, wrap):
    script = tmp_path / "raises.py"
    script.write_text(SCRIPT)
    bases = [make_host(tmp_path, h, names) for h in names]
    port, watch = free_port(), free_port()
    procs = [start_launcher(b, ["--nproc-per-node", "2", str(script), str(fail_rank), wrap], port, names,
                            LAUNCHER_WATCH_PORT=str(watch)) for b in bases]
    errs: list[list[str]] = [[] for _ in procs]
    readers = [threading.Thread(target=lambda p=p, e=e: e.extend(p.stderr), daemon=True) for p, e in zip(procs, errs)]
    for reader in readers:
        reader.start()
    for proc in procs:
        proc.wait(timeout=300)
    for reader in readers:
        reader.join(timeout=30)
    assert_gone({p.pid for p in procs} | job_pids(None, *bases))
    return bases, [p.returncode for p in procs], ["".join(e) for e in errs]


@pytest.mark.job
@pytest.mark.parametrize("wrap", ["record", "plain"])
def test_one_host_line_2_is_the_exception(tmp_path, wrap):
    bases, codes, errs = hosts_run(tmp_path, ["algo-1"], 1, wrap)
    assert codes == [1], errs[0][-3000:]
    text = (bases[0] / "output" / "failure").read_text()
    report = text.splitlines()
    assert report[:2] == ["algo-1: rank 1 (local rank 1) exited with code 1",
                          "ValueError: bad batch on rank 1 at step 3"]
    assert not any(line.startswith("[rank") for line in report)  # the report carries no prefixes
    assert "raises.py" in text and len(text) <= 1024  # the traceback, within SageMaker's limit


@pytest.mark.job
@pytest.mark.parametrize("wrap", ["record", "plain"])
def test_two_hosts_agree_and_line_2_is_the_exception_everywhere(tmp_path, wrap):
    bases, codes, errs = hosts_run(tmp_path, ["algo-1", "algo-2"], 2, wrap)
    assert codes == [1, 1], errs[0][-3000:] + "\n=====\n" + errs[1][-3000:]
    reports = [(b / "output" / "failure").read_text().splitlines() for b in bases]
    head = ["algo-2: rank 2 (local rank 0) exited with code 1", "ValueError: bad batch on rank 2 at step 3"]
    for report in reports:
        assert report[:2] == head, report
    assert reports[0][2].startswith("then algo-1: ")  # a peer's "Connection closed by peer" came after it
