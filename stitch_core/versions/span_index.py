"""Where a board's squashed spans are: the span documents (the truth, found by listing the
board) and `spans.json`, the index derived from them for readers that cannot list
(docs/versions.md, "Squashed catch-up"). The squasher's retention and `stitch gc` delete spans
through `delete_spans`, which lists, so whatever a killed writer left is found."""

from __future__ import annotations

from collections.abc import Iterable

from stitch_core.failpoints import kill_point
from stitch_core.versions.board.base import Board, NotFoundError
from stitch_core.versions.manifest import (
    SPAN_INDEX,
    SpanIndex,
    is_span_key,
    span_doc_base,
    span_index_key,
    span_object,
    version_dir,
)


async def span_files(board: Board, run: str, version: int) -> list[str] | None:
    """The names of the span files (documents, objects, the index) in `version`'s directory,
    as the board lists them (the truth); None where the board cannot list."""
    vdir = version_dir(run, version)
    keys = await board.list_keys(vdir)
    if keys is None:
        return None
    names = (k[len(vdir) + 1:] for k in keys)
    return sorted(n for n in names if "/" not in n and is_span_key(n))


async def span_targets(board: Board, run: str) -> list[int] | None:
    """The versions of `run` that hold span files (any: a document, an object left without
    one, an index), from a listing of the board; None where the board cannot list."""
    keys = await board.list_keys(f"{run}/versions")
    if keys is None:
        return None
    out = set()
    for k in keys:
        parts = k.split("/")
        if len(parts) == 4 and parts[2].isdigit() and is_span_key(parts[3]):
            out.add(int(parts[2]))
    return sorted(out)


async def _index_bases(board: Board, run: str, version: int) -> list[int] | None:
    """The bases `spans.json` names (None: no index, or an unreadable one)."""
    try:
        raw = await board.get(span_index_key(run, version), 1 << 20)
    except NotFoundError:
        return None
    try:
        return SpanIndex.model_validate_json(raw).bases
    except ValueError:
        return None


async def span_bases(board: Board, run: str, version: int) -> list[int]:
    """The bases of the spans that end at `version`: their documents as the board lists them,
    or, on a board that cannot list (HTTP), the candidates `spans.json` names ([] without
    one). Candidates only: a reader still reads and checks each span (`read_span`)."""
    names = await span_files(board, run, version)
    if names is not None:
        return sorted(b for n in names if (b := span_doc_base(n)) is not None)
    return await _index_bases(board, run, version) or []


async def write_span_index(board: Board, run: str, version: int,
                           bases: Iterable[int] | None = None) -> list[int]:
    """Rewrite `spans.json` of `version` from its span documents (listed; `bases` on a board
    that cannot list), after them: the index is a derived hint. Not rewritten when it already
    says that, removed when there are no spans. A rewrite is a delete and a put (objects are
    create-only): a writer killed between the two leaves no index until the next rewrite, and
    nothing leaks, since retention lists the documents. Returns the bases written."""
    listed = await span_files(board, run, version)
    want = sorted(b for n in listed if (b := span_doc_base(n)) is not None) \
        if listed is not None else sorted(bases or [])
    have = await _index_bases(board, run, version)
    if have == want:
        return want
    key = span_index_key(run, version)
    if have is not None or (listed is not None and SPAN_INDEX in listed) or \
            await board.exists(key):
        await board.delete(key)
        kill_point("squash:after-index-delete")
    if want:
        await board.put(key, SpanIndex(run=run, version=version, bases=want)
                        .model_dump_json().encode())
    return want


async def delete_spans(board: Board, run: str, version: int,
                       bases: Iterable[int] | None = None) -> int:
    """Delete the spans ending at `version`: every span file the board lists there (documents
    first, then objects, then the index), so what a killed writer left is found too; on a
    board that cannot list, the spans `bases` or the index names. The number of keys deleted."""
    vdir = version_dir(run, version)
    names = await span_files(board, run, version)
    if names is None:
        bs = list(bases) if bases is not None else await _index_bases(board, run, version) or []
        names = [n for b in bs for n in (f"span-{b:06d}.json", span_object(b))] + [SPAN_INDEX]
    docs = [n for n in names if span_doc_base(n) is not None]
    order = docs + [n for n in names if n not in docs and n != SPAN_INDEX] + \
        [n for n in names if n == SPAN_INDEX]
    for n in order:
        await board.delete(f"{vdir}/{n}")
    return len(order)
