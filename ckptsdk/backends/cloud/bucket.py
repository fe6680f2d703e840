"""What the object-store backends (``gcs.py``, ``s3.py``) share about their root: ``bucket/prefix``.

Parsing the root, naming a key under its prefix, and telling a missing object from a missing
bucket (asked once, then remembered). How a request travels is each store's transport; what an
answer means is each backend's.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable

from ckptsdk.backends.base import check_folder_prefix, check_key
from ckptsdk.errors import BackendError, ConfigError, ObjectNotFound, StorageUnavailable

__all__ = ["BucketRoot"]


class BucketRoot(abc.ABC):
    """A root ``bucket/prefix`` in an object store; a base of ``GCSBackend`` and ``S3Backend``.

    A subclass sets ``scheme`` and answers :meth:`_bucket_exists` and :meth:`_missing_bucket`.
    """

    scheme: str
    url: str
    bucket: str
    prefix: str
    _bucket_seen: bool

    def _init_root(self, path: str, url: str | None) -> None:
        """Parse ``bucket[/prefix]``; ``ConfigError`` without a bucket or with a bad prefix."""
        path = str(path).strip("/")
        bucket, _, prefix = path.partition("/")
        self.url = url or f"{self.scheme}://{path}"
        if not bucket:
            raise ConfigError(f"{self.url!r} names no bucket: use {self.scheme}://BUCKET[/PREFIX]")
        if prefix:
            check_key(prefix, url=self.url)
        self.bucket, self.prefix = bucket, prefix
        self._bucket_seen = False  # set by the first answer that proves the bucket is there

    @property
    def _root(self) -> str:
        """What every object name under this root starts with: ``prefix/``, or nothing."""
        return f"{self.prefix}/" if self.prefix else ""

    def _name(self, key: str) -> str:
        """The object name of ``key``: under the prefix, checked first."""
        check_key(key, url=self.url)
        return self._root + key

    def list_folders(self, prefix: str) -> list[str]:
        """The top-level folders whose names start with ``prefix``, sorted: a delimiter listing
        (:meth:`_subfolders`), which names each folder once instead of sending its objects."""
        check_folder_prefix(prefix, url=self.url)
        return sorted({p[len(self._root) :].removesuffix("/") for p in self._subfolders(prefix)})

    @abc.abstractmethod
    def _subfolders(self, prefix: str) -> Iterable[str]:
        """The store's names (``<root prefix>/NAME/``) of the folders under the root starting with
        ``prefix``: its listing with the delimiter ``/``, every page."""

    @abc.abstractmethod
    def _bucket_exists(self, key: str | None) -> bool | None:
        """Ask the store whether the bucket exists (None: it would not say, e.g. 403)."""

    @abc.abstractmethod
    def _missing_bucket(self, key: str | None) -> StorageUnavailable:
        """The error for a bucket that does not exist, saying how to create it."""

    def _not_found(self, key: str, doing: str) -> BackendError:
        """A 404 on an object: the object is missing, unless the whole bucket is."""
        if not self._bucket_seen:
            exists = self._bucket_exists(key)
            if exists is False:
                return self._missing_bucket(key)
            self._bucket_seen = exists is True  # cannot tell: do not cache
        return ObjectNotFound(
            f"no object {key!r} in {self.url} ({doing}); it was never written or has been deleted",
            url=self.url,
            key=key,
        )
