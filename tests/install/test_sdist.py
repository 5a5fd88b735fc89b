"""The sdist holds what a build from it needs: ``pip install acarerank-*.tar.gz`` runs CMake on
CMakeLists.txt over csrc/ (MANIFEST.in). Without them it once built a wheel with no extension."""
import shutil
import subprocess
import sys
import tarfile

from _repo import ROOT


def test_sdist_holds_cmake_project_and_every_source(tmp_path):
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    tree = tmp_path / "tree"
    for rel in listed:  # the checkout as committed, plus new files not ignored (no build/, no *.so)
        if (ROOT / rel).is_file():
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, tree / rel)
    r = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")], cwd=tree,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (sdist,) = (tmp_path / "dist").glob("acarerank-*.tar.gz")
    with tarfile.open(sdist) as t:
        held = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    needed = {rel for rel in listed if rel == "CMakeLists.txt" or rel.startswith("csrc/")}
    assert "csrc/bindings.cpp" in needed, sorted(needed)
    assert needed <= held, f"missing from {sdist.name}: {sorted(needed - held)}"
