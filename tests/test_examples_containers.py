"""The container examples run for real, as their manifests write them: each pod with its own root, mounts,
working directory, environment, host name and ``/dev``.

Docker and Kubernetes cannot run here; their shape can. One ``unshare --mount --net --uts --pid`` holds
the job (loopback only, an ``/etc/hosts`` that gives every pod's name 127.0.0.1, as the Compose network
or the cluster DNS does); in it each pod gets, in a mount and UTS namespace of its own:

- a root of its own (``tmp/pod-N/root``): a container path ``/X`` is ``ROOT/X`` (the command's words,
  its working directory and its mounts are rewritten so); the image's writable directories are plain
  directories there, a volume is a bind mount of its source, read-only where the manifest says ``:ro``
  or ``readOnly: true`` (``mount -o remount,bind,ro``: a write fails with EROFS as in the container);
- a ``/dev`` as a container runtime gives one: the host's null, zero, random, urandom, full, tty, shm and
  pts, and in a Kubernetes pod the writable ``/dev/termination-log`` the kubelet reads;
- the stock image's Python (torch only, tests/test_shipping.py's stand-in) with what the command's
  ``pip install --user`` adds (scikit-learn, matplotlib) linked in: the command runs from its ``exec``.

The namespace's first process waits for every pod, then lists what is left in its PID namespace: a test
fails on any process that outlived its pod.
"""

from __future__ import annotations

import glob
import importlib.metadata
import json
import os
import shlex
import signal
import socket
import subprocess
from typing import NamedTuple

import pytest
import yaml
from conftest import REPO
from packaging.requirements import Requirement
from test_shipping import container_words, dist, make_venv  # noqa: F401 (dist: the fixture)

EXAMPLES = os.path.join(REPO, "examples")
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
RUN_TIMEOUT = 600  # s: a job of seconds on a quiet machine took 112 s at load average 58; a failure ends sooner

pytestmark = [pytest.mark.job, pytest.mark.lab,
              pytest.mark.skipif(os.geteuid() != 0, reason="mount, UTS and PID namespaces need root")]


class Pod(NamedTuple):
    name: str  # its host name
    argv: list[str]  # as the container runs it, container paths
    env: dict[str, str]
    workdir: str
    mounts: list[tuple[str, str, bool]]  # (source here, container path, read-only)
    writable: tuple[str, ...] = ("/workspace", "/root", "/tmp")  # the image's own directories
    kubernetes: bool = False  # the kubelet's /dev/termination-log and KUBERNETES_SERVICE_HOST


def distributions(roots: list[str]) -> list[importlib.metadata.Distribution]:
    """``roots`` and every distribution they need here (markers evaluated)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key not in found:
            found[key] = importlib.metadata.distribution(name)
            todo += [r.name for r in map(Requirement, found[key].requires or [])
                     if r.marker is None or r.marker.evaluate({"extra": ""})]
    return list(found.values())


@pytest.fixture(scope="module")
def image_python(tmp_path_factory) -> str:
    """The stock image's Python after the command's ``pip install --user scikit-learn matplotlib``."""
    python = make_venv(str(tmp_path_factory.mktemp("image") / "venv"), with_torch=True)
    site = next(os.path.join(d, "site-packages") for d in
                [os.path.join(os.path.dirname(os.path.dirname(python)), "lib", n)
                 for n in os.listdir(os.path.join(os.path.dirname(os.path.dirname(python)), "lib"))])
    for found in distributions(["scikit-learn", "matplotlib"]):
        for name in sorted({str(f).split("/")[0] for f in found.files or [] if not str(f).startswith("..")}
                           - {"__pycache__"}):
            source, target = str(found.locate_file(name)), os.path.join(site, name)
            if os.path.exists(source) and not os.path.lexists(target):
                os.symlink(source, target)
    return python


def pod_script(pod: Pod, index: int, base, python: str) -> str:
    """Lines of the job's script that build pod ``index``'s root and /dev and start it in the background."""
    root, dev = str(base / f"pod-{index}" / "root"), str(base / f"pod-{index}" / "dev")
    lines = [f"mkdir -p {shlex.quote(dev)}/shm {shlex.quote(dev)}/pts"]
    for path in pod.writable:
        lines.append(f"mkdir -p {shlex.quote(root + path)}")
    for source, target, read_only in pod.mounts:
        here = shlex.quote(root + target)
        make = f"mkdir -p {here}" if os.path.isdir(source) else f"mkdir -p $(dirname {here}) && touch {here}"
        lines += [make, f"mount --bind {shlex.quote(source)} {here}"]
        if read_only:
            lines.append(f"mount -o remount,bind,ro {here}")
    for name in DEVICES:
        lines += [f"touch {dev}/{name}", f"mount --bind /dev/{name} {dev}/{name}"]
    lines += [f"mount --rbind /dev/shm {dev}/shm", f"mount --rbind /dev/pts {dev}/pts",
              f"ln -s /proc/self/fd {dev}/fd", f"ln -s pts/ptmx {dev}/ptmx"]
    lines += [f"ln -s /proc/self/fd/{n} {dev}/{name}" for n, name in enumerate(("stdin", "stdout", "stderr"))]
    if pod.kubernetes:
        lines.append(f"touch {dev}/termination-log")
    prefixes = sorted({target for _, target, _ in pod.mounts} | set(pod.writable) | {pod.workdir}, key=len,
                      reverse=True)

    def word(w: str) -> str:
        if w == "python":
            return python
        for prefix in prefixes:
            if w == prefix or w.startswith(prefix + "/"):
                return root + w
        return w

    env = {"PATH": f"{os.path.dirname(python)}:/usr/bin:/bin", "HOME": root + "/root", "HOSTNAME": pod.name,
           **pod.env}
    if pod.kubernetes:
        env.update(KUBERNETES_SERVICE_HOST="10.96.0.1", KUBERNETES_SERVICE_PORT="443")
    inner = " && ".join([f"mount --rbind {dev} /dev", f"hostname {pod.name}", f"cd {shlex.quote(root + pod.workdir)}",
                         "exec env -i " + " ".join(shlex.quote(f"{k}={v}") for k, v in env.items()) + " "
                         + " ".join(shlex.quote(word(w)) for w in pod.argv)])
    out = base / f"pod-{index}"
    lines.append(f"unshare --mount --uts sh -c {shlex.quote(inner)} > {out}/stdout 2> {out}/stderr & p{index}=$!")
    return "\n".join(lines)


def job_script(pods: list[Pod], base, python: str, stop_after: str, names: tuple[str, ...]) -> str:
    """The whole job: the network, the hosts file (every pod's name and ``names`` at 127.0.0.1), every pod;
    with ``stop_after``: SIGKILL to the last pod (its node lost) once pod 0's stdout shows that text. Then
    the exit codes and what is left."""
    hosts = base / "hosts"
    hosts.write_text("127.0.0.1 localhost\n" + "".join(f"127.0.0.1 {n}\n" for n in (*[p.name for p in pods], *names)))
    lines = ["set -eu", "ip link set lo up", f"mount --bind {hosts} /etc/hosts"]
    lines += [pod_script(pod, i, base, python) for i, pod in enumerate(pods)]
    lines.append("set +e")
    if stop_after:
        lines.append(f"until grep -q {shlex.quote(stop_after)} {base}/pod-0/stdout || ! kill -0 $p0 2>/dev/null; "
                     f"do sleep 0.2; done; kill -KILL $p{len(pods) - 1}")
    lines += [f"wait $p{i}; echo $? > {base}/pod-{i}/rc" for i in range(len(pods))]
    lines.append(f"for d in /proc/[0-9]*; do [ \"${{d#/proc/}}\" = 1 ] || [ \"${{d#/proc/}}\" = \"$BASHPID\" ] || "
                 f"cat $d/cmdline >> {base}/left 2>/dev/null; done; exit 0")
    return "\n".join(lines)


def run_job(pods: list[Pod], base, python: str, stop_after: str = "", names: tuple[str, ...] = ()) -> list[dict]:
    """Run the pods; returns each pod's exit code, stdout, stderr (and termination log)."""
    for i in range(len(pods)):
        (base / f"pod-{i}").mkdir(parents=True)
    script = base / "job.sh"
    script.write_text(job_script(pods, base, python, stop_after, names))
    proc = subprocess.Popen(["unshare", "--mount", "--net", "--uts", "--pid", "--mount-proc", "--kill-child",
                             "bash", str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()  # --kill-child: its namespace's first process dies, and with it every process there
        proc.communicate()
        pytest.fail(f"the job did not end in {RUN_TIMEOUT} s: " + (base / "pod-0" / "stderr").read_text()[-3000:])
    assert proc.returncode == 0, out.decode()[-3000:]
    assert not (base / "left").exists(), (base / "left").read_text()  # nothing outlived its pod
    results = []
    for i in range(len(pods)):
        pod = base / f"pod-{i}"
        results.append({"rc": (pod / "rc").read_text().strip(), "stdout": (pod / "stdout").read_text(),
                        "stderr": (pod / "stderr").read_text(),
                        "termination": (pod / "dev" / "termination-log").read_text()
                        if (pod / "dev" / "termination-log").exists() else None})
    return results


def load(name: str):
    with open(os.path.join(EXAMPLES, name), encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def compose_mounts(volumes: list[str], dist) -> list[tuple[str, str, bool]]:  # noqa: F811
    """Compose's short volume syntax, relative to the file's directory; dist/ is ``make dist``'s."""
    mounts = []
    for volume in volumes:
        source, target, *mode = volume.split(":")
        here = os.path.normpath(os.path.join(EXAMPLES, source))
        if here == os.path.join(REPO, "dist", "ddp-launcher.pyz"):
            here = dist["pyz"]
        mounts.append((here, target, mode == ["ro"]))
    return mounts


def test_docker_compose_trains_with_its_read_only_scripts(tmp_path, dist, image_python):  # noqa: F811
    """Both services, as written: the scripts mounted read-only as the working directory, the outputs (the
    checkpoints after every epoch, the model) written where the command says, on each node."""
    services = load("docker-compose.yaml")["services"]
    pods = [Pod(svc["hostname"], container_words(svc["command"]), svc["environment"], svc["working_dir"],
                compose_mounts(svc["volumes"], dist)) for svc in services.values()]
    results = run_job(pods, tmp_path, image_python)
    assert [r["rc"] for r in results] == ["0", "0"], results[0]["stderr"][-3000:] + results[1]["stderr"][-3000:]
    output = tmp_path / "pod-0" / "root" / "workspace" / "outputs"
    assert (output / "metrics.json").exists() and os.listdir(output / "checkpoints"), sorted(os.listdir(output))
    assert "checkpoint saved" in results[0]["stdout"]
    scripts = tmp_path / "pod-0" / "root" / "code"
    assert not (scripts / "outputs").exists()


def test_the_jobset_pod_reports_its_end_in_the_termination_message(tmp_path, dist, image_python):  # noqa: F811
    """Both pods of the JobSet as written; the second one's node is lost (SIGKILL) while they train. The
    first exits 137 (host_lost), which the example's podFailurePolicy retries, and its termination message,
    which the example promises, says which host was lost (137 is also the OOM killer's code)."""
    jobset = load("jobset-retry.yaml")
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    pod_spec = job["template"]["spec"]
    (container,) = pod_spec["containers"]
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    configmap = tmp_path / "configmap"  # kubectl create configmap ddp-launcher --from-file=... (the comment)
    configmap.mkdir()
    os.symlink(dist["pyz"], configmap / "ddp-launcher.pyz")
    for name in ("train_digits.py", "ddp_utils.py"):
        os.symlink(os.path.join(REPO, "train_scripts", name), configmap / name)
    mounts = [(str(configmap), m["mountPath"], bool(m.get("readOnly"))) for m in container["volumeMounts"]
              if volumes[m["name"]]["configMap"]["name"] == "ddp-launcher"]
    assert len(mounts) == len(container["volumeMounts"]) == 1
    plain = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    name = jobset["metadata"]["name"]
    pods = [Pod(f"{name}-trainer-0-{i}", container_words(container["command"]), {**plain, "NODE_RANK": str(i)},
                "/workspace", mounts, kubernetes=True) for i in range(job["completions"])]
    assert plain["MASTER_ADDR"] == f"{pods[0].name}.{pod_spec['subdomain']}"  # the pod's name in its subdomain
    first, lost = run_job(pods, tmp_path, image_python, stop_after="METRIC epoch=1", names=(plain["MASTER_ADDR"],))
    retried = job["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"]
    assert lost["rc"] == str(128 + signal.SIGKILL) and lost["termination"] == ""  # killed: it wrote nothing
    assert first["rc"] == "137" and int(first["rc"]) in retried, first["stderr"][-3000:]
    message = first["termination"]
    assert message and first["stderr"].rstrip("\n").endswith(message.rstrip("\n")), first["stderr"][-3000:]
    assert pods[1].name in message.split("\n", 1)[0] and "lost" in message, message


def test_the_harness_makes_a_read_only_mount_read_only(tmp_path):
    """The stand-in is what it claims: a ``:ro`` mount refuses a write, a writable directory takes one."""
    source = tmp_path / "src"
    source.mkdir()
    script = 'touch "$1/x" 2>/dev/null; echo ro=$?; touch "$2/y"; echo rw=$?; hostname; getent hosts node0'
    pods = [Pod("node0", ["sh", "-c", script, "sh", "/code", "/workspace"], {}, "/code",
                [(str(source), "/code", True)])]
    (result,) = run_job(pods, tmp_path / "job", "/bin/true")
    assert result["rc"] == "0" and result["stdout"].split() == ["ro=1", "rw=0", "node0", "127.0.0.1", "node0"], result
    assert os.listdir(source) == [] and socket.gethostname() != "node0"
    assert os.path.exists(tmp_path / "job" / "pod-0" / "root" / "workspace" / "y")


def kubernetes_pods(name: str, configmap: str, data: str) -> list[Pod]:
    """The pods of a PyTorchJob or TrainJob example: each container's command, the variables its operator
    gives that pod (tests/test_platform_examples.py), the image's working directory, the manifest's mounts."""
    import test_platform_examples as spec

    job = load(name)
    sources = {"ddp-launcher": configmap, "resnet-data": data}
    if job["kind"] == "PyTorchJob":
        replicas = job["spec"]["pytorchReplicaSpecs"]
        templates = [(f"{job['metadata']['name']}-{kind.lower()}-{i}", replicas[kind]["template"]["spec"])
                     for kind in ("Master", "Worker") for i in range(replicas[kind]["replicas"])]
        pods = []
        for (pod_name, template), env in zip(templates, spec.pytorchjob_envs(job)):
            (container,) = template["containers"]
            volumes = {v["name"]: v.get("configMap", v.get("persistentVolumeClaim")) for v in template["volumes"]}
            mounts = [(sources[next(iter(volumes[m["name"]].values()))], m["mountPath"], bool(m.get("readOnly")))
                      for m in container["volumeMounts"]]
            pods.append(Pod(pod_name, container_words(container["command"]), env, "/workspace", mounts,
                            kubernetes=True))
        return pods
    override = job["spec"]["podSpecOverrides"][0]
    volumes = {v["name"]: v["configMap"]["name"] for v in override["volumes"]}
    (container,) = override["containers"]
    mounts = [(sources[volumes[m["name"]]], m["mountPath"], bool(m.get("readOnly"))) for m in container["volumeMounts"]]
    name_ = job["metadata"]["name"]
    return [Pod(f"{name_}-node-0-{i}", container_words(job["spec"]["trainer"]["command"]), env, "/workspace", mounts,
                kubernetes=True) for i, env in enumerate(spec.trainjob_envs(job))]


@pytest.mark.parametrize("name", ["pytorchjob-per-pod.yaml", "pytorchjob-nproc-per-node.yaml", "trainjob.yaml"])
def test_each_kubernetes_manifest_resolves_in_its_pods(name, tmp_path, dist, image_python):  # noqa: F811
    """Each pod of the manifest, its command from its ConfigMap mount (read-only) in the image's working
    directory, as a dry run (a real run needs GPUs, data or a download): one cluster, every node once."""
    configmap, data = tmp_path / "configmap", tmp_path / "data"
    for directory in (configmap, data):
        directory.mkdir()
    os.symlink(dist["pyz"], configmap / "ddp-launcher.pyz")
    for script in glob.glob(os.path.join(REPO, "train_scripts", "*.py")):
        os.symlink(script, configmap / os.path.basename(script))
    pods = [p._replace(env={**p.env, "LAUNCHER_DRY_RUN": "true", "LAUNCHER_JSON": "true"})
            for p in kubernetes_pods(name, str(configmap), str(data))]
    masters = {p.env.get("MASTER_ADDR") or p.env.get("PET_MASTER_ADDR") for p in pods}
    results = run_job(pods, tmp_path / "job", image_python, names=tuple(masters - {p.name for p in pods}))
    plans = [json.loads(r["stdout"][r["stdout"].index("{"):]) for r in results]
    assert [r["rc"] for r in results] == ["0"] * len(pods), [r["stderr"][-2000:] for r in results]
    assert sorted(p["cluster"]["node_rank"] for p in plans) == list(range(len(pods)))
    assert {p["platform"] for p in plans} <= {"kubeflow", "kubeflow-v2"} and len({p["platform"] for p in plans}) == 1
