"""Agentic benchmark utilities."""

