"""Prefect deployments of slurmgate: prefect.yaml, the served process, triggers and automations."""
