"""What srun starts: the node worker, the probe step, readiness, and the messages between them."""
