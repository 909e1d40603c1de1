"""The pipeline every dialect goes through: parse -> tokenize -> admit -> generate -> JSON or SSE."""
