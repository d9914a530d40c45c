"""Structured outputs and tool calls: the grammars of response_format, guided_* and forced tool calls, and the parsers that read tool calls from a model's text (vLLM's hermes and llama3_json)."""
