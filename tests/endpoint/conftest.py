"""Fixtures of the endpoint tests; the helpers live in endpoint_helpers.py beside this file."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from endpoint_helpers import client, spawn, stub

__all__ = ["client", "spawn", "stub"]
