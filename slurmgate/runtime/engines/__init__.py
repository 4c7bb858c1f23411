"""The engines: each engine's profile, its roles' launch, the field's frontends, layout maths."""
