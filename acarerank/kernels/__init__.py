"""Triton kernels of acarerank (importable as ``acarerank.kernels``).

- ``prefix_shared_attention``: one-pass grouped prefix-shared attention (docs/ARCHITECTURE.md, "The one primitive").
- ``yes_no_head``: fused final RMSNorm + (w_yes − w_no) dot + sigmoid (docs/ARCHITECTURE.md, "Scoring facts").

The ops in ``acarerank.ops`` import these modules lazily (backend "triton"), so importing
this package does not import triton. ``triton.jit`` reads TRITON_INTERPRET when a kernel
module is imported: set it first to run the kernels on CPU tensors.
"""
