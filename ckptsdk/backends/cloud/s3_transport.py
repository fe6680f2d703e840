"""The S3 API over botocore for ``s3.py``: client, credentials, region, retries, deadlines, error kinds.

One call in, one answer out: retried a bounded number of times within its own bound and the save's
deadline (``deadline.py``, which also shortens the socket timeouts), with jitter from a generator
of our own, and "was it maybe applied?" reported to the caller. botocore's own retries
are off (its jitter draws from the global ``random``, which would move a training job's Python RNG
stream during a save). What a call means (objects, uploads, preconditions) belongs in ``s3.py``.
Tested with botocore 1.43.117 against moto 5.2.4 (``ckptsdk/testing/s3_server.py``).
"""

from __future__ import annotations

import logging
import os
import random
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

import botocore.config
import botocore.exceptions
import botocore.session
from botocore import UNSIGNED

from ckptsdk.backends.deadline import Retries, socket_timeout
from ckptsdk.errors import BackendError, ConfigError, StorageUnavailable

logger = logging.getLogger(__name__)

# Answers worth another attempt. A 5xx may mean "done, but the reply was lost", so a 412 after one
# of them is checked against what we wrote (s3.py). 409 ConditionalRequestConflict: AWS's answer
# to two conditional writes of one key at the same moment; AWS says to retry.
_RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
_RETRY_CODES = frozenset({"ConditionalRequestConflict", "SlowDown", "RequestTimeout", "InternalError"})
_REGION_CODES = frozenset({"PermanentRedirect", "AuthorizationHeaderMalformed", "IllegalLocationConstraintException"})
_CREDENTIAL_CODES = frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"})
# The storage options ``open_backend("s3://...", **options)`` accepts (anything else is refused).
OPTIONS = frozenset(
    {
        "endpoint_url",
        "region",
        "profile",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
        "anon",
        "max_pool_connections",
    }
)
# Retry jitter from a generator of our own: see the module docstring (the GCS lesson,
# tests/stories/test_faults_gcs.py).
_JITTER = random.Random()


# One botocore session per profile and one client per configuration, per process: a new
# session loads S3's service model again (~0.7 s here), a client of a known session ~0.25 s.
# botocore clients are thread-safe; after a fork the pid in the key makes new ones.
# Keyed by what decides the credential chain too, so a changed environment gets a new session.
_ENV_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_REGION")
_sessions: dict[tuple[Any, ...], botocore.session.Session] = {}
_clients: dict[tuple[Any, ...], Any] = {}
_cache_lock = threading.Lock()


def _session(profile: str | None) -> botocore.session.Session:
    with _cache_lock:
        key = (os.getpid(), profile, *(os.environ.get(k) for k in _ENV_KEYS))
        if key not in _sessions:
            _sessions[key] = botocore.session.Session(profile=profile)
        return _sessions[key]


@dataclass
class Answer:
    """One S3 answer: the parsed response, or the error S3 gave, plus the HTTP facts."""

    response: dict[str, Any] | None
    status: int
    code: str
    message: str
    headers: dict[str, str]
    ambiguous: bool  # an earlier attempt failed in a way that may have applied it
    error: botocore.exceptions.ClientError | None = None

    @property
    def ok(self) -> bool:
        return self.response is not None


def _answer_of(exc: botocore.exceptions.ClientError, ambiguous: bool) -> Answer:
    meta = exc.response.get("ResponseMetadata", {})
    err = exc.response.get("Error", {})
    return Answer(
        None,
        int(meta.get("HTTPStatusCode") or 0),
        str(err.get("Code", "")),
        str(err.get("Message", "")),
        dict(meta.get("HTTPHeaders") or {}),
        ambiguous,
        exc,
    )


class S3Transport:
    """Sends S3 calls through one botocore client per process; mixed into ``S3Backend``.

    Tunables are class attributes so a test can shrink them on one instance.
    """

    url: str
    bucket: str
    max_attempts = 4  # per call; backoff 0.25, 0.5, 1 s: a dead endpoint is reported in seconds
    backoff_s = 0.25
    connect_timeout_s = 10.0
    # No byte for this long (sent or received: urllib3's socket timeout covers both): the store
    # is stalled. With the attempt bound this keeps every call finite on a frozen server.
    read_timeout_s = 60.0
    call_deadline_s = 300.0  # all attempts of one call together

    def _init_transport(self, options: dict[str, Any]) -> None:
        unknown = sorted(set(options) - OPTIONS)
        if unknown:
            raise ConfigError(
                f"unknown storage option(s) {unknown} for {self.url}; S3 takes {sorted(OPTIONS)} "
                "(credentials also come from the standard AWS chain: env, ~/.aws, instance role)"
            )
        self._options = dict(options)
        session = _session(options.get("profile"))
        self._session = session
        # As botocore resolves it (service-specific variable first), but known here: a custom
        # endpoint decides the addressing style, and messages name it.
        self.endpoint = (
            options.get("endpoint_url")
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or session.get_config_variable("endpoint_url")
            or None
        )
        self.region = options.get("region") or session.get_config_variable("region") or "us-east-1"
        self.anon = bool(options.get("anon", False))
        explicit = {
            k: options[k] for k in ("aws_access_key_id", "aws_secret_access_key", "aws_session_token") if k in options
        }
        if not self.anon and not explicit and session.get_credentials() is None:
            raise ConfigError(
                f"no AWS credentials found for {self.url}: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, ~/.aws/credentials, an instance role), or pass "
                "storage_options aws_access_key_id=/aws_secret_access_key=...; anon=True reads public "
                "buckets only (it cannot write checkpoints)"
            )
        self._explicit = explicit
        self._client_lock = threading.Lock()
        self._client: Any = None
        self._client_pid = -1
        self.requests: Counter[str] = Counter()  # calls sent, by operation (benchmarks count them)

    def client(self, left: float | None = None) -> Any:
        """The botocore client of this process (made again after a fork; shared by same-config backends).

        ``left``: seconds the call may take. botocore fixes its socket timeouts when a client is
        made, so a call with less time than ``read_timeout_s`` gets a client with a shorter one
        (a few sizes, see :func:`~ckptsdk.backends.deadline.socket_timeout`, each made once).
        """
        if left is not None and left < self.read_timeout_s:
            return self._client_for(socket_timeout(self.read_timeout_s, left))
        return self._client_for(None)

    def _client_for(self, timeout: float | None) -> Any:
        read_timeout = self.read_timeout_s if timeout is None else timeout
        connect_timeout = self.connect_timeout_s if timeout is None else min(self.connect_timeout_s, timeout)
        with self._client_lock:
            if timeout is not None or self._client is None or self._client_pid != os.getpid():
                ident = (
                    os.getpid(),
                    id(self._session),
                    self.endpoint,
                    self.region,
                    self.anon,
                    tuple(sorted(self._explicit.items())),
                    self._options.get("max_pool_connections", 16),
                    connect_timeout,
                    read_timeout,
                )
                with _cache_lock:
                    cached = _clients.get(ident)
                if cached is not None:
                    if timeout is None:
                        self._client, self._client_pid = cached, os.getpid()
                    return cached
                config = botocore.config.Config(
                    region_name=self.region,
                    connect_timeout=connect_timeout,
                    read_timeout=read_timeout,
                    retries={"total_max_attempts": 1},  # ours, with our jitter (module docstring)
                    max_pool_connections=int(self._options.get("max_pool_connections", 16)),
                    # A custom endpoint (MinIO, R2, a local server) wants bucket-in-the-path URLs.
                    s3={"addressing_style": "path" if self.endpoint else "auto"},
                    signature_version=UNSIGNED if self.anon else None,
                    request_checksum_calculation="when_supported",
                    response_checksum_validation="when_supported",
                )
                made = self._session.create_client("s3", endpoint_url=self.endpoint, config=config, **self._explicit)
                with _cache_lock:
                    _clients[ident] = made
                if timeout is not None:
                    return made
                self._client, self._client_pid = made, os.getpid()
            return self._client

    def _call(self, op: str, key: str | None, *, read_body: bool = False, **params: Any) -> Answer:
        """Call ``op`` (a botocore method name) with ``params``; retry what is worth retrying.

        Args:
            op: e.g. ``"put_object"``.
            key: the object's key under the root (for messages), or None.
            read_body: read ``response["Body"]`` inside the attempt (a body cut off mid-read is
                retried like any other transport failure) and store the bytes as ``"Data"``.
            **params: the call's parameters (``Bucket`` is added).

        Returns:
            An :class:`Answer`: ``ok`` with the response, or the error S3 answered (412, 404...).

        Raises:
            BackendError: the store could not be reached, or kept failing, within the bounds.
        """
        params = {"Bucket": self.bucket, **params}
        ambiguous = False
        last: BaseException | None = None
        tries = Retries(
            self.max_attempts, backoff=self.backoff_s, spread=0.5, allowance=self.call_deadline_s, jitter=_JITTER
        )
        for left in tries:
            self.requests[op] += 1
            try:
                response = getattr(self.client(left if tries.deadline is not None else None), op)(**params)
                if read_body:
                    body = response.pop("Body")
                    try:
                        response["Data"] = body.read()
                    finally:
                        body.close()
            except botocore.exceptions.ClientError as exc:
                answer = _answer_of(exc, ambiguous)
                if answer.status not in _RETRY_STATUSES and answer.code not in _RETRY_CODES:
                    return answer
                ambiguous = ambiguous or answer.status >= 500 or answer.code == "ConditionalRequestConflict"
                last = exc
            except (botocore.exceptions.EndpointConnectionError, botocore.exceptions.ConnectTimeoutError) as exc:
                last = exc  # never reached the server: not applied
            except (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError) as exc:
                raise ConfigError(
                    f"no usable AWS credentials for {self.url}: {exc}; set AWS_ACCESS_KEY_ID/"
                    "AWS_SECRET_ACCESS_KEY or AWS_PROFILE, or pass storage_options aws_access_key_id=..."
                ) from exc
            except (botocore.exceptions.BotoCoreError, OSError) as exc:
                ambiguous, last = True, exc  # sent, but the reply was lost or cut: maybe applied
            else:
                return Answer(response, int(response["ResponseMetadata"]["HTTPStatusCode"]), "", "", {}, ambiguous)
            logger.warning("S3 %s %s: attempt %d/%d failed: %r", op, key, tries.tried, self.max_attempts, last)
        where = self.endpoint or f"AWS S3 ({self.region})"
        if tries.expired():
            assert tries.deadline is not None
            raise tries.deadline.exceeded(
                url=self.url,
                key=key,
                waited_for=f"S3 at {where} to answer {op} (key {key!r}; attempts: {tries.tried}, last: {last!r})",
            ) from last
        if isinstance(last, (botocore.exceptions.EndpointConnectionError, botocore.exceptions.ConnectTimeoutError)):
            raise BackendError(
                f"cannot reach S3 at {where} for {self.url} (key {key!r}): {last} ({tries.tried} tries). "
                "Check the network and the endpoint (storage option endpoint_url=..., or "
                "AWS_ENDPOINT_URL_S3); for a local server run `python -m ckptsdk.testing.s3_server`",
                url=self.url,
                key=key,
            ) from last
        raise BackendError(
            f"S3 {op} for {self.url} (key {key!r}) failed {tries.tried} times within {self.call_deadline_s:.0f} s, "
            f"last: {last!r}. Check the network and {where}, then retry",
            url=self.url,
            key=key,
        ) from last

    def _fail(self, answer: Answer, op: str, key: str | None, what: str) -> BackendError:
        """The error for an answer we cannot use (callers map 404/412 themselves)."""
        if answer.code == "NoSuchBucket":
            return self._missing_bucket(key)
        if answer.code in _REGION_CODES or answer.status == 301:
            right = answer.headers.get("x-amz-bucket-region")
            return StorageUnavailable(
                f"S3 bucket {self.bucket!r} is not in region {self.region!r}"
                + (f" but in {right!r}" if right else "")
                + f" ({answer.code or answer.status}: {answer.message}); pass storage_options "
                f"region={right or 'THE_BUCKET_REGION'!r} or set AWS_REGION",
                url=self.url,
                key=key,
            )
        if answer.code in _CREDENTIAL_CODES or answer.status in (401, 403):
            hint = (
                "check the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or "
                "storage_options) and their permissions on the bucket (s3:GetObject, s3:PutObject, "
                "s3:DeleteObject, s3:ListBucket)"
            )
        else:
            hint = "see the message from S3"
        err = BackendError(
            f"S3 refused to {what} {key!r} in {self.url}: HTTP {answer.status} {answer.code} {answer.message}; {hint}",
            url=self.url,
            key=key,
        )
        err.__cause__ = answer.error
        return err

    def _missing_bucket(self, key: str | None) -> StorageUnavailable:
        where = self.endpoint or f"AWS S3, region {self.region}"
        return StorageUnavailable(
            f"S3 bucket {self.bucket!r} does not exist (at {where}), so {self.url} cannot be used: "
            f"create it (aws s3 mb s3://{self.bucket}) or fix the URL",
            url=self.url,
            key=key,
        )
