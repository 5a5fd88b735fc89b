"""Triton kernels of acarerank (importable as ``acarerank.kernels``)."""
