"""The model runtime both workers share: the in-process engine and offline LLM here, the rest by concern below."""
