"""setup.py's CMake build tree across reinstalls (``pip install -e .`` again, with or without
acarerank._cpu): CMake is a stand-in that logs its calls (running the real one to configure where
a test asks), so nothing compiles here.

* The cached CMake is kept when it is the one on PATH, seen through pip's wrapper script: a second
  install once dropped the cache and every object on each of its two extensions (17 compiles).
* A cache whose cmake is gone (pip's isolated build env of an earlier install) is dropped; the
  objects in CMakeFiles/ stay.
* A build without acarerank._cpu removes the _cpu module an earlier build left in its output
  folder, and CMake's status line gives setup.py's reason.
* ... but only when ACARERANK_NO_CPU_EXT=1 asked for it: a build that cannot import torch (pip's
  isolated build env of ``pip install -e .``) keeps the working _cpu that scripts/setup.sh built.
"""
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

from _hidden import HIDE_DIR
from _repo import ROOT

EXT = sysconfig.get_config_var("EXT_SUFFIX")


def _tree(tmp_path):
    """setup.py, CMakeLists.txt and csrc/ copied to tmp_path/tree (its build/ is its own)."""
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("setup.py", "CMakeLists.txt"):
        shutil.copy(ROOT / name, tree / name)
    shutil.copytree(ROOT / "csrc", tree / "csrc")
    return tree


def _build(tmp_path, tree, *extra, real_configure=False, **env_extra):
    """``setup.py build_ext`` with a cmake that logs its calls and runs the real one for ``--version``
    and ``-P`` (and for the configure when ``real_configure``), the way pip's cmake wrapper does."""
    real = shutil.which("cmake")
    assert real and shutil.which("ninja"), "cmake and ninja must be on PATH (pip install cmake ninja)"
    fake_bin = tmp_path / "fakebin"
    fake_bin.mkdir(exist_ok=True)
    fake = fake_bin / "cmake"
    fake.write_text(f"""#!/bin/sh
echo "$*" >> {tmp_path}/cmake.log
case "$1" in --version|-P) exec {real} "$@";; --build) exit 0;; esac
[ "$REAL_CONFIGURE" = 1 ] && exec {real} "$@"
exit 0
""")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}", "ACARERANK_NO_CUDA": "1",
           "REAL_CONFIGURE": "1" if real_configure else "0", **env_extra}
    r = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path / "out"),
                        "--build-temp", str(tmp_path / "tmp"), *extra], cwd=tree, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    return r


def _cached_cmake_command(tmp_path):
    """CMAKE_COMMAND as a real configure caches it (the reference)."""
    toy = tmp_path / "toy"
    (toy / "b").mkdir(parents=True)
    (toy / "CMakeLists.txt").write_text("cmake_minimum_required(VERSION 3.24)\nproject(t NONE)\n")
    subprocess.run([shutil.which("cmake"), str(toy)], cwd=toy / "b", check=True, capture_output=True)
    line = next(ln for ln in (toy / "b" / "CMakeCache.txt").read_text().splitlines()
                if ln.startswith("CMAKE_COMMAND:"))
    return line.partition("=")[2]


def _seed_build_tree(tree, cmake_command):
    """A build tree as an earlier install left it: its cache and one object."""
    build = tree / "build" / f"cmake-{sys.implementation.cache_tag}-release"
    (build / "CMakeFiles" / "_C.dir").mkdir(parents=True)
    (build / "CMakeFiles" / "_C.dir" / "bindings.cpp.o").write_bytes(b"obj")
    (build / "CMakeCache.txt").write_text(f"CMAKE_COMMAND:INTERNAL={cmake_command}\n"
                                          f"CMAKE_MAKE_PROGRAM:FILEPATH={shutil.which('ninja')}\n")
    return build


def test_reinstall_keeps_the_cache_of_the_same_cmake(tmp_path):
    tree = _tree(tmp_path)
    build = _seed_build_tree(tree, _cached_cmake_command(tmp_path))
    r = _build(tmp_path, tree)
    assert "reconfiguring" not in r.stderr, r.stderr[-2000:]
    assert (build / "CMakeCache.txt").is_file(), f"the cache of the same cmake was dropped:\n{r.stderr[-2000:]}"
    assert (build / "CMakeFiles" / "_C.dir" / "bindings.cpp.o").is_file(), "the objects were dropped"


def test_a_gone_cmake_drops_the_cache_but_not_the_objects(tmp_path):
    tree = _tree(tmp_path)
    build = _seed_build_tree(tree, str(tmp_path / "pip-build-env-gone" / "bin" / "cmake"))
    r = _build(tmp_path, tree)
    assert "CMAKE_COMMAND changed" in r.stderr, r.stderr[-2000:]
    assert not (build / "CMakeCache.txt").is_file(), "the cache naming a cmake that is gone was kept"
    assert (build / "CMakeFiles" / "_C.dir" / "bindings.cpp.o").is_file(), "the objects were dropped"


@pytest.mark.parametrize("inplace", [False, True], ids=["build_lib", "inplace"])
def test_a_build_without_cpu_ext_removes_the_old_one(tmp_path, inplace):
    """ACARERANK_NO_CPU_EXT=1 on a reinstall: the _cpu module of the earlier build must not load.
    Inplace is the editable install's case (setuptools copies the modules into the source tree)."""
    tree = _tree(tmp_path)
    out = (tree if inplace else tmp_path / "out") / "acarerank"
    out.mkdir(parents=True)
    old_cpu, old_c = out / f"_cpu{EXT}", out / f"_C{EXT}"
    old_cpu.write_bytes(b"old")
    old_c.write_bytes(b"old")
    if inplace:  # what the (stand-in) build would have put in build_lib, copied to the source tree
        (tmp_path / "out" / "acarerank").mkdir(parents=True)
        (tmp_path / "out" / "acarerank" / f"_C{EXT}").write_bytes(b"new")
    r = _build(tmp_path, tree, *(["--inplace"] if inplace else []), real_configure=not inplace,
               ACARERANK_NO_CPU_EXT="1")
    assert not old_cpu.exists(), f"{old_cpu} of the earlier build is still there:\n{r.stderr[-2000:]}"
    assert old_c.is_file(), "acarerank._C was removed too"
    assert "acarerank._cpu: removed" in r.stderr, r.stderr[-2000:]
    log = (tmp_path / "cmake.log").read_text()
    assert "-DACARERANK_CPU_EXT_SKIPPED=ACARERANK_NO_CPU_EXT=1" in log, log
    if not inplace:  # the real configure ran: its status line names setup.py's reason
        assert "acarerank._cpu: not built (ACARERANK_NO_CPU_EXT=1)" in r.stdout, r.stdout[-3000:]


@pytest.mark.parametrize("inplace", [False, True], ids=["build_lib", "inplace"])
def test_a_build_without_torch_keeps_the_old_cpu_ext(tmp_path, inplace):
    """torch not importable at build time (pip install -e . in pip's isolated build env), no
    ACARERANK_NO_CPU_EXT: _cpu is not built, and the one an earlier build left must stay
    (docs/install.md removes it only under ACARERANK_NO_CPU_EXT=1)."""
    tree = _tree(tmp_path)
    out = (tree if inplace else tmp_path / "out") / "acarerank"
    out.mkdir(parents=True)
    old_cpu = out / f"_cpu{EXT}"
    old_cpu.write_bytes(b"old")
    if inplace:  # what the (stand-in) build would have put in build_lib, copied to the source tree
        (tmp_path / "out" / "acarerank").mkdir(parents=True)
        (tmp_path / "out" / "acarerank" / f"_C{EXT}").write_bytes(b"new")
    r = _build(tmp_path, tree, *(["--inplace"] if inplace else []), ACARERANK_NO_CPU_EXT="",
               PYTHONPATH=str(HIDE_DIR), ACARERANK_HIDE_MODULES="torch")
    assert "acarerank._cpu: not built: torch is not importable" in r.stderr, r.stderr[-2000:]
    assert old_cpu.is_file(), f"{old_cpu} was removed by a build that only could not import torch:\n{r.stderr[-2000:]}"
    assert "acarerank._cpu: removed" not in r.stderr, r.stderr[-2000:]
