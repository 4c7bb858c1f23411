"""The recipe's own benchmark clients (sa-bench, AIPerf): each tool's argv, run per concurrency."""
