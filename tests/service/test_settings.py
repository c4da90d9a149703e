"""`Settings.from_env`: every variable parsed and checked at startup, an error naming it."""

from __future__ import annotations

import pytest

from service.settings import Settings, SettingsError, served_model_name


def test_unset_or_empty_variables_keep_the_defaults():
    assert Settings.from_env({}) == Settings()
    assert Settings.from_env({"KVRAIL_MAX_PENDING": "", "REDIS_URL": ""}) == Settings()


def test_values_are_parsed_by_type():
    settings = Settings.from_env(
        {
            "REDIS_URL": "redis://r:6379/0",
            "KVRAIL_LOG_LEVEL": "debug",
            "KVRAIL_LOG_JSON": "off",
            "KVRAIL_MAX_PENDING": "7",
            "KVRAIL_STREAM_TIMEOUT_S": "2.5",
            "KVRAIL_SHUTDOWN_GRACE_S": "0",
            "KVRAIL_CORS_ORIGINS": "https://a.example, http://b.example:8080,",
            "KVRAIL_RESUME_GRACE_S": "0",
            "KVRAIL_HTTP_HEADER_TIMEOUT_S": "2.5",
            "KVRAIL_HTTP_BODY_TIMEOUT_S": "7",
            "KVRAIL_HTTP_KEEP_ALIVE_S": "0.5",
            "KVRAIL_HTTP_MAX_CONNECTIONS": "64",
        }
    )
    assert settings.cors_origins == ("https://a.example", "http://b.example:8080")
    assert settings.redis_url == "redis://r:6379/0"
    assert (settings.log_level, settings.log_json) == ("DEBUG", False)
    assert (settings.max_pending, settings.stream_timeout_s) == (7, 2.5)
    assert settings.shutdown_grace_s == 0
    assert settings.resume_grace_s == 0
    assert (settings.http_header_timeout_s, settings.http_body_timeout_s) == (2.5, 7)
    assert (settings.http_keep_alive_s, settings.http_max_connections) == (0.5, 64)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KVRAIL_MAX_PENDING": "many"}, "KVRAIL_MAX_PENDING must be an integer, got 'many'"),
        ({"KVRAIL_MAX_PENDING": "0"}, "KVRAIL_MAX_PENDING must be a positive integer, got 0"),
        ({"KVRAIL_MAX_DELIVERIES": "0"}, "KVRAIL_MAX_DELIVERIES must be a positive integer"),
        ({"KVRAIL_STREAM_TIMEOUT_S": "nan"}, "KVRAIL_STREAM_TIMEOUT_S must be a number"),
        ({"KVRAIL_SHUTDOWN_GRACE_S": "-1"}, "KVRAIL_SHUTDOWN_GRACE_S must be a number >= 0"),
        ({"KVRAIL_LOG_JSON": "maybe"}, "KVRAIL_LOG_JSON must be a boolean, got 'maybe'"),
        ({"KVRAIL_CORS_ORIGINS": "evil.example"}, "KVRAIL_CORS_ORIGINS must be a comma-sep"),
        ({"KVRAIL_LOG_LEVEL": "loud"}, "KVRAIL_LOG_LEVEL must be one of DEBUG"),
        ({"KVRAIL_RESUME_GRACE_S": "-0.5"}, "KVRAIL_RESUME_GRACE_S must be a number >= 0"),
        ({"KVRAIL_RESUME_GRACE_S": "inf"}, "KVRAIL_RESUME_GRACE_S must be a number"),
        ({"KVRAIL_HTTP_HEADER_TIMEOUT_S": "0"}, "KVRAIL_HTTP_HEADER_TIMEOUT_S must be a number >"),
        ({"KVRAIL_HTTP_BODY_TIMEOUT_S": "-3"}, "KVRAIL_HTTP_BODY_TIMEOUT_S must be a number > 0"),
        ({"KVRAIL_HTTP_KEEP_ALIVE_S": "soon"}, "KVRAIL_HTTP_KEEP_ALIVE_S must be a number, got"),
        ({"KVRAIL_HTTP_MAX_CONNECTIONS": "0"}, "KVRAIL_HTTP_MAX_CONNECTIONS must be a positive"),
        ({"KVRAIL_HTTP_MAX_CONNECTIONS": "1.5"}, "KVRAIL_HTTP_MAX_CONNECTIONS must be an integer"),
    ],
)
def test_a_bad_value_names_its_variable(env, message):
    with pytest.raises(SettingsError, match=message):
        Settings.from_env(env)


def test_served_model_name():
    assert served_model_name("/models/SmolLM2-360M-Instruct") == "SmolLM2-360M-Instruct"
    assert served_model_name("/models/smol.Q8_0.gguf") == "smol.Q8_0"
    assert served_model_name(None) == "SmolLM2-135M-Instruct"
