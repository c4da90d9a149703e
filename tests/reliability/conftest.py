"""The API fixtures of `tests/service/test_api.py` (a real uvicorn and a fake worker that is a
real consumer of the request stream), shared with the reliability tests."""

from __future__ import annotations

from tests.service.test_api import start_api, tokenizer_dir, worker  # noqa: F401
