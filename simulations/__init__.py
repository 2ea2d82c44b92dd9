"""Experiment drivers, sweeps and benchmarks over the installed ``fedddl`` package.

Run each from the repository root as a module: ``python -m simulations.NAME [options]``.
They import ``fedddl``, ``strategies``, ``clients`` and each other, nothing else of the
repository.
"""
