"""Benchmarks run by `specserve bench ...`; heavy imports stay inside each module's entry point."""
