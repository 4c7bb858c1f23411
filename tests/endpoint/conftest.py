"""Fixtures of the endpoint tests; the helpers live in endpoint_helpers.py beside this file."""

from __future__ import annotations

from endpoint_helpers import client, spawn, stub

__all__ = ["client", "spawn", "stub"]
