"""Package discovery for setuptools; everything else is in pyproject.toml.

Every package under ``ipc_dpsample/`` is found, so a new subpackage cannot be left out
of the wheel, and the CUDA sources in the top-level ``kernels/`` folder ship inside the
package as ``ipc_dpsample.kernels`` (mapped in ``[tool.setuptools.package-dir]``).
``find_packages`` alone cannot add that one: it lives outside ``ipc_dpsample/``.
"""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["ipc_dpsample", "ipc_dpsample.*"]), "ipc_dpsample.kernels"])
