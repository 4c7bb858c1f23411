"""`python -m slurmgate.runtime.endpoint`: serve one deployment's logical endpoint."""

from slurmgate.runtime.endpoint.app import main

if __name__ == "__main__":  # import-safe: only running it serves
    main()
