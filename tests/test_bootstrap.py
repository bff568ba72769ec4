"""launcher/bootstrap.py runs a script as ``python script.py`` does, and records the code it asked for.

Each fact is compared with plain ``python script.py`` run the same way: ``__name__``, ``__file__``,
``sys.argv``, ``sys.path[0]``, sibling imports, pickling of classes defined in the script,
multiprocessing spawn and forkserver children, DataLoader workers (fork and spawn), atexit handlers,
exit statuses and what reaches stderr. Then the record: the code survives a crash in teardown.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import time

import pytest
from conftest import PYTHON, launcher_env

from launcher.command import BOOTSTRAP, EXIT_DIR_VARIABLE

PROBE = '''\
import atexit, json, multiprocessing, os, pickle, sys
import helper


class Point:
    def __init__(self, x):
        self.x = x


def square(x):
    return x * x


class Squares:
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return i * i


def pool(method):
    with multiprocessing.get_context(method).Pool(1) as workers:
        return workers.map(square, [3, Point(4).x])


def loader(method):
    from torch.utils.data import DataLoader
    return sorted(int(x) for batch in DataLoader(Squares(), num_workers=2, multiprocessing_context=method)
                  for x in batch)


if __name__ == "__main__":
    atexit.register(lambda: print("atexit ran", flush=True))  # here: spawn children do not run it
    facts = {"name": __name__, "file": __file__, "argv": sys.argv, "path0": sys.path[0],
             "package": __package__, "spec": repr(__spec__), "doc": __doc__, "helper": helper.VALUE,
             "pickled": pickle.loads(pickle.dumps(Point(2))).x, "module": Point.__module__,
             "main_is_this": sys.modules["__main__"].__dict__ is globals(),
             "launcher_on_path": any(os.path.isfile(os.path.join(p or ".", "bootstrap.py")) for p in sys.path),
             "spawn": pool("spawn"), "forkserver": pool("forkserver"),
             "loader_fork": loader("fork"), "loader_spawn": loader("spawn")}
    print(json.dumps(facts, sort_keys=True), flush=True)
    sys.exit(int(sys.argv[1]))
'''


def run(tmp_path, script: str, *args: str, bootstrap: bool, stderr_file: bool = False, tag: str = ""):
    """``python [bootstrap.py] script args`` from ``tmp_path``: (status, stdout, stderr, the record).
    Runs with different ``tag`` values may go at the same time."""
    exits = tmp_path / (("exits-b" if bootstrap else "exits-p") + tag)
    exits.mkdir(exist_ok=True)
    env = launcher_env(**{EXIT_DIR_VARIABLE: str(exits)})
    argv = [PYTHON, *([BOOTSTRAP] if bootstrap else []), script, *args]
    err_path = tmp_path / f"stderr{tag}.log"
    with open(err_path, "w") as err:
        proc = subprocess.run(argv, cwd=str(tmp_path), env=env, stdout=subprocess.PIPE, text=True, timeout=300,
                              stderr=err if stderr_file else subprocess.PIPE)
    stderr = err_path.read_text() if stderr_file else proc.stderr
    records = [json.loads(p.read_text()) for p in exits.iterdir() if p.suffix == ".json"]
    for path in exits.iterdir():
        path.unlink()
    assert len(records) <= 1 and (bootstrap or not records)
    return proc.returncode, proc.stdout, stderr, (records[0] if records else None)


def test_the_script_sees_what_plain_python_gives_it(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "helper.py").write_text("VALUE = 'sibling'\n")
    (project / "probe.py").write_text('"""The probe."""\n' + PROBE)
    (tmp_path / "link.py").symlink_to(project / "probe.py")  # sys.path[0]: the real directory
    cases = [(script, bootstrap) for script in ("project/probe.py", "link.py") for bootstrap in (False, True)]
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:  # each run starts pools: all at once
        done = dict(zip(cases, pool.map(lambda case: run(tmp_path, case[0], "3", "a b", bootstrap=case[1],
                                                         tag=f"-{cases.index(case)}"), cases)))
    for script in ("project/probe.py", "link.py"):
        plain, boot = done[script, False], done[script, True]
        assert plain[0] == boot[0] == 3, boot[2][-3000:]
        assert plain[1] == boot[1]  # every fact, then "atexit ran"
        facts = json.loads(boot[1].splitlines()[0])
        assert facts["name"] == "__main__" and facts["argv"] == [script, "3", "a b"]
        assert facts["file"] == str(tmp_path / script) and facts["path0"] == str(project)
        assert facts["spawn"] == facts["forkserver"] == [9, 16] and facts["loader_spawn"] == [0, 1, 4, 9]
        assert facts["main_is_this"] and not facts["launcher_on_path"] and facts["helper"] == "sibling"
        assert boot[1].splitlines()[-1] == "atexit ran"
        assert {k: boot[3][k] for k in ("code", "stderr_offset")} == {"code": 3, "stderr_offset": None}


ENDINGS = [("sys.exit(7)", 7), ("raise ValueError('bad input')", 1), ("pass", 0), ("sys.exit('a message')", 1),
           ("sys.exit(None)", 0), ("sys.exit(256 + 7)", 7), ("sys.exit(-1)", 255), ("sys.exit(True)", 1),
           ("def broken(:\n    pass", 1), ("raise SystemExit(7) from ValueError('inner')", 7)]


@pytest.mark.parametrize(("body", "code"), ENDINGS)
def test_status_and_stderr_are_plain_pythons_and_the_code_is_recorded(tmp_path, body, code):
    (tmp_path / "end.py").write_text(
        "import atexit, sys\natexit.register(lambda: print('atexit ran', flush=True))\n"
        "def main():\n    print('working', flush=True)\n" + "\n".join("    " + ln for ln in body.splitlines())
        + "\nif __name__ == '__main__':\n    main()\n")
    plain = run(tmp_path, "end.py", bootstrap=False)
    before = time.time()
    boot = run(tmp_path, "end.py", bootstrap=True)
    assert before < boot[3]["started"] < boot[3]["ended"] < time.time()  # when the script ended, exactly
    assert plain[:3] == boot[:3]  # status, stdout (atexit included), stderr (the traceback: no bootstrap frame)
    assert boot[0] == code and boot[3]["code"] == code
    assert "bootstrap" not in boot[2]
    if "def broken" not in body:
        assert boot[1] == "working\natexit ran\n"


def test_the_code_survives_an_abort_in_teardown(tmp_path):
    """The atexit handler aborts after sys.exit(7), as torch's threads do: the record keeps 7 and where
    stderr stood, so the launcher can name what teardown printed."""
    (tmp_path / "abort.py").write_text(
        "import atexit, os, sys\n"
        "def crash():\n    sys.stderr.write('terminate called without an active exception\\n')\n"
        "    sys.stderr.flush()\n    os.abort()\n"
        "atexit.register(crash)\nsys.stderr.write('before\\n')\nsys.exit(7)\n")
    status, _out, stderr, record = run(tmp_path, "abort.py", bootstrap=True, stderr_file=True)
    assert status == -signal.SIGABRT
    assert (record["code"], record["stderr_offset"]) == (7, len("before\n"))
    assert stderr[record["stderr_offset"]:] == "terminate called without an active exception\n"


def test_no_exit_dir_means_no_record_and_the_same_status(tmp_path):
    (tmp_path / "seven.py").write_text("import sys\nsys.exit(7)\n")
    env = launcher_env()
    env.pop(EXIT_DIR_VARIABLE, None)
    proc = subprocess.run([PYTHON, BOOTSTRAP, "seven.py"], cwd=str(tmp_path), env=env, timeout=60)
    assert proc.returncode == 7
    assert sorted(os.listdir(tmp_path)) == ["seven.py"]
