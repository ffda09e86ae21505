"""OpenAI-compatible HTTP endpoint: a thin translator onto ``swarm.node``."""
