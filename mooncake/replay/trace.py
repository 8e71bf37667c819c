"""Reading FAST'25 request traces (JSONL), one validated request at a time.

A trace line is one JSON object with ``timestamp`` (arrival, ms since the trace start),
``input_length`` and ``output_length`` (tokens) and ``hash_ids`` (one id per ``block_tokens``-token
block of the prompt; equal ids mean reusable prefix KV). Other keys are ignored.

:func:`iter_trace` checks every line and either raises :class:`~mooncake.errors.TraceFormatError`
naming the line and what is wrong, or (``skip_bad=True``) skips it and counts it in
:class:`TraceStats`. A line is bad when it is not a JSON object, misses a field, has a field of the
wrong type, a negative length or timestamp, a timestamp earlier than the previous good line (the
replay runs on a virtual clock that never goes back), ``len(hash_ids) != ceil(input_length /
block_tokens)``, a repeated id inside one request, or an id whose parent (the id before it) differs
from the parent it had on an earlier line (the ids must form one prefix tree; otherwise "longest
cached prefix" means nothing). Blank lines are ignored.

Pure: the caller owns the file; :func:`iter_trace` takes an iterable of lines (``bytes`` or
``str``), so progress reporting and decompression stay outside.
"""

from __future__ import annotations

import gzip
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import IO

import msgspec

from mooncake.errors import InvalidArgumentError, TraceFormatError

#: Tokens per KV block in the FAST'25 traces.
BLOCK_TOKENS = 512


class _Line(msgspec.Struct):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


_decoder = msgspec.json.Decoder(_Line)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One good trace line. ``index`` counts good requests from 0; ``line_no`` is 1-based."""

    index: int
    line_no: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def time_s(self) -> float:
        """Arrival on the virtual clock, in seconds."""
        return self.timestamp_ms / 1000.0


@dataclass(slots=True)
class TraceStats:
    """What :func:`iter_trace` saw: good requests, skipped lines and the first few reasons."""

    requests: int = 0
    skipped: int = 0
    blank: int = 0
    skip_reasons: list[tuple[int, str]] = field(default_factory=list)

    #: How many skip reasons are kept (all skips are counted).
    MAX_REASONS = 20

    def note_skip(self, line_no: int, reason: str) -> None:
        self.skipped += 1
        if len(self.skip_reasons) < self.MAX_REASONS:
            self.skip_reasons.append((line_no, reason))


def _check(
    line: _Line, block_tokens: int, last_ts: float, parents: dict[int, int | None]
) -> str | None:
    """Return why ``line`` is bad, or None. Does not touch ``parents`` (see :func:`_commit`)."""
    ts = line.timestamp
    if not math.isfinite(ts) or ts < 0:
        return f"timestamp must be a finite number >= 0, got {ts!r}"
    if line.input_length < 0:
        return f"input_length must be >= 0, got {line.input_length}"
    if line.output_length < 0:
        return f"output_length must be >= 0, got {line.output_length}"
    want = -(-line.input_length // block_tokens)
    ids = line.hash_ids
    if len(ids) != want:
        return (
            f"hash_ids has {len(ids)} ids but input_length {line.input_length} needs "
            f"ceil({line.input_length}/{block_tokens}) = {want}"
        )
    if len(set(ids)) != len(ids):
        return "hash_ids repeats an id within one request"
    if ts < last_ts:
        return f"timestamp {ts:g} ms is earlier than the previous request's {last_ts:g} ms"
    parent: int | None = None
    for pos, key in enumerate(ids):
        seen = parents.get(key, parent)
        if seen != parent:
            return (
                f"hash_ids[{pos}] = {key} follows {parent!r} here but followed {seen!r} on an "
                "earlier line (ids must form one prefix tree)"
            )
        parent = key
    return None


def iter_trace(
    lines: Iterable[bytes | str],
    *,
    source: str = "<trace>",
    block_tokens: int = BLOCK_TOKENS,
    skip_bad: bool = False,
    stats: TraceStats | None = None,
) -> Iterator[TraceRequest]:
    """Yield the good requests of ``lines`` in order, validating each (see the module doc).

    Raises :class:`TraceFormatError` (``source:line: reason``) at the first bad line unless
    ``skip_bad``; then bad lines are counted in ``stats`` and the good ones keep their 1-based
    ``line_no``. A skipped line leaves no trace in the prefix-tree and clock checks.
    """
    if block_tokens <= 0:
        raise InvalidArgumentError(f"block_tokens must be > 0, got {block_tokens}")
    st = stats if stats is not None else TraceStats()
    parents: dict[int, int | None] = {}
    last_ts = 0.0
    index = 0
    for line_no, raw in enumerate(lines, 1):
        if not raw.strip():
            st.blank += 1
            continue
        reason: str | None
        try:
            line = _decoder.decode(raw)
        except msgspec.ValidationError as exc:
            reason = str(exc)
        except msgspec.DecodeError as exc:
            reason = f"not a JSON object: {exc}"
        else:
            reason = _check(line, block_tokens, last_ts, parents)
        if reason is not None:
            if not skip_bad:
                raise TraceFormatError(source, line_no, reason)
            st.note_skip(line_no, reason)
            continue
        ids = tuple(line.hash_ids)
        parent: int | None = None
        for key in ids:
            parents.setdefault(key, parent)
            parent = key
        last_ts = line.timestamp
        st.requests += 1
        yield TraceRequest(
            index, line_no, line.timestamp, line.input_length, line.output_length, ids
        )
        index += 1


def open_trace(path: str) -> IO[bytes]:
    """Open a trace file for reading bytes; a ``.gz`` name is read through gzip."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]  # GzipFile is a binary IO
    return open(path, "rb")


def load_trace(
    path: str,
    *,
    block_tokens: int = BLOCK_TOKENS,
    skip_bad: bool = False,
    stats: TraceStats | None = None,
) -> list[TraceRequest]:
    """Read a whole trace file (``.gz`` too) into a list (tests and small traces; the CLI
    streams)."""
    with open_trace(path) as f:
        return list(
            iter_trace(f, source=path, block_tokens=block_tokens, skip_bad=skip_bad, stats=stats)
        )
