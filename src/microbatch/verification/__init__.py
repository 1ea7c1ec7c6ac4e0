"""Verify: a user's accumulated gradient against the full-batch gradient, with diagnostics.

``check`` runs ``verify`` (the passes in ``passes``, their comparison, the report in ``report``);
``diagnostics`` explains a difference (BatchNorm, dropout, a loss that is not a mean, couplings);
``precision`` sets tolerances from the compute dtype.

May import: ``errors``, ``trees``, ``workload``, ``accumulate``. Never the profile or planner.
"""

from __future__ import annotations

from .check import verify
from .report import VerifyReport

__all__ = ["VerifyReport", "verify"]
