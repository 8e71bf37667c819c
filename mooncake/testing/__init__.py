"""Harnesses and test doubles users run on their own code.

``mooncake.testing.fake_cuda.FakeCudaRuntime``: a host-memory stand-in for the CUDA runtime, for
logic tests of GPU paths on machines without a GPU (never a measure of the real thing).
"""
