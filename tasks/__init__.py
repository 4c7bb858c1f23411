"""Prefect tasks: the retryable units of the flows (GitHub steps, allocation artifacts)."""
