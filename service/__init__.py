"""kvrail service: Redis Streams workers and the OpenAI-compatible API."""
