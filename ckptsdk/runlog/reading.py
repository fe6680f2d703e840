"""The run log read one attempt at a time, one row at a time: what the audit streams through.

An attempt's chunks are read in sequence order, each parsed line by line as it is consumed, so
memory holds one row per attempt and a few open chunk streams, never a chunk or an attempt.
The next chunks are opened ahead on a small thread pool (on GCS or Drive each open is a round
trip). Comparing attempts belongs to ``audit.py``; the line format to ``record.py``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import IO, Any

from ckptsdk.backends.base import Backend
from ckptsdk.errors import ManifestError, ObjectNotFound
from ckptsdk.runlog.record import (
    RUNLOG_PREFIX,
    AttemptRecord,
    StepRow,
    iter_chunk,
    parse_attempt_record,
    parse_runlog_key,
)

__all__ = ["AttemptLog", "OutOfOrder", "list_attempts", "short"]

_AHEAD = 4  # chunks of one attempt opened ahead of the one being parsed


@dataclass
class _Entry:
    start: str | None = None  # attempt.json
    chunks: dict[int, str] = field(default_factory=dict)  # seq -> key


def list_attempts(backend: Backend) -> dict[int, _Entry]:
    """attempt -> its ``attempt.json`` and chunk keys, from one listing of ``runlog/``."""
    found: dict[int, _Entry] = {}
    for info in backend.list(RUNLOG_PREFIX):
        parsed = parse_runlog_key(info.key)
        if parsed is None:
            continue
        entry = found.setdefault(parsed[0], _Entry())
        if parsed[1] is None:
            entry.start = info.key
        else:
            entry.chunks[parsed[1]] = info.key
    return found


class OutOfOrder(Exception):
    """An attempt logged a step lower than one it logged before (the audit then holds that
    attempt's rows in memory instead of streaming them)."""

    def __init__(self, attempt: int, step: int, after: int) -> None:
        super().__init__(f"attempt {attempt} logged step {step} after step {after}")
        self.attempt, self.step, self.after = attempt, step, after


class AttemptLog:
    """One attempt's rows in step order (a step logged twice in a row: the last one), and what
    was learnt on the way (header, closed, chunks read, first/last step, steps) for its summary.

    ``steps()`` raises :class:`OutOfOrder` when a step goes down; ``held=True`` reads the whole
    attempt into memory first and sorts it (last wins), for such an attempt.
    """

    def __init__(self, backend: Backend, attempt: int, entry: _Entry, pool: ThreadPoolExecutor) -> None:
        self.backend, self.attempt, self.entry, self.pool = backend, attempt, entry, pool
        self.warnings: list[str] = []
        self.newest: AttemptRecord | None = None
        self.closed = False
        self.read_chunks = 0
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.count = 0

    def _open(self, key: str) -> IO[bytes] | ObjectNotFound | ManifestError:
        try:
            return self.backend.open(key)
        except (ObjectNotFound, ManifestError) as exc:
            return exc

    def _rows(self) -> Iterator[StepRow]:
        """Every row in log order (chunk by chunk, line by line)."""
        keys = [self.entry.chunks[s] for s in sorted(self.entry.chunks)]
        ahead: deque[tuple[str, Future[Any]]] = deque()
        try:
            while keys or ahead:
                while keys and len(ahead) < _AHEAD:
                    key = keys.pop(0)
                    ahead.append((key, self.pool.submit(self._open, key)))
                key, opening = ahead.popleft()
                stream = opening.result()
                if isinstance(stream, ObjectNotFound):
                    self.warnings.append(f"attempt {self.attempt}: chunk {key} was listed but is gone")
                    continue
                if isinstance(stream, ManifestError):
                    self.warnings.append(f"attempt {self.attempt}: unreadable chunk {key} skipped ({short(stream)})")
                    continue
                with stream:
                    try:
                        for item in iter_chunk(stream, key=key):
                            if isinstance(item, AttemptRecord):
                                self.read_chunks += 1
                                self.newest = item
                                self.closed = self.closed or item.closed
                            elif isinstance(item, StepRow):
                                yield item
                            else:
                                self.warnings.append(f"attempt {self.attempt}: {item}")
                    except ManifestError as exc:  # raised before any row: the chunk is skipped
                        self.warnings.append(f"attempt {self.attempt}: unreadable chunk {key} skipped ({short(exc)})")
        finally:
            for _, opening in ahead:  # an abandoned read (OutOfOrder): close what was opened
                stream = opening.result()
                if not isinstance(stream, BaseException):
                    stream.close()

    def steps(self, *, held: bool = False) -> Generator[StepRow, None, None]:
        """The attempt's rows by increasing step, one per step (the last logged)."""
        if held:
            rows: dict[int, StepRow] = {}
            for row in self._rows():
                rows[row.step] = row
            ordered: Iterator[StepRow] = iter(rows[s] for s in sorted(rows))
        else:
            ordered = self._rows()
        pending: StepRow | None = None
        for row in ordered:
            if pending is not None and row.step < pending.step:
                raise OutOfOrder(self.attempt, row.step, pending.step)
            if pending is not None and row.step != pending.step:
                yield self._counted(pending)
            pending = row  # the same step again: the later row wins
        if pending is not None:
            yield self._counted(pending)

    def _counted(self, row: StepRow) -> StepRow:
        if self.first_step is None:
            self.first_step = row.step
        self.last_step = row.step
        self.count += 1
        return row

    def record(self) -> AttemptRecord | None:
        """The newest header read, else the attempt's ``attempt.json`` (None: neither readable)."""
        if self.newest is not None or self.entry.start is None:
            return self.newest
        try:
            return parse_attempt_record(self.backend.read(self.entry.start), key=self.entry.start)
        except (ObjectNotFound, ManifestError) as exc:
            self.warnings.append(f"attempt {self.attempt}: unreadable {self.entry.start} ({short(exc)})")
            return None


def short(exc: BaseException) -> str:
    """The first line of an error, at most 200 characters (for a warning)."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:200]
