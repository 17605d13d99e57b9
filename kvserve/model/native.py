"""Where the native kernels used to live; now :mod:`kvserve.model.kernels`.

Kept so ``python -m kvserve.model.native`` (``make setup``) still builds the library.
New code imports from :mod:`kvserve.model.kernels` (bindings per csrc file, and the
:class:`~kvserve.model.kernels.backend.KernelBackend` the runner passes down).
"""

from __future__ import annotations

from kvserve.model.kernels.build import build

__all__ = ["build"]

if __name__ == "__main__":
    print(build(verbose=True))
