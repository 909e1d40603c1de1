"""OpenAI's completions and chat completions: the request, the chat prompt, structured outputs, the output."""
