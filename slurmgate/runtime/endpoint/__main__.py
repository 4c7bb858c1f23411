"""`python -m slurmgate.runtime.endpoint`: serve one deployment's logical endpoint."""

from slurmgate.runtime.endpoint.app import main

main()
