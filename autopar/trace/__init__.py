"""Tracer: ``trace(model, ...)`` turns an ``nn.Module`` on meta (or real) weights into an
``autopar.ir.Graph`` without allocating memory (see ``autopar.trace.api``)."""

from autopar.trace.api import trace

__all__ = ["trace"]
