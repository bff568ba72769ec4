"""``simulate --network netns``: hosts that are really apart, each with its own network namespace, address,
hostname and ``/etc/hosts`` on a private bridge; partition and poweroff faults; ``--platform-stop off``.

Every PID checked is the machine's (hosts keep the machine's PID namespace). Each test also proves that
the machine's network is as before: ``ip netns list`` and ``ip link`` show nothing new, ``/etc/hosts``
and the hostname are untouched. Skipped, with the reason, where network namespaces are not permitted.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest
from conftest import PYTHON, REPO, LiveProcess, assert_gone, launcher_env
from test_simulate import Simulate, job_pids, processes_inside, rank_records, read_json

from launcher.simulate import netns

WHY_NOT = netns.unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"network namespaces: {WHY_NOT}")

ALLREDUCE = os.path.join(REPO, "tests", "scripts", "ddp_allreduce.py")
# The training script: records what the host looks like from inside, then runs ddp_allreduce.py.
PROBE_WORKER = f"""
import json, os, runpy, socket
rank = os.environ["RANK"]
master = "algo-1"
probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
probe.connect((master, 9))  # no packet is sent: this only picks the route and the source address
facts = {{"hostname": socket.gethostname(), "address": probe.getsockname()[0],
          "master": socket.gethostbyname(master), "etc_hosts": open("/etc/hosts").read(),
          "net": os.readlink("/proc/self/ns/net"), "resolve": os.environ.get("LAUNCHER_RESOLVE")}}
with open(os.path.join(os.environ["SM_OUTPUT_DATA_DIR"], "host-rank" + rank + ".json"), "w") as fh:
    json.dump(facts, fh)
runpy.run_path({ALLREDUCE!r}, run_name="__main__")
"""
SERVER = """
import socket, sys, time
server = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("listening", flush=True)
conn, peer = server.accept()
print("peer", peer[0], flush=True)
conn.settimeout(0.25)
while True:
    try:
        data = conn.recv(100)
    except socket.timeout:
        continue
    except OSError as exc:
        print("error", type(exc).__name__, flush=True)
        break
    print("got " + data.decode() if data else "eof", flush=True)
    if not data:
        break
"""
CLIENT = """
import socket, subprocess, sys
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
helper = subprocess.Popen(["sleep", "60"], start_new_session=True)  # escapes the process group
print("connected", helper.pid, flush=True)
for line in sys.stdin:
    conn.sendall(line.strip().encode())
"""


def machine_state() -> dict[str, Any]:
    """What must be the same after every run: the machine's namespaces, links, hosts file, hostname."""
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    with open("/etc/hosts", "rb") as fh:
        hosts = hashlib.sha256(fh.read()).hexdigest()
    return {"netns": subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout,
            "links": sorted(line.split(":")[1].strip() for line in links.splitlines()),
            "etc_hosts": hosts, "hostname": socket.gethostname(),
            "run_netns": os.path.exists("/run/netns")}


@pytest.fixture
def machine() -> Any:
    """Checks after the test that the machine's network and names are as they were."""
    before = machine_state()
    yield before
    assert machine_state() == before


class Lines(LiveProcess):
    """A process in a lab host whose output lines the test waits for."""

    def abort(self) -> None:
        self.proc.kill()

    def wait_line(self, prefix: str, timeout: float) -> str:
        self.wait_for(prefix, timeout)
        return next(line for line in self.out if line.startswith(prefix))


# ------------------------------------------------------------------------------------------------
# The lab on its own: names, addresses, a partition that loses packets, a power loss
# ------------------------------------------------------------------------------------------------

@pytest.mark.lab
def test_lab_partition_loses_packets_and_poweroff_kills_every_process(tmp_path: Any, machine: Any) -> None:
    lab = netns.Lab(str(tmp_path))
    try:
        lab.add_host("algo-1", netns.host_address(0))
        lab.add_host("algo-2", netns.host_address(1), ["algo-2.job"])
        seen = subprocess.run(lab.command("algo-2", [PYTHON, "-c", (
            "import socket; print(socket.gethostname(), socket.gethostbyname('algo-1'), "
            "socket.gethostbyname('algo-2.job'))")]), capture_output=True, text=True, timeout=30)
        assert seen.stdout.split() == ["algo-2", "10.88.0.1", "10.88.0.2"], seen.stderr
        port = 5000
        server = Lines(lab.command("algo-1", [PYTHON, "-c", SERVER, str(port)]), str(tmp_path), os.environ.copy())
        server.wait_for("listening", 30)
        client = subprocess.Popen(lab.command("algo-2", [PYTHON, "-c", CLIENT, "algo-1", str(port)]),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        helper = int(client.stdout.readline().split()[1])
        assert server.wait_line("peer", 10) == "peer 10.88.0.2"
        assert set(lab.pids("algo-2")) == {client.pid, helper}
        client.stdin.write("hello\n")
        client.stdin.flush()
        server.wait_for("got hello", 10)

        lab.partition("algo-2")
        client.stdin.write("lost\n")  # sent while partitioned: the packets vanish, TCP retransmits
        client.stdin.flush()
        time.sleep(2.0)
        assert server.out[3:] == [] and client.poll() is None  # no data, no reset, no end of file
        lab.heal("algo-2")
        healed = time.monotonic()
        server.wait_for("got lost", 15)  # the same connection carries it: it was never reset
        print(f"\npartition 2 s: the retransmission arrived {time.monotonic() - healed:.1f} s after the heal")

        killed = lab.poweroff("algo-2")
        assert set(killed) == {client.pid, helper}  # every process of the host, by the machine's PIDs
        assert_gone([helper], within=2)
        assert client.wait(timeout=5) == -signal.SIGKILL
        time.sleep(1.0)
        assert server.out[4:] == [] and server.proc.poll() is None  # a power loss: the peer hears nothing
        assert lab.pids("algo-2") == []
    finally:
        lab.close()
    assert_gone([server.proc.pid, lab.pid], within=5)  # closing the lab killed algo-1's server too
    server.proc.wait()


# ------------------------------------------------------------------------------------------------
# Real jobs in namespaces
# ------------------------------------------------------------------------------------------------

def start(tmp_path: Any, name: str, hosts: int, *args: str, script: str = ALLREDUCE,
          script_args: tuple[str, ...] = ("--steps", "2"), **env: str) -> tuple[Simulate, str]:
    workdir = str(tmp_path / name)
    return Simulate(["--hosts", str(hosts), "--workdir", workdir, "--job-name", name, *args, "--", script,
                     *script_args], str(tmp_path), launcher_env(**env)), workdir


def host_facts(workdir: str, hosts: int) -> dict[str, list[dict[str, Any]]]:
    found = {}
    for i in range(1, hosts + 1):
        data = os.path.join(workdir, f"algo-{i}", "output", "data")
        found[f"algo-{i}"] = [read_json(os.path.join(data, n)) for n in sorted(os.listdir(data))
                              if n.startswith("host-rank")]
    return found


def check_job(sim: Simulate, workdir: str, hosts: int) -> None:
    """Trained, rank 0 on algo-1, every host seen from inside as itself, and nothing left."""
    summary = read_json(os.path.join(workdir, "summary.json"))
    records = rank_records(workdir, hosts)
    assert_gone(job_pids(records, sim.proc.pid, summary))
    assert processes_inside(workdir) == []
    assert summary["network"] == "netns" and summary["exit_code"] == 0, sim.stderr
    assert [r["rank"] for r in records["algo-1"]] == [0]
    assert sorted(r["rank"] for recs in records.values() for r in recs) == list(range(hosts))
    assert {r["sum"] for recs in records.values() for r in recs} == {hosts * (hosts + 1) / 2}
    facts = host_facts(workdir, hosts)
    expected_hosts = {f"algo-{i + 1}": netns.host_address(i) for i in range(hosts)}
    for i, (host, seen) in enumerate(facts.items()):
        assert [f["hostname"] for f in seen] == [host]
        assert seen[0]["address"] == netns.host_address(i) and seen[0]["master"] == "10.88.0.1"
        assert seen[0]["resolve"] is None  # names resolve as on the platform, no LAUNCHER_RESOLVE
        lines = dict(reversed(line.split("\t")) for line in seen[0]["etc_hosts"].splitlines()[2:])
        assert lines == expected_hosts
    assert len({f["net"] for seen in facts.values() for f in seen}) == hosts  # one namespace each
    for rec in records["algo-1"]:
        assert rec["env"]["SM_CURRENT_HOST"] == "algo-1" and rec["env"]["SM_NETWORK_INTERFACE_NAME"] == "eth0"


@pytest.mark.job
@pytest.mark.lab
def test_two_and_four_hosts_in_parallel_runs(tmp_path: Any, machine: Any) -> None:
    # The same bridge, veth and namespace names and the same subnet in both runs: private to each.
    script = tmp_path / "probe_worker.py"
    script.write_text(PROBE_WORKER)
    two, two_dir = start(tmp_path, "two", 2, script=str(script))
    four, four_dir = start(tmp_path, "four", 4, script=str(script))
    assert two.finish() == 0, two.stderr
    assert four.finish() == 0, four.stderr
    check_job(two, two_dir, 2)
    check_job(four, four_dir, 4)
    print(f"\nin parallel: 2 hosts {two.duration:.1f} s, 4 hosts {four.duration:.1f} s")


@pytest.mark.job
@pytest.mark.lab
def test_sigkill_of_simulates_process_group_leaves_nothing(tmp_path: Any, machine: Any) -> None:
    sim, workdir = start(tmp_path, "killed", 2, script_args=("--steps", "0", "--step-sleep", "0.1"))
    sim.wait_for("[algo-2] [rank1]:step=2")
    records = rank_records(workdir, 2)
    namespaces = {int(re.sub(r"\D", "", os.readlink(f"/proc/{r['pid']}/ns/net")))
                  for recs in records.values() for r in recs}
    inside = netns.namespace_pids(namespaces)  # every process of both hosts, whoever its parent is
    holder = [int(n) for n in os.listdir("/proc") if n.isdigit() and _cmdline(int(n)).endswith("netns.py\0hold\0")
              and _ppid(int(n)) == sim.proc.pid]
    assert len(namespaces) == 2 and len(inside) >= 6 and len(holder) == 1
    os.killpg(sim.proc.pid, signal.SIGKILL)  # simulate and everything in its process group
    sim.finish()
    waited = assert_gone([sim.proc.pid, *inside, *holder], within=10)
    assert netns.namespace_pids(namespaces) == [] and processes_inside(workdir) == []
    print(f"\nSIGKILL of simulate's process group: {len(inside)} host processes and the lab gone "
          f"{waited:.2f} s later")


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return 0
    return int(stat[stat.rfind(b")") + 2:].split()[1])


@pytest.mark.job
@pytest.mark.lab
def test_partition_with_platform_stop_off_ends_by_the_deadline(tmp_path: Any, machine: Any) -> None:
    deadline = 40.0  # the partition fires at about 15 s (step 3): a slow start must not miss it
    sim, workdir = start(tmp_path, "split", 2, "--fault", "algo-2:partition:step=3", "--platform-stop", "off",
                         "--deadline", str(deadline), "--grace-period", "2",
                         script_args=("--steps", "0", "--step-sleep", "0.1"))
    code = sim.finish()
    summary = read_json(os.path.join(workdir, "summary.json"))
    records = rank_records(workdir, 2)
    assert_gone(job_pids(records, sim.proc.pid, summary))
    assert code != 0, sim.stderr
    hosts = {h["host"]: h for h in summary["hosts"]}
    assert hosts["algo-2"]["outcome"].startswith("partitioned: partition by --fault"), hosts
    # The packets vanished: no host ever heard a reset or a closed connection from its peer.
    assert not [line for line in sim.out + sim.err if re.search(r"reset by peer|closed by peer", line)]
    ended = summary["fault_to_last_exit"]
    by_deadline = summary["deadline_reached"]
    assert max(h["ended"] for h in summary["hosts"]) <= deadline + 2 + 5 + 1  # grace + backstop
    print(f"\npartition of algo-2 with --platform-stop off: the job ended {ended:.1f} s after the fault"
          f"{' (stopped by the --deadline: it would have waited for gloo)' if by_deadline else ''}")


@pytest.mark.job
@pytest.mark.lab
def test_poweroff_kills_every_process_of_the_host_at_once(tmp_path: Any, machine: Any) -> None:
    tmp = tmp_path / "tmp"  # the hosts' TMPDIR: their launchers' run directories
    tmp.mkdir()
    sim, workdir = start(tmp_path, "dark", 2, "--nproc-per-node", "2", "--fault", "algo-2:poweroff:step=2",
                         "--deadline", "60", script_args=("--steps", "0", "--step-sleep", "0.1"), TMPDIR=str(tmp))
    sim.wait_for("[algo-2] [rank3]:step=1")
    records = rank_records(workdir, 2)
    ns_inode = int(re.sub(r"\D", "", os.readlink(f"/proc/{records['algo-2'][0]['pid']}/ns/net")))
    before = set(netns.namespace_pids([ns_inode]))  # launcher, its watchdog, torchrun, 2 workers
    code = sim.finish()
    summary = read_json(os.path.join(workdir, "summary.json"))
    records = rank_records(workdir, 2)
    assert_gone(job_pids(records, sim.proc.pid, summary))
    line = next(line for line in sim.err if "fault: poweroff of algo-2" in line)
    killed = {int(p) for p in re.findall(r"\d+", line.split("at once:")[1])}
    assert before <= killed and len(before) >= 5, (before, line)
    assert code == 128 + signal.SIGKILL, sim.stderr
    hosts = {h["host"]: h for h in summary["hosts"]}
    assert hosts["algo-2"]["outcome"].startswith("lost: poweroff by --fault")
    assert hosts["algo-2"]["failure"] == ""  # its launcher had no moment to write a report
    assert [r["sigterm"] for r in records["algo-2"]] == [False, False]  # nothing was stopped politely
    # its launcher's watchdog died with it: simulate removed the run directory the watchdog would have
    assert [n for n in os.listdir(tmp) if n.startswith("ddp-launcher-")] == []
    assert any("the run directory of algo-2's killed launcher" in line for line in sim.err), sim.stderr
    # (the job watch waits the 30 s loss timeout for a silent host, so simulate's stop comes first and, with
    # algo-1's workers blocked in a collective, may have to kill after its own grace period)
    assert hosts["algo-1"]["outcome"].startswith("stopped by simulate after algo-2 was lost")
    print(f"\npoweroff of algo-2: {len(killed)} processes SIGKILLed at once; the job ended "
          f"{summary['fault_to_last_exit']:.1f} s after the fault")


# ------------------------------------------------------------------------------------------------
# Choosing the network, and bad input
# ------------------------------------------------------------------------------------------------

def refused(tmp_path: Any, args: list[str], env: dict[str, str]) -> str:
    proc = subprocess.run([PYTHON, "-m", "launcher", "simulate", "--hosts", "2", *args, "--", ALLREDUCE],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert os.listdir(tmp_path) == []
    return proc.stderr


def test_bad_network_input_exits_2_and_starts_nothing(tmp_path: Any) -> None:
    env = launcher_env()
    assert "needs --network netns" in refused(tmp_path, ["--network", "loopback", "--fault",
                                                         "algo-2:partition:1"], env)
    assert "'maybe'" in refused(tmp_path, ["--platform-stop", "maybe"], env)
    assert "--deadline must be > 0" in refused(tmp_path, ["--deadline", "0"], env)
    assert "'blackout'" in refused(tmp_path, ["--fault", "algo-2:blackout:1"], env)
    # A machine without the tools (PATH without nsenter): namespaces are not permitted there.
    bare = tmp_path.parent / f"{tmp_path.name}-bin"
    bare.mkdir()
    for tool in ("ip", "unshare", "mount", "hostname"):
        os.symlink(subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True, text=True,
                                  check=True).stdout.strip(), bare / tool)
    no_nsenter = launcher_env(PATH=str(bare))
    assert "nsenter not found on PATH" in refused(tmp_path, ["--network", "netns"], no_nsenter)
    assert "partition needs network namespaces" in refused(tmp_path, ["--fault", "algo-2:partition:1"],
                                                           no_nsenter)


@pytest.mark.job
def test_loopback_where_namespaces_are_not_permitted_and_the_summary_says_so(tmp_path: Any) -> None:
    bare = tmp_path / "bin"
    bare.mkdir()
    workdir = str(tmp_path / "job")
    sim = Simulate(["--hosts", "1", "--workdir", workdir, "--", ALLREDUCE, "--steps", "1"], str(tmp_path),
                   env=launcher_env(PATH=str(bare)))
    assert sim.finish() == 0, sim.stderr
    summary = read_json(os.path.join(workdir, "summary.json"))
    assert summary["network"] == "loopback" and "not found on PATH" in summary["network_note"]
    assert any(line.startswith("network loopback: every host was 127.0.0.1 (") for line in sim.err), sim.stderr
    assert_gone(job_pids(rank_records(workdir, 1), sim.proc.pid, summary))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s"]))
