"""Every variable an operator sets: one pydantic-settings model per part, composed at a root."""
