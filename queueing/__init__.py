"""kvrail wire schema and Redis Streams layer."""
