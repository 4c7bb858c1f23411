"""One allocation run: allocate, preflight, launch, readiness, endpoints, client, cleanup."""
