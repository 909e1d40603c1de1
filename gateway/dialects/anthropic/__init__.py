"""Anthropic's Messages API: the request and its output."""
