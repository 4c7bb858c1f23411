"""Agentic result aggregation utilities."""

