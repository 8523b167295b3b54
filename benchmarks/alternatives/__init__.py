"""Comparison kernels: measured against the registered lowering and slower (BENCHMARKS.md), or
not wired to any k31c op. The benchmarks time them beside the kernels k31c runs; nothing in k31c
imports them and the AOT build (k31c build-kernels) does not build them. Each has a test in
tests/alternatives/."""
