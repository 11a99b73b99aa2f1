"""Processes, meshes, instrumented collectives, launching and metrics.

Import the submodules directly (``podscale.runtime.mesh``...); this package imports nothing itself so that
``podscale.runtime.env`` stays free of torch for fast command-line validation.
"""
