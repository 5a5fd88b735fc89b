"""The last step of scripts/setup.sh: whether the compiled parts of the editable install load,
said here because pip hides a successful build's output (its "acarerank._cpu: not built" line)
without -v.

* acarerank._C (csrc/, the C++ CPU twins) always builds (docs/install.md, "Build prerequisites"):
  where it does not import, one line naming why, exit 1.
* acarerank._cpu (csrc/cpu/, the native CPU kernels) is built when torch imports at build time,
  as in setup.sh, unless ACARERANK_NO_CPU_EXT=1: where it does not load, one line naming why
  (``acarerank.ops._native.why_unavailable()``); exit 0, the ops run their torch backends.

Then "acarerank <version> installed".
"""
import os
import sys

import acarerank
import acarerank.kernels  # noqa: F401


def main() -> int:
    try:
        import acarerank._C  # noqa: F401
    except ImportError as e:
        print(f"scripts/setup.sh: acarerank._C does not import ({type(e).__name__}: {e}); it always builds: "
              "`pip install --no-build-isolation -v -e .` shows why it did not", file=sys.stderr)
        return 1
    from acarerank.ops import _native

    if os.environ.get("ACARERANK_NO_CPU_EXT") != "1" and not _native.available():
        print(f"scripts/setup.sh: warning: {_native.why_unavailable()}; the ops run their torch backends",
              file=sys.stderr)
    print("acarerank", acarerank.__version__, "installed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
