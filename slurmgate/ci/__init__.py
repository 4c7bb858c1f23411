"""The CI side of admission: what a GitHub workflow runs to ask for capacity (runs-on labels)."""
