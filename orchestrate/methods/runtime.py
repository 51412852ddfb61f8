"""The worker half of a training method (`Method.runtime` names the module, which defines `RUNTIME`).
Filled in by the worker stages."""

from __future__ import annotations


class MethodRuntime:
    """No-op hooks; a method's runtime overrides what it does on the worker."""
