"""Load generators for OpenAI-style endpoints: completions, and streaming chat as users see it."""
