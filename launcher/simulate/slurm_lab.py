"""A real SLURM cluster on this machine: slurmctld, munged and one slurmd per node, each node a host of its own.

Everything of a lab lives in namespaces it creates, so parallel labs never collide and nothing
outlives it, even when the process that started it is killed:

- an *anchor* process started by ``unshare --pid --fork --mount-proc --net --uts`` is PID 1 of the
  lab's PID namespace. It binds the lab's hosts file over ``/etc/hosts`` in its private mount
  namespace, builds a bridge (``10.77.0.1``, the controller ``ctl``), and one network + UTS
  namespace per node (node N at ``10.77.0.1N``) joined to the bridge by a veth pair; then it
  starts munged, slurmctld and the slurmds (``nsenter --net --uts``: they keep the cgroup mounts
  slurmd needs) as its children and waits for its stdin to close;
- names and ids are those of a real site: nodes ``gpu-0007``, ``gpu-0008``, ... (``SLURM_JOB_NODELIST``
  ``gpu-[0007-0008]``), each host's name its FQDN (``gpu-0007.cluster.example.org``, the node's
  ``NodeHostname`` and ``NodeAddr``, by which its slurmd finds its node), and job ids from 48213377
  (``FirstJobId``; a parameter);
- when the anchor exits (``down``, or the end of its stdin because its parent died), the kernel
  kills every process of the PID namespace, and with them the namespaces go. Nothing on the machine
  is edited: config, key, sockets, spool and logs are under the lab's own directory.

Its API: :func:`missing_requirement` (why no lab can run here, or None); ``SlurmLab(nodes).up()``;
:meth:`SlurmLab.run` (a command on the controller or a node, entering the lab's namespaces),
:meth:`SlurmLab.sbatch` (a script's text), :meth:`SlurmLab.submit` (a script file), :meth:`SlurmLab.wait_job`,
:meth:`SlurmLab.output`; :meth:`SlurmLab.lab_pids` and
:meth:`SlurmLab.node_pids` (to prove nothing is left); :meth:`SlurmLab.down`; and
:meth:`SlurmLab.attach` (a lab another process holds). Needs root (or user namespaces: not supported
here) and Debian's ``slurm-wlm`` and ``munge`` packages. The tests (``tests/test_slurm_cluster.py``)
use it; a person drives it with ``tools/slurm_lab.py up|run|down``. Standard library only; like the
rest of :mod:`launcher.simulate` it runs on a workstation and never ships in a bundle.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import IO, Optional

SUBNET = "10.77.0"
CONTROLLER = "ctl"
DOMAIN = "cluster.example.org"  # every host's name is an FQDN in it, as at real sites
NODE_PREFIX, FIRST_NODE, NODE_DIGITS = "gpu-", 7, 4  # node names gpu-0007, gpu-0008: SLURM_JOB_NODELIST gpu-[0007-0008]
CRED_EXPIRE = 10  # s: also how long a requeued job waits before it may start again (slurm.conf(5); default 120)
FIRST_JOB_ID = 48213377  # real sites' job ids have 7-8 digits; the lab's first job gets this one
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "unshare", "nsenter", "ip")


def missing_requirement() -> Optional[str]:
    """Why a lab cannot run here (one line), or None."""
    if os.geteuid() != 0:
        return "the SLURM lab needs root (namespaces, mounts, munged and slurmd as root)"
    absent = [name for name in DAEMONS if shutil.which(name) is None
              and not os.path.exists(os.path.join("/usr/sbin", name))]
    if absent:
        return f"the SLURM lab needs {', '.join(absent)} (apt-get install slurm-wlm munge iproute2)"
    return None


def node_address(index: int) -> str:
    """The address of node ``index`` (1-based)."""
    return f"{SUBNET}.{10 + index}"


def node_name(index: int) -> str:
    """SLURM's name of node ``index`` (1-based): zero-padded, ``gpu-0007`` for node 1."""
    return f"{NODE_PREFIX}{FIRST_NODE + index - 1:0{NODE_DIGITS}d}"


def node_list(nodes: int) -> str:
    """The lab's ``nodes`` nodes as a SLURM host list (``gpu-[0007-0008]``)."""
    last = f"{FIRST_NODE + nodes - 1:0{NODE_DIGITS}d}"
    return f"{NODE_PREFIX}[{FIRST_NODE:0{NODE_DIGITS}d}" + (f"-{last}]" if nodes > 1 else "]")


def fqdn(name: str) -> str:
    """The fully qualified name of lab host ``name`` (its UTS host name, its NodeHostname and NodeAddr)."""
    return f"{name}.{DOMAIN}"


def slurm_conf(root: str, nodes: int, cpus: int, first_job_id: int = FIRST_JOB_ID) -> str:
    """The lab's slurm.conf: munge through the lab's socket, linuxproc tracking, no accounting.

    Nodes are named as at real sites: ``NodeName`` zero-padded (``gpu-0007``), ``NodeHostname`` and
    ``NodeAddr`` its FQDN (resolved by the lab's hosts file); job ids start at ``first_job_id``.
    """
    lines = [
        "ClusterName=lab", f"SlurmctldHost={CONTROLLER}({SUBNET}.1)", f"FirstJobId={first_job_id}",
        "AuthType=auth/munge", "CredType=cred/munge",
        f"AuthInfo=socket={root}/munge/munge.socket,cred_expire={CRED_EXPIRE}",
        "SlurmUser=root", "SlurmdUser=root",
        f"StateSaveLocation={root}/ctld", f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={root}/run/slurmctld.pid", f"SlurmdPidFile={root}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/log/slurmctld.log", f"SlurmdLogFile={root}/log/slurmd-%n.log",
        f"PlugStackConfig={root}/plugstack.conf",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none",
        "SchedulerType=sched/builtin", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
        "SchedulerParameters=sched_interval=2",  # a requeued job starts within 2 s of its eligible time, not 60
        "MpiDefault=none", "ReturnToService=2", "SlurmdParameters=config_overrides",
        "KillWait=30", "MailProg=/bin/true", "SlurmctldTimeout=30", "SlurmdTimeout=30",
    ]
    lines += [f"NodeName={node_name(i)} NodeHostname={fqdn(node_name(i))} NodeAddr={fqdn(node_name(i))} "
              f"CPUs={cpus} RealMemory=1000 State=UNKNOWN" for i in range(1, nodes + 1)]
    lines.append(f"PartitionName=lab Nodes={node_list(nodes)} Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def hosts_file(nodes: int) -> str:
    """``/etc/hosts`` of every lab host: the controller and the nodes on the bridge, FQDN first."""
    lines = ["127.0.0.1 localhost", f"{SUBNET}.1 {fqdn(CONTROLLER)} {CONTROLLER}"]
    lines += [f"{node_address(i)} {fqdn(node_name(i))} {node_name(i)}" for i in range(1, nodes + 1)]
    return "\n".join(lines) + "\n"


def net_inode(pid: int) -> Optional[str]:
    """``net:[4026532…]`` of a process (None once it is gone)."""
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def pids_in_namespace(kind: str, link: str) -> list[int]:
    """Host PIDs of every process in the namespace ``link`` (``/proc/PID/ns/<kind>``)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.readlink(f"/proc/{name}/ns/{kind}") == link:
                    found.append(int(name))
            except OSError:
                continue
    return found


class SlurmLab:
    """A private SLURM cluster of ``nodes`` nodes with ``cpus`` CPUs each."""

    def __init__(self, nodes: int = 2, cpus: int = 4, root: Optional[str] = None,
                 first_job_id: int = FIRST_JOB_ID) -> None:
        self.nodes, self.cpus, self.first_job_id = nodes, cpus, first_job_id
        self.names = [node_name(i) for i in range(1, nodes + 1)]  # SLURM's node names, node 1 first
        self.root = root or tempfile.mkdtemp(prefix="slurmlab-", dir="/tmp")  # short: socket paths
        self.conf = os.path.join(self.root, "slurm.conf")
        self.anchor: Optional[subprocess.Popen] = None
        self.info: dict = {}
        self.pid_ns = ""
        self._anchor_pid: Optional[int] = None  # known without a child when attached

    @classmethod
    def attach(cls, root: str, info: dict, anchor_pid: int) -> SlurmLab:
        """The lab another process started in ``root`` (``info``: what its ``up`` read from the anchor)."""
        lab = cls(nodes=len(info["holders"]), root=root)
        lab.info, lab._anchor_pid = info, anchor_pid
        return lab

    # ------------------------------------------------------------------ outside: the test's side
    def up(self, timeout: float = 30.0) -> None:
        """Start the anchor, wait until every node is idle. Raises RuntimeError with the logs if not."""
        subs = ["munge", "ctld", "run", "log", "jobs"] + [f"spool/{name}" for name in self.names]
        for sub in subs:
            os.makedirs(os.path.join(self.root, sub), exist_ok=True)
        os.chmod(os.path.join(self.root, "munge"), 0o755)  # munged refuses a socket dir others can write
        key = os.path.join(self.root, "munge", "munge.key")
        with open(key, "wb") as fh:
            fh.write(os.urandom(1024))
        os.chmod(key, 0o400)
        with open(self.conf, "w") as fh:
            fh.write(slurm_conf(self.root, self.nodes, self.cpus, self.first_job_id))
        with open(os.path.join(self.root, "hosts"), "w") as fh:
            fh.write(hosts_file(self.nodes))
        open(os.path.join(self.root, "plugstack.conf"), "w").close()
        argv = ["unshare", "--pid", "--fork", "--mount-proc", "--net", "--uts", "--propagation", "private",
                sys.executable, os.path.abspath(__file__), "--anchor", self.root, str(self.nodes)]
        self.anchor = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.anchor.stdout.readline()  # the anchor says "ready" once every node is idle
        if not line:
            self.anchor.wait(timeout=10)
            raise RuntimeError(f"the SLURM lab did not start (anchor exit {self.anchor.returncode}):\n"
                               + self.logs())
        self.info = json.loads(line)
        self.pid_ns = os.readlink(f"/proc/{self.anchor_pid()}/ns/pid")

    def anchor_pid(self) -> int:
        """Host PID of the lab's PID 1 (``unshare --fork`` is the anchor's parent)."""
        if self._anchor_pid is not None:
            return self._anchor_pid
        assert self.anchor is not None
        with open(f"/proc/{self.anchor.pid}/task/{self.anchor.pid}/children") as fh:
            return int(fh.read().split()[0])

    def env(self, extra: Optional[dict] = None) -> dict:
        """The environment of commands run in the lab: this one, with the lab's slurm.conf."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
        env["SLURM_CONF"] = self.conf
        env.update(extra or {})
        return env

    def command(self, argv: Sequence[str], node: Optional[int] = None) -> list[str]:
        """``argv`` wrapped to run on the controller, or on node ``node`` (1-based)."""
        inside = list(argv)
        if node is not None:
            inside = ["nsenter", "-t", str(self.info["holders"][node - 1]), "--net", "--uts", "--", *inside]
        return ["nsenter", "-t", str(self.anchor_pid()), "--pid", "--net", "--uts", "--mount", f"--wd={os.getcwd()}",
                "--", *inside]

    def run(self, argv: Sequence[str], node: Optional[int] = None, timeout: float = 60.0,
            env: Optional[dict] = None, check: bool = True) -> subprocess.CompletedProcess:
        """Run a command in the lab and wait for it (text output captured)."""
        result = subprocess.run(self.command(argv, node), capture_output=True, text=True, timeout=timeout,
                                env=self.env(env))
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {result.returncode}: {result.stderr.strip()}")
        return result

    def sbatch(self, script: str, *options: str, env: Optional[dict] = None) -> int:
        """Submit a batch script (text); returns the job id. Output goes to ``jobs/<id>.out``."""
        path = os.path.join(self.root, "jobs", f"script-{time.monotonic_ns()}.sh")
        with open(path, "w") as fh:
            fh.write(script)
        return self.submit(path, *options, env=env)

    def submit(self, path: str, *options: str, env: Optional[dict] = None) -> int:
        """Submit the batch script file ``path`` as it is; returns the job id. Output goes to ``jobs/<id>.out``
        (the command line's ``--output`` wins over the script's ``#SBATCH --output``)."""
        out = self.run(["sbatch", "--parsable", "--output", os.path.join(self.root, "jobs", "%j.out"),
                        *options, path], env=env).stdout
        return int(out.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (``JobState``, ``ExitCode``, ...)."""
        text = self.run(["scontrol", "show", "job", "-o", str(job_id)]).stdout
        return dict(item.split("=", 1) for item in text.split() if "=" in item)

    def wait_job(self, job_id: int, timeout: float = 120.0) -> dict[str, str]:
        """Wait until the job has ended (not pending, running, completing or requeued); returns its fields."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "REQUEUED"):
                return fields
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {fields.get('JobState')} after {timeout} s")
            time.sleep(0.2)

    def output(self, job_id: int) -> str:
        """The job's output file (stdout and stderr of the batch script and its steps)."""
        try:
            with open(os.path.join(self.root, "jobs", f"{job_id}.out"), errors="replace") as fh:
                return fh.read()
        except OSError:
            return ""

    def node_pids(self, node: int) -> list[int]:
        """Host PIDs of every process on node ``node`` (1-based), slurmd and its holder included."""
        return pids_in_namespace("net", self.info["net"][node - 1])

    def lab_pids(self) -> list[int]:
        """Host PIDs of every process of the lab (its PID namespace)."""
        return pids_in_namespace("pid", self.pid_ns) if self.pid_ns else []

    def logs(self) -> str:
        """The tail of every daemon log (for a failure message)."""
        parts = []
        for name in sorted(os.listdir(os.path.join(self.root, "log"))) if os.path.isdir(
                os.path.join(self.root, "log")) else []:
            with open(os.path.join(self.root, "log", name), errors="replace") as fh:
                parts.append(f"--- {name}\n" + "".join(fh.readlines()[-20:]))
        return "\n".join(parts)

    def down(self, keep_files: bool = False) -> list[int]:
        """End the lab: the anchor exits and the kernel kills the rest. Returns the PIDs it had."""
        pids = self.lab_pids()
        if self.anchor is not None and self.anchor.poll() is None:
            self.anchor.stdin.close()  # the anchor exits on end of input
            try:
                self.anchor.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.anchor.pid, signal.SIGKILL)  # unshare: the PID namespace dies with it
                self.anchor.wait()
        if not keep_files:
            shutil.rmtree(self.root, ignore_errors=True)
        return pids


# ---------------------------------------------------------------------- inside: the anchor (PID 1)
def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)


def _anchor(root: str, nodes: int) -> None:
    """Build the hosts and start the daemons; print the lab's facts; wait for end of input."""
    conf = os.path.join(root, "slurm.conf")
    _sh("mount", "--bind", os.path.join(root, "hosts"), "/etc/hosts")
    _sh("hostname", fqdn(CONTROLLER))
    _sh("ip", "link", "set", "lo", "up")
    _sh("ip", "link", "add", "br0", "type", "bridge")
    _sh("ip", "addr", "add", f"{SUBNET}.1/24", "dev", "br0")
    _sh("ip", "link", "set", "br0", "up")
    holders, nets = [], []
    for i in range(1, nodes + 1):
        holder = subprocess.Popen(["unshare", "--net", "--uts", "sleep", "infinity"])
        while net_inode(holder.pid) == net_inode(os.getpid()):
            time.sleep(0.005)  # unshare has not entered its namespaces yet
        enter = ["nsenter", "-t", str(holder.pid), "--net", "--uts"]
        _sh("ip", "link", "add", f"veth{i}", "type", "veth", "peer", "name", "eth0", "netns", str(holder.pid))
        _sh("ip", "link", "set", f"veth{i}", "master", "br0", "up")
        _sh(*enter, "hostname", fqdn(node_name(i)))
        _sh(*enter, "ip", "link", "set", "lo", "up")
        _sh(*enter, "ip", "addr", "add", f"{node_address(i)}/24", "dev", "eth0")
        _sh(*enter, "ip", "link", "set", "eth0", "up")
        holders.append(holder.pid)
        nets.append(net_inode(holder.pid))
    with open(os.path.join(root, "log", "daemons.log"), "ab") as log:
        _start_daemons(root, holders, log)
    env = {**os.environ, "SLURM_CONF": conf}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True, env=env).stdout
        if states.split() == ["idle"] * nodes:
            break
        time.sleep(0.1)
    else:
        sys.exit(1)  # no "ready" line: the test side reports the logs
    print(json.dumps({"holders": holders, "net": nets}), flush=True)
    threading.Thread(target=_reap, daemon=True).start()  # PID 1: orphans come here (SIG_IGN would be inherited)
    sys.stdin.read()  # until the lab is taken down or its owner dies


def _start_daemons(root: str, holders: Sequence[int], log: IO[bytes]) -> None:
    """munged and slurmctld on the controller, a slurmd in each node's namespaces (children of PID 1)."""
    conf = os.path.join(root, "slurm.conf")
    munge = os.path.join(root, "munge")
    subprocess.Popen(["munged", "-F", "--force", f"--socket={munge}/munge.socket", f"--key-file={munge}/munge.key",
                      f"--pid-file={root}/run/munged.pid", f"--log-file={root}/log/munged.log",
                      f"--seed-file={root}/run/munged.seed"], stdout=log, stderr=log)
    deadline = time.monotonic() + 10
    while not os.path.exists(f"{munge}/munge.socket"):
        if time.monotonic() > deadline:
            sys.exit(1)  # munged refused to start: its log says why
        time.sleep(0.01)
    subprocess.Popen(["slurmctld", "-D", "-i", "-f", conf], stdout=log, stderr=log)
    for holder_pid in holders:  # no -N: each slurmd finds its node by its host name, as at real sites
        subprocess.Popen(["nsenter", "-t", str(holder_pid), "--net", "--uts", "--",
                          "slurmd", "-D", "-f", conf], stdout=log, stderr=log)


def _reap() -> None:
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            time.sleep(0.1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--anchor"]:
        _anchor(sys.argv[2], int(sys.argv[3]))
