"""Admission by weighted runner leases: model, planner, policies, lease protocol, the tick."""
