"""The input contract: the allocation spec's models, presets on the worker host, recipes."""
