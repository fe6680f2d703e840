"""Opening a ``gs://`` root waits for credential discovery only when it must, and then says so.

gcsfs looks for credentials when it is given none: on a machine off Google Cloud, its probe of the
GCE metadata server takes about 15 s. An emulator needs no credentials and given ones need no
search; only the ambient case searches, and a user waiting is told what for. ``google.auth.default``
(what gcsfs calls to search) is replaced here so that a search is seen, not timed.
"""

from __future__ import annotations

import logging
import threading
import uuid

import pytest

gauth = pytest.importorskip("google.auth")
pytest.importorskip("gcsfs")

from google.auth.credentials import AnonymousCredentials  # noqa: E402

from ckptsdk.backends.cloud.gcs import GCSBackend  # noqa: E402


@pytest.fixture
def no_search(monkeypatch):
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)

    def default(*args, **kwargs):
        raise AssertionError("gcsfs searched for credentials")

    monkeypatch.setattr(gauth, "default", default)


@pytest.fixture
def warnings_said():
    """The warnings ckptsdk's loggers emit during the test (a handler of our own on "ckptsdk")."""
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    logger = logging.getLogger("ckptsdk")
    logger.addHandler(handler)
    logging.getLogger("ckptsdk.backends.cloud.gcs").warning("canary")  # the handler does hear them
    assert said == ["canary"]
    said.clear()
    yield said
    logger.removeHandler(handler)


def _fresh() -> str:
    return f"p-{uuid.uuid4().hex}"  # gcsfs caches one filesystem per option set: never reuse one


def test_a_plain_http_endpoint_is_an_emulator_and_searches_for_nothing(no_search, warnings_said):
    b = GCSBackend("bucket/run", endpoint_url="http://127.0.0.1:9/", project=_fresh())
    assert b.credentials_method == "anon" and b.endpoint == "http://127.0.0.1:9"
    assert warnings_said == []  # not the "no Google credentials found" warning either


@pytest.mark.parametrize("token", ["anon", AnonymousCredentials()], ids=["anon", "credentials-object"])
def test_given_credentials_are_used_without_a_search(no_search, warnings_said, token):
    GCSBackend("bucket/run", token=token, project=_fresh())
    assert not [m for m in warnings_said if "looking for Google credentials" in m]


def test_a_search_that_takes_long_says_what_it_is_waiting_for(monkeypatch):
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setattr(GCSBackend, "credential_notice_s", 0.0)
    told = threading.Event()
    notices: list[str] = []

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "looking for Google credentials" in record.getMessage():
                notices.append(record.getMessage())
                told.set()

    def slow_default(*args, **kwargs):
        # The search ends only once the user has been told about it (no clock involved).
        assert told.wait(timeout=120), "no notice while the search was running"
        return AnonymousCredentials(), project  # found (a real search would go on to the metadata server)

    project = _fresh()
    monkeypatch.setattr(gauth, "default", slow_default)
    watch = Watch(level=logging.WARNING)
    logging.getLogger("ckptsdk").addHandler(watch)
    try:
        b = GCSBackend("bucket/run", project=project)
    finally:
        logging.getLogger("ckptsdk").removeHandler(watch)
    assert len(notices) == 1  # said once, while it waited
    assert "gs://bucket/run" in notices[0] and "token=" in notices[0]
    assert b.credentials_method == "google_default"
