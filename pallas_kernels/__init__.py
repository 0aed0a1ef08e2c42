"""Attention kernels for jaxserve: ragged paged attention and the KV write.

Each kernel package offers the same interface from a pure-JAX reference (the CPU
default and the oracle in tests) and from Pallas kernels for TPU and GPU.
"""
