"""Hostile input gets exit 2 and one line, every time, through ``python -m launcher`` (issue 12).

Each case runs the real launcher with a training script that would leave a marker file if anything
started it, and checks: exit code 2, nothing on stdout, exactly one stderr line that names the file,
variable or option and quotes at most a bounded part of the bad value, no marker, no process left.
The SageMaker form's namespace is checked against AWS's own rendering (``sagemaker_training``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from typing import Optional

import pytest
from conftest import PYTHON, assert_gone, free_port, launcher_env
from sagemaker_training import mapping

from launcher.errors import ConfigError
from launcher.options import SPECS, parse_invocation
from launcher.platforms.sagemaker import argv as aws_argv

MAX_LINE = 600  # an error line quotes at most errors.MAX_SHOWN characters of a value, plus its own words
MARKER_SCRIPT = "import os, sys\nopen(os.environ['MARKER'], 'w').write(repr(sys.argv))\n"


def refused(tmp_path, args: list[str], named: str, env: Optional[dict] = None, cwd=None,
            prefix: Optional[list[str]] = None) -> str:
    """Run the launcher; assert exit 2, one bounded line naming ``named``, nothing started. Returns the line."""
    script = tmp_path / "train.py"
    script.write_text(MARKER_SCRIPT)
    marker = tmp_path / "marker"
    environ = launcher_env(MARKER=str(marker), **(env or {}))
    proc = subprocess.Popen([*(prefix or []), PYTHON, "-m", "launcher", *args], cwd=str(cwd or tmp_path),
                            env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, raw_err = proc.communicate(timeout=60)
    err = raw_err.decode("utf-8", "replace")
    assert proc.returncode == 2, err[-3000:]
    assert out == b"" and err.endswith("\n") and err.count("\n") == 1, err[-3000:]
    assert named in err and "Traceback" not in err, err
    assert len(err) < MAX_LINE, f"{len(err)} characters: {err[:300]}..."
    assert not marker.exists(), "the training script ran"
    assert_gone([proc.pid])
    return err


def sagemaker_base(tmp_path, resourceconfig: Optional[bytes] = None, hyperparameters: Optional[bytes] = None):
    """A SageMaker tree; the given bytes become the config files (a valid one-host resourceconfig by default)."""
    config = tmp_path / "opt_ml" / "input" / "config"
    config.mkdir(parents=True)
    (config / "resourceconfig.json").write_bytes(
        resourceconfig if resourceconfig is not None else b'{"hosts": ["algo-1"], "current_host": "algo-1"}')
    if hyperparameters is not None:
        (config / "hyperparameters.json").write_bytes(hyperparameters)
    return {"SAGEMAKER_BASE_DIR": str(tmp_path / "opt_ml")}


# --- 1. configuration files that cannot be read as JSON ----------------------------------------

BAD_FILES = {
    "not UTF-8": b'{"hosts": ["algo-\xff"], "current_host": "algo-1"}',
    "UTF-16": '{"hosts": ["algo-1"]}'.encode("utf-16"),
    "nested deeply": b"[" * 100_000,
    "nested deeply, then closed": b"[" * 50_000 + b"]" * 50_000,
    "empty": b"",
    "white space": b" \n\t\n",
    "truncated": b'{"hosts": ["algo-1"',
    "an integer of 5000 digits": b'{"hosts": ["algo-1"], "current_host": "algo-1", "x": ' + b"9" * 5000 + b"}",
    "NUL bytes": b"\0" * 100,
}


@pytest.mark.parametrize("content", BAD_FILES.values(), ids=BAD_FILES.keys())
@pytest.mark.parametrize("name", ["resourceconfig.json", "hyperparameters.json"])
def test_unreadable_json_files(tmp_path, name, content):
    env = sagemaker_base(tmp_path, **{name.split(".")[0]: content})
    refused(tmp_path, ["train.py"], name, env)


def test_a_file_that_cannot_be_read(tmp_path):
    # /proc/self/mem opens but every read at offset 0 fails (EIO), even for root.
    env = sagemaker_base(tmp_path)
    path = tmp_path / "opt_ml" / "input" / "config" / "resourceconfig.json"
    path.unlink()
    path.symlink_to("/proc/self/mem")
    line = refused(tmp_path, ["train.py"], "resourceconfig.json", env)
    assert "cannot read" in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_a_file_without_read_permission(tmp_path):
    env = sagemaker_base(tmp_path)
    (tmp_path / "opt_ml" / "input" / "config" / "resourceconfig.json").chmod(0)
    refused(tmp_path, ["train.py"], "resourceconfig.json", env)


def test_a_configuration_file_that_is_a_directory(tmp_path):
    env = sagemaker_base(tmp_path)
    path = tmp_path / "opt_ml" / "input" / "config" / "resourceconfig.json"
    path.unlink()
    path.mkdir()
    refused(tmp_path, ["train.py"], "resourceconfig.json", {**env, "TRAINING_JOB_NAME": "job"})


def test_deep_json_in_variables(tmp_path):
    refused(tmp_path, ["train.py"], "SM_HOSTS", {"SM_HOSTS": "[" * 100_000, "SM_CURRENT_HOST": "a"})


# --- 2. a temporary directory that cannot be written -------------------------------------------

def test_tmpdir_is_a_file_or_missing(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    refused(tmp_path, ["train.py"], "TMPDIR", {"TMPDIR": str(afile)})
    refused(tmp_path, ["train.py"], "TMPDIR", {"TMPDIR": str(tmp_path / "missing")})
    assert not (tmp_path / "missing").exists()


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_tmpdir_on_a_read_only_mount(tmp_path):
    readonly = tmp_path / "ro"
    readonly.mkdir()
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("user and mount namespaces are not available here")
    # A private mount namespace of this test's own: the directory is bound read-only onto itself.
    remount = ["unshare", "-rm", "sh", "-c",
               'mount --bind "$RO" "$RO" && mount -o remount,bind,ro "$RO" && exec "$@"', "sh"]
    refused(tmp_path, ["train.py"], "TMPDIR is not writable", {"TMPDIR": str(readonly), "RO": str(readonly)},
            prefix=remount)
    assert os.listdir(readonly) == []


# --- 3. simulate: hyperparameters that cannot become argv words or SM_HP_* variables ----------

BAD_HYPERPARAMETERS = [
    ('{"a=b": 1}', "'a=b'"),
    ('{"a\\u0000": 1}', "NUL"),
    ('{"a": "x\\u0000y"}', "NUL"),
    ('{"a": {"k": ["x\\u0000"]}}', "NUL"),
    ('{"\\ud800": 1}', "surrogate"),
    ('{"a": "\\udfff"}', "surrogate"),
    ('{"a": {"\\ud800": 1}}', "surrogate"),
    ('{"a": ' + "[" * 500 + "]" * 500 + "}", "nested"),
    ("[" * 100_000, "nested too deeply"),
]


@pytest.mark.parametrize("text, named", BAD_HYPERPARAMETERS, ids=[n for _, n in BAD_HYPERPARAMETERS])
def test_simulate_refuses_hyperparameters_that_cannot_be_passed(tmp_path, text, named):
    (tmp_path / "work").mkdir()
    refused(tmp_path, ["simulate", "--hosts", "1", "--workdir", "job", "--hyperparameters", text, "--", "../train.py"],
            named, cwd=tmp_path / "work")
    assert os.listdir(tmp_path / "work") == []


def test_simulate_refuses_argv_bytes_that_are_not_utf8(tmp_path):
    (tmp_path / "work").mkdir()
    line = refused(tmp_path, ["simulate", "--hosts", "1", "--workdir", "job", "--", "../train.py", "--name",
                              os.fsdecode(b"a\xffb")], "'name'", cwd=tmp_path / "work")
    assert "surrogate" in line and os.listdir(tmp_path / "work") == []


# --- 4. a message quotes a bounded part of a value ---------------------------------------------

def test_a_10000_host_list_is_not_echoed_whole(tmp_path):
    hosts = [f"algo-{i}" for i in range(1, 10_001)]
    refused(tmp_path, ["train.py"], "SM_HOSTS", {"SM_HOSTS": json.dumps(hosts), "SM_CURRENT_HOST": "algo-0"})
    env = sagemaker_base(tmp_path, json.dumps({"hosts": hosts, "current_host": "x"}).encode())
    refused(tmp_path, ["train.py"], "resourceconfig.json", env)
    refused(tmp_path, ["--resolve", ",".join(hosts), "train.py"], "--resolve")
    refused(tmp_path, ["--platform", "x" * 100_000, "train.py"], "--platform")


# --- 5. counts without a sane bound, a script that torchrun would take for an option -----------

@pytest.mark.parametrize("args, env, named", [
    (["--nproc-per-node", "99999999999", "train.py"], {}, "--nproc-per-node"),
    (["--nproc-per-node", "1025", "train.py"], {}, "--nproc-per-node"),
    (["--nproc-per-node", "9" * 5000, "train.py"], {}, "--nproc-per-node"),
    (["--grace-period", "inf", "train.py"], {}, "--grace-period"),
    (["--grace-period", "nan", "train.py"], {}, "--grace-period"),
    (["--grace-period", "1e300", "train.py"], {}, "--grace-period"),
    (["--grace-period", "86401", "train.py"], {}, "--grace-period"),
    (["train.py"], {"LAUNCHER_GRACE_PERIOD": "Infinity"}, "LAUNCHER_GRACE_PERIOD"),
    (["--rdzv-timeout", "99999999999", "train.py"], {}, "--rdzv-timeout"),
    (["--max-restarts", "99999999999", "train.py"], {}, "--max-restarts"),
    (["--master-port", "65536", "train.py"], {}, "--master-port"),
    (["--master-port", "0", "train.py"], {}, "--master-port"),
    (["train.py"], {"SM_HOSTS": '["a"]', "SM_CURRENT_HOST": "a", "SM_NUM_GPUS": "99999"}, "SM_NUM_GPUS"),
    (["train.py"], {"SM_HOST_COUNT": "99999999999", "SM_CURRENT_HOST_RANK": "0"}, "SM_HOST_COUNT"),
    (["--", "-m", "train"], {}, "'-m'"),
    (["--train-script=-c", "print(1)"], {}, "'-c'"),
    (["--epochs", "1", "--train-script", "--help"], {}, "'--help'"),
    (["x"], {"LAUNCHER_TRAIN_SCRIPT": "-u"}, "'-u'"),
])
def test_unbounded_counts_and_option_like_scripts(tmp_path, args, env, named):
    refused(tmp_path, args, named, env)


# --- 6. the SageMaker form's namespace ---------------------------------------------------------

LAUNCHER_WORDS = sorted({flag for spec in SPECS for flag in spec.flags} - {"--train-script", "--train_script"})


@pytest.mark.parametrize("word", LAUNCHER_WORDS)
def test_launcher_words_as_hyperparameter_names_or_values_reach_the_script(word):
    """Any plain-form option, as a hyperparameter's name or value, in any form AWS renders, is the script's."""
    for value in (word, f"{word}=3", "True", "1", ""):
        user = {word.lstrip("-"): value, "mode": word, "z": [word, "1"], "cfg": {word: "1"}}
        argv = mapping.to_cmd_args({**user, "train-script": "train.py"})
        inv = parse_invocation(argv, {})
        assert aws_argv.is_pairs_form(argv) and inv.script == "train.py"
        assert list(inv.script_args) == mapping.to_cmd_args(user)
        defaults = parse_invocation(["train.py"], {}).options
        assert inv.options == defaults._replace(train_script="train.py")


@pytest.mark.parametrize("spec", [s for s in SPECS if s.name != "train_script"], ids=lambda s: s.name)
def test_launcher_prefixed_hyperparameters_are_the_launchers(spec):
    good = {"platform": "local", "nproc_per_node": 3, "master_port": 2345, "rdzv_timeout": 60, "max_restarts": 2,
            "grace_period": 30.5, "resolve": {"algo-1": "127.0.0.1"}, "dry_run": True, "json": True,
            "watch_port": 2346, "loss_timeout": 5.0, "job_secret_file": "/run/secret", "no_job_watch": True,
            "hang_timeout": 600.0, "hang_start_timeout": 900.0, "outcome_file": "/opt/ml/output/data/run.json",
            "instance_groups": ("train", "data"), "restart_on": ("hang", "worker_exit")}[spec.name]
    text = ",".join(f"{k}={v}" for k, v in good.items()) if isinstance(good, dict) else good
    for key in ("launcher-" + spec.name.replace("_", "-"), "launcher_" + spec.name):
        argv = mapping.to_cmd_args({key: text, "train-script": "train.py", "epochs": 3})
        inv = parse_invocation(argv, {})
        assert getattr(inv.options, spec.name) == good and inv.script_args == ("--epochs", "3")


@pytest.mark.parametrize("argv, needle", [
    (["--launcher-bogus", "1", "--train-script", "t.py"], "unknown launcher hyperparameter '--launcher-bogus'"),
    (["--launcher-grace-period", "3", "--launcher_grace_period", "4", "--train-script", "t.py"], "given twice"),
    (["--train-script", "t.py", "--train_script", "u.py"], "given twice"),
    (["--launcher-grace-period", "inf", "--train-script", "t.py"], "--launcher-grace-period: 'inf'"),
    (["--train-script", "t.py", "--launcher-grace-period"], "needs a value"),
])
def test_bad_launcher_hyperparameters(argv, needle):
    with pytest.raises(ConfigError) as err:
        parse_invocation(argv, {})
    assert needle in str(err.value)


def test_train_script_among_the_scripts_arguments_is_the_plain_form():
    for argv in (["t.py", "--train-script", "x"], ["--nproc-per-node", "2", "t.py", "--train-script", "x"]):
        inv = parse_invocation(argv, {})
        assert not aws_argv.is_pairs_form(argv)
        assert inv.script == "t.py" and inv.script_args[-2:] == ("--train-script", "x")


@pytest.mark.job
def test_a_dry_run_value_trains_for_real(tmp_path):
    """A hyperparameter whose value is ``--dry-run`` no longer turns the job into a dry run: the script runs."""
    script = tmp_path / "record_argv.py"
    script.write_text("import json, os, sys\n"
                      "json.dump({'argv': sys.argv[1:], 'pid': os.getpid(), 'ppid': os.getppid()},"
                      " open(os.environ['RECORD'], 'w'))\n")
    user = {"mode": "--dry-run", "dry-run": "True", "launcher": "--launcher-dry-run", "json": "--json"}
    argv = mapping.to_cmd_args({**user, "train-script": str(script), "launcher-nproc-per-node": 1})
    record = tmp_path / "record.json"
    env = launcher_env(RECORD=str(record), LAUNCHER_MASTER_PORT=str(free_port()))
    proc = subprocess.Popen([PYTHON, "-m", "launcher", *argv], cwd=str(tmp_path), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    found = json.loads(record.read_text())
    assert found["argv"] == mapping.to_cmd_args(user)
    assert_gone([proc.pid, found["pid"], found["ppid"]])


# --- 7. files of every kind, numbers of any length, host lists of any shape (issue 18) ---------

PEAK_RSS_WRAPPER = ("import resource, subprocess, sys\n"
                    "code = subprocess.call(sys.argv[1:])\n"
                    "sys.stderr.write('PEAK_KIB %d\\n' % resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
                    "sys.exit(code)\n")


def refused_in_bounded_memory(tmp_path, args, named, env, peak_kib: int = 100 * 1024) -> str:
    """:func:`refused`, and the launcher's peak RSS under ``peak_kib`` (measured by a wrapper process)."""
    script = tmp_path / "train.py"
    script.write_text(MARKER_SCRIPT)
    proc = subprocess.run([PYTHON, "-c", PEAK_RSS_WRAPPER, PYTHON, "-m", "launcher", *args], cwd=str(tmp_path),
                          env=launcher_env(MARKER=str(tmp_path / "marker"), **env), capture_output=True, timeout=60)
    err = proc.stderr.decode("utf-8", "replace")
    line, _, peak = err.rpartition("PEAK_KIB ")
    assert proc.returncode == 2 and proc.stdout == b"" and line.count("\n") == 1, err[-3000:]
    assert named in line and "Traceback" not in line and len(line) < MAX_LINE, line
    assert int(peak) < peak_kib, f"peak RSS {int(peak)} KiB: {line}"
    assert not (tmp_path / "marker").exists()
    return line


def special_file(tmp_path, kind: str) -> str:
    """A path that is a file of ``kind``: a FIFO nobody writes, a device, a 1 GB file (sparse or not)."""
    if kind in ("/dev/zero", "/dev/urandom"):
        return kind
    path = tmp_path / kind.replace(" ", "-")
    if kind == "FIFO":
        os.mkfifo(path)
    elif kind == "sparse 1 GB":
        with open(path, "wb") as fh:
            fh.truncate(1 << 30)
    elif kind == "1 GB of host names":  # real blocks, not a hole: written by the kernel, not Python
        with open(path, "wb") as fh:
            fh.write(b"node-0001\n" * (1 << 20))
        with open(path, "r+b") as fh:
            fh.truncate(1 << 30)
    return str(path)


FILE_KINDS = ["FIFO", "/dev/zero", "/dev/urandom", "sparse 1 GB", "1 GB of host names"]


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_pbs_nodefile_of_every_kind(tmp_path, kind):
    env = {"PBS_JOBID": "12.srv", "PBS_NODEFILE": special_file(tmp_path, kind)}
    refused_in_bounded_memory(tmp_path, ["train.py"], "PBS_NODEFILE", env)


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_oci_metadata_file_of_every_kind(tmp_path, kind):
    env = {"CLUSTER_NODES_METADATA_FILE": special_file(tmp_path, kind), "NODE_COUNT": "2", "NODE_RANK": "0",
           "LAUNCHER_RDZV_TIMEOUT": "900"}  # refused at the first look, not after the wait
    refused_in_bounded_memory(tmp_path, ["train.py"], "CLUSTER_NODES_METADATA_FILE", env)


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_resourceconfig_of_every_kind(tmp_path, kind):
    env = sagemaker_base(tmp_path)
    path = tmp_path / "opt_ml" / "input" / "config" / "resourceconfig.json"
    path.unlink()
    path.symlink_to(special_file(tmp_path, kind))
    refused_in_bounded_memory(tmp_path, ["train.py"], "resourceconfig.json", env)


SLURM = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_NODEID": "0", "SLURMD_NODENAME": "n1"}


@pytest.mark.parametrize("nodelist", [
    "n[" + "9" * 5000 + "]",
    "n[1-" + "9" * 5000 + "]",
    "n" + "9" * 5000,  # a name of 5000 digits: not a host name (more than 63 characters in a label)
    "n[1-2]" + "[0-99998]" * 3,
    "n[0-99998]" + "[0-99998]" * 14_000,  # about 128 KiB, one variable's limit on Linux
    ",".join(["n[0-99998]"] * 11_000),
    "n[٣]",
])
def test_slurm_host_lists_of_any_shape_in_bounded_memory(tmp_path, nodelist):
    refused_in_bounded_memory(tmp_path, ["train.py"], "SLURM_STEP_NODELIST", {**SLURM, "SLURM_STEP_NODELIST": nodelist})


@pytest.mark.parametrize("name", ["algo-1\nalgo-9", "algo-1;reboot", "$(reboot)", "algo 1", "a`b`", "-rf", "a" * 64,
                                  "algo-1\x1b[2J", "algo..1", "ä"])
def test_host_names_that_are_not_host_names(tmp_path, name):
    hosts = json.dumps(["algo-0", name])
    refused(tmp_path, ["train.py"], "SM_HOSTS", {"SM_HOSTS": hosts, "SM_CURRENT_HOST": "algo-0"})
    env = sagemaker_base(tmp_path, json.dumps({"hosts": ["algo-0", name], "current_host": "algo-0"}).encode())
    refused(tmp_path, ["train.py"], "resourceconfig.json", env)
    refused(tmp_path, ["train.py"], "MASTER_ADDR",
            {"MASTER_ADDR": name, "MASTER_PORT": "29500", "NNODES": "2", "NODE_RANK": "1"})


def test_a_dry_run_prints_no_control_character(tmp_path):
    (tmp_path / "train.py").write_text(MARKER_SCRIPT)
    env = launcher_env(SM_HOSTS='["algo-1"]', SM_CURRENT_HOST="algo-1", SM_CURRENT_INSTANCE_TYPE="ml.x\nforged: line",
                       SM_NETWORK_INTERFACE_NAME="eth0\x1b[2J")
    proc = subprocess.run([PYTHON, "-m", "launcher", "--dry-run", "train.py", "--note", "a\nb\rc"], cwd=str(tmp_path),
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert not any(line.startswith(("forged", "b")) for line in proc.stdout.splitlines()), proc.stdout
    assert all(ch.isprintable() for line in proc.stdout.splitlines() for ch in line), proc.stdout


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_a_full_tmpdir_is_named_before_anything_starts(tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("user and mount namespaces are not available here")
    # A 512 KiB tmpfs in a private mount namespace of this test's own, filled up: writable, and full.
    fill = ["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=512k tmpfs "$FULL" && '
            'dd if=/dev/zero of="$FULL/fill" bs=4k 2>/dev/null; exec "$@"', "sh"]
    line = refused(tmp_path, ["train.py"], "TMPDIR", {"TMPDIR": str(full), "FULL": str(full),
                                                      "SM_HOSTS": '["algo-1"]', "SM_CURRENT_HOST": "algo-1"},
                   prefix=fill)
    assert "full" in line
