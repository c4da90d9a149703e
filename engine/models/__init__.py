"""Model implementations that run on a flat token batch."""
