"""Spans of compute and communication, and how much they overlap: defined in the
measurement layer (`labkit.ledger.timeline`, which also records them for any
model), imported here by the wrappers that record their own."""

from labkit.ledger.timeline import Span, overlap_fraction, union

__all__ = ["Span", "overlap_fraction", "union"]
