"""The model server: OpenAI- and Anthropic-compatible routes over the engine."""
