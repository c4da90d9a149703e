"""kvrail's benchmarks: throughput, serving, the latency cliff and KV waste (see README.md)."""
