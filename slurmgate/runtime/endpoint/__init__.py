"""The logical endpoint: one proxy per deployment on the client host (routing, backpressure)."""
