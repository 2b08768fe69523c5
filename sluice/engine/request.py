"""Moved to `sluice.core.request` (the runner reads requests too, and may not import the
engine). This re-export keeps branches written before the move importing; new code
imports from `sluice.core.request`. Remove once nothing imports it."""

from sluice.core.request import Request, RequestMetrics, RequestStatus

__all__ = ["Request", "RequestMetrics", "RequestStatus"]
