"""Shared fixtures. TRITON_INTERPRET must be set before any kernel module is imported."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
