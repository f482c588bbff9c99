"""The command-line tools of ``ipc-dpsample``: ``demo``, ``doctor`` and ``bench``.

Nothing here is imported by the library itself; :mod:`ipc_dpsample.tools.cli`
is the entry point (``ipc-dpsample`` and ``python -m ipc_dpsample``).
"""
