"""Admission tests: make the shared builders in admission_kit.py importable."""

from __future__ import annotations
