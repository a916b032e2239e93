"""Server-side additions: HTTP routes served by vLLM's OpenAI API server."""
