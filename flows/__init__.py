"""Prefect flows: reconcile, release-lease, allocation, and the demo driver."""
