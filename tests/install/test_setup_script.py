"""scripts/setup.sh before it installs anything: a python3 older than 3.10 is named in one line
(pip reported it as a torch dependency conflict), and a .venv whose creation failed (bin/python but
no bin/activate: Debian without python3-venv, or a set-up cut short) is made again rather than
reused (every later run stopped at ``.venv/bin/activate: No such file or directory``), while one
made without pip (``uv venv``), holding the CPU torch a user put there, is kept and given pip.

Run on a copy of the script in a temporary tree, with a stand-in ``python3`` first on PATH: the
script stops before any pip call, so nothing is installed."""
import os
import shutil
import subprocess

from _repo import ROOT


def _tree(tmp_path, python3: str):
    """A tree holding scripts/setup.sh and a bin/python3 running the shell code ``python3``."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text("#!/bin/sh\n" + python3)
    fake.chmod(0o755)
    return tmp_path, {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def _run(tree, env):
    return subprocess.run(["bash", str(tree / "scripts" / "setup.sh")], capture_output=True, text=True, env=env,
                          timeout=60)


def test_an_old_python_is_named_in_one_line(tmp_path):
    # the version check is python3 -c '...sys.exit(sys.version_info < (3, 10))': exit 1 is "too old"
    tree, env = _tree(tmp_path, 'case "$1" in -V) echo "Python 3.9.18";; *) exit 1;; esac\n')
    r = _run(tree, env)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert r.stderr.strip() == "scripts/setup.sh: Python 3.10+ is needed, python3 is Python 3.9.18", r.stderr
    assert not (tree / ".venv").exists()


def test_a_half_made_venv_is_made_again(tmp_path):
    # python3 passes the version check and fails to make a venv (as without python3-venv)
    tree, env = _tree(tmp_path, 'case "$1" in -m) exit 1;; *) exit 0;; esac\n')
    bin_dir = tree / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    half = bin_dir / "python"   # what a failed ensurepip leaves: a python with no pip, no bin/activate
    half.write_text("#!/bin/sh\nexit 1\n")
    half.chmod(0o755)
    r = _run(tree, env)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "python3 -m venv failed (on Debian/Ubuntu: apt install python3-venv)" in r.stderr, r.stderr
    assert "No such file or directory" not in r.stderr, r.stderr
    assert not (tree / ".venv").exists(), "the half-made .venv was kept"


def test_a_venv_without_pip_is_kept_and_given_pip(tmp_path):
    """A .venv made without pip (uv venv, ``--without-pip``) with a package put there first: kept, and
    ensurepip asked for; it was deleted (and pip then fetched PyPI's CUDA torch). Here ensurepip
    fails, so the script stops with one line and the .venv, its package included, stays."""
    tree, env = _tree(tmp_path, 'exit 0\n')
    bin_dir = tree / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "activate").write_text("")
    kept = tree / ".venv" / "lib" / "torch-was-here"
    kept.parent.mkdir(parents=True)
    kept.write_text("")
    py = bin_dir / "python"   # a python without pip whose ensurepip fails; it logs what it was asked
    py.write_text(f'#!/bin/sh\necho "$@" >> {tree}/asked\nexit 1\n')
    py.chmod(0o755)
    r = _run(tree, env)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "has no pip and ensurepip failed" in r.stderr, r.stderr
    assert kept.exists(), "the .venv without pip was deleted, with what was put in it"
    assert "-m ensurepip --upgrade" in (tree / "asked").read_text()
