"""What outlives a run: its record, the controller's heartbeat, and the reaper of stale runs."""
