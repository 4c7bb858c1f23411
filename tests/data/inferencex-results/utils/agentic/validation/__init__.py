"""Agentic result validation utilities."""

