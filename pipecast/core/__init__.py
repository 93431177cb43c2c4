"""The base layer: errors, units, file helpers, settings, the HTTP server life cycle, progress bars.

Everything else of pipecast (packager, control plane, runtime, benchmarks) may import it; it imports
nothing of the project but :mod:`pipecast.v1` (tests/test_layers.py checks it).
"""
