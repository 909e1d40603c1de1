"""OpenAI's Responses API: the request, its output, the store, its routes, background responses."""
