"""Path-glob matching whose cost is bounded by path length x glob size, never exponential.

WHY not regexes: a glob compiled to a backtracking regex (``(?:/.*)?`` per ``**``, ``[^/]*`` per ``*``)
costs O(n^k) on a path of n characters against a glob with k wildcards that almost matches -- a 2 kB
request path took ~10 s against ``/**/a/**/a/**/a/b``, blocking the gateway's event loop for every
sandbox. The request path is chosen by the (untrusted) sandbox, so the matcher must be linear-ish.

How: the path is split on ``/`` and matched segment by segment.

* A segment glob (``*`` never crosses ``/``) is matched greedily left to right with ``str.find``:
  O(len(segment) x parts). Leftmost placement of each literal part is optimal because a star can absorb
  anything a later placement would have skipped -- see :func:`segment_matches` for the one restriction
  (allow globs: a star never consumes an encoded separator) and why greedy stays exact under it.
* ``**`` (any number of whole segments): the head before the first ``**`` and the tail after the last
  are anchored, and each run of segment globs between two ``**`` is placed at its leftmost position
  (see :func:`_place_run` for why that is exact), so O(segments x longest run) segment tests; the
  common globs (``/v1/**``, ``/a/*/b``) cost a few string operations.

The semantics (which paths a glob matches) are exactly those of the regexes they replace; the
differential test in tests/policy/test_glob_matcher.py checks that against the old regexes.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from itertools import accumulate

GLOBSTAR = None
"""A ``**`` element of a :class:`SegmentPattern` (zero or more whole segments)."""

Element = tuple[str, ...] | None
"""One path segment's glob as its literal parts between ``*`` (a literal segment has one part), or
:data:`GLOBSTAR`."""

_FLAT, _ONE_STAR, _TRAILING, _GENERAL = range(4)


class SegmentPattern:
    """A path glob as segment elements. ``guard``: wildcards must not consume an encoded separator
    (``%2F``/``%5C``, exactly as written in canonical paths) -- allow globs; deny globs widen instead.
    ``fold_case``: case is ignored, the path lower-cased like the (already lower-cased) elements; that is
    the old ``re.IGNORECASE`` exactly for ASCII, and canonical paths are ASCII (canon_path encodes the rest).

    The shape is classified once, so the globs policies mostly use cost a few string operations: no
    ``**`` (one pass over the segments) and literal segments under one trailing ``**`` (a prefix test)."""

    __slots__ = ("_base", "_flat", "_kind", "_prefix", "_suffix", "elements", "fold_case", "guard")

    def __init__(self, elements: tuple[Element, ...], *, guard: bool, fold_case: bool = False) -> None:
        self.elements = elements
        self.guard = guard
        self.fold_case = fold_case
        stars = [i for i, e in enumerate(elements) if e is GLOBSTAR]
        lead = elements[: stars[0]] if stars else elements
        literal_lead: list[tuple[str, ...]] = []
        for e in lead:
            if len(e) != 1:  # type: ignore[arg-type]
                break
            literal_lead.append(e)  # type: ignore[arg-type]
        # _FLAT: per path segment (after the leading ''), its literal text or its starred parts.
        self._flat: tuple[str | tuple[str, ...] | None, ...] = ()
        self._suffix = ""
        starred = [e for e in elements if e is not GLOBSTAR and len(e) > 1]
        if not stars and len(starred) == 1 and len(starred[0]) == 2:  # type: ignore[arg-type]
            self._kind = _ONE_STAR  # e.g. /v1/*/items: prefix, one segment's worth of text, suffix
            k = len(literal_lead)
            self._suffix = starred[0][1] + "".join("/" + e[0] for e in elements[k + 1 :])  # type: ignore[index]
        elif not stars:
            self._kind = _FLAT
            self._flat = (None, *(e[0] if len(e) == 1 else e for e in elements))  # type: ignore[arg-type,index]
        elif len(literal_lead) == len(lead) and all(e is GLOBSTAR for e in elements[stars[0] :]):
            self._kind = _TRAILING
        else:
            self._kind = _GENERAL
        # Text every match starts with: the literal segments before the first wildcard, and the first
        # literal part of a starred segment. Checked first, it turns most misses into one startswith.
        self._base = "".join("/" + e[0] for e in literal_lead)
        prefix = self._base
        if len(literal_lead) < len(lead):
            prefix += "/" + lead[len(literal_lead)][0]  # type: ignore[index]
        self._prefix = prefix

    def __repr__(self) -> str:
        return f"SegmentPattern({self.elements!r}, guard={self.guard}, fold_case={self.fold_case})"

    def matches(self, path: str) -> bool:
        if self.fold_case:
            path = path.lower()
        if not path.startswith(self._prefix):
            return False
        kind = self._kind
        if kind == _ONE_STAR:
            start, end = len(self._prefix), len(path) - len(self._suffix)
            return (
                start <= end
                and path.endswith(self._suffix)
                and path.find("/", start, end) < 0
                and not (self.guard and _has_encoded_separator(path, start, end))
            )
        if kind == _TRAILING:  # e.g. /v1/**: the bare prefix, or the prefix, '/' and anything
            n = len(self._base)
            if len(path) == n:
                return True
            return path[n] == "/" and (not self.guard or _globstar_may_take_rest(path, n + 1))
        if not path.startswith("/"):
            # every pattern starts with '/', or with '**' which matches '' or '/...'
            return path == "" and all(e is GLOBSTAR for e in self.elements)
        segments = path.split("/")
        if kind == _FLAT:
            if len(segments) != len(self._flat):
                return False
            guard = self.guard
            for segment, e in zip(segments, self._flat, strict=False):  # segments[0] is '' against None
                if e is None:
                    continue
                if type(e) is str:
                    if segment != e:
                        return False
                elif not segment_matches(e, segment, guard):
                    return False
            return True
        del segments[0]
        return match_segments(self.elements, segments, self.guard)


def _globstar_may_take_rest(path: str, start: int) -> bool:
    """:func:`globstar_may_take` for all of ``path[start:]`` (every segment of it), without copying."""
    return path.find("%2F", start) < 0 and path.find("%5C", start) < 0 and path.find("\n", start) < 0


def _has_encoded_separator(text: str, start: int, end: int) -> bool:
    """Does an encoded separator START at a position in [start, end) of ``text``? (It may run past end.)"""
    return text.find("%2F", start, end + 2) >= 0 or text.find("%5C", start, end + 2) >= 0


def globstar_may_take(segment: str, guard: bool) -> bool:
    """Can ``**`` consume this whole segment? With ``guard``, not one holding ``%2F``/``%5C`` -- nor a
    newline, which the old regexes' ``.`` never matched (canonical paths never contain one)."""
    return not guard or ("%2F" not in segment and "%5C" not in segment and "\n" not in segment)


def segment_matches(parts: tuple[str, ...], segment: str, guard: bool) -> bool:
    """Does ``segment`` (no ``/``) match ``parts[0] * parts[1] * ... * parts[-1]``?

    Greedy: the first part is a prefix, the last a suffix, each middle part at its leftmost occurrence
    after the previous one -- classic and exact when a star takes any text. With ``guard`` a star must
    not take the first character of a ``%2F``/``%5C``; greedy stays exact given canonical rule text (a
    literal ``%`` always has its two hex digits in the same part). Suppose a solution puts a part at
    s' and greedy at s < s'. The solution's star before s' takes [s, s'), so that span holds no
    separator start. Greedy's part then ends d = s' - s earlier, leaving the next star the extra span
    [s + len, s' + len), covered in the solution by the same part; a separator starting there sits at
    some offset o of the part, and then (the part's two copies agree; overlapping copies make it
    d-periodic) also at offset o mod d -- that is, in the text at s + (o mod d), inside [s, s'). So the
    extra span is clean, greedy's remaining problem is no harder, and by induction greedy finds a match
    whenever one exists. The differential test checks this against the old regexes."""
    first, last = parts[0], parts[-1]
    pos, end = len(first), len(segment) - len(last)
    if end < pos or not segment.startswith(first) or not segment.endswith(last):
        return False
    guard = guard and "%" in segment
    for part in parts[1:-1] if len(parts) > 2 else ():
        at = segment.find(part, pos, end)
        if at < 0 or (guard and _has_encoded_separator(segment, pos, at)):
            return False
        pos = at + len(part)
    return not (guard and _has_encoded_separator(segment, pos, end))


def _element_matches(element: tuple[str, ...], segment: str, guard: bool) -> bool:
    return segment == element[0] if len(element) == 1 else segment_matches(element, segment, guard)


def _run_matches(run: Sequence[tuple[str, ...]], segments: Sequence[str], at: int, guard: bool) -> bool:
    return all(_element_matches(element, segments[at + i], guard) for i, element in enumerate(run))


def match_segments(elements: Sequence[Element], segments: list[str], guard: bool) -> bool:
    """Do the path's ``segments`` match the glob ``elements``?

    The literal head (before the first ``**``) and tail (after the last) are anchored; the runs of
    elements between ``**`` are then placed greedily, each at its leftmost position after the previous
    one, the skipped segments going to the ``**`` between them. Cost: O(segments x longest run)
    element tests -- O(segments) for the usual one-segment runs (``/**/a/**/b/**``)."""
    runs: list[list[tuple[str, ...]]] = [[]]
    for e in elements:
        if e is GLOBSTAR:
            runs.append([])
        else:
            runs[-1].append(e)
    if len(runs) == 1:
        return len(segments) == len(runs[0]) and _run_matches(runs[0], segments, 0, guard)
    head, tail, middle_runs = runs[0], runs[-1], [r for r in runs[1:-1] if r]
    n = len(segments)
    if n < len(head) + len(tail) or not _run_matches(head, segments, 0, guard):
        return False
    if not _run_matches(tail, segments, n - len(tail), guard):
        return False
    middle = segments[len(head) : n - len(tail)]
    if guard and any("\n" in s for s in middle):
        return _match_middle_dp(middle_runs, middle, guard)
    if not middle_runs:
        return all(globstar_may_take(s, guard) for s in middle)
    # The middle joined, so runs are found with str.find; starts[j]: offset of the '/' before middle[j].
    joined = "/" + "/".join(middle) + "/"
    starts = list(accumulate((len(s) + 1 for s in middle), initial=0))
    pos = 0
    for run in middle_runs:
        if len(run) > 1 and all(len(e) == 1 for e in run):
            pos = _place_literal_run(run, joined, starts, pos, guard)
        else:
            pos = _place_run(run, middle, joined, starts, pos, guard)
        if pos < 0:
            return False
    return all(globstar_may_take(s, guard) for s in middle[pos:])


def _place_literal_run(run: list[tuple[str, ...]], joined: str, starts: list[int], start: int, guard: bool) -> int:
    """:func:`_place_run` for a run of literal segments: one ``str.find`` of ``/a/b/c/`` in the joined
    middle, so O(path length) whatever the run's length."""
    found = joined.find("/" + "/".join(e[0] for e in run) + "/", starts[start])
    if found < 0:
        return -1
    if guard and (joined.find("%2F", starts[start], found) >= 0 or joined.find("%5C", starts[start], found) >= 0):
        return -1  # '**' would have to take a segment holding an encoded separator
    return bisect_left(starts, found) + len(run)


def _place_run(
    run: list[tuple[str, ...]], middle: list[str], joined: str, starts: list[int], start: int, guard: bool
) -> int:
    """End of ``run`` placed at its leftmost position >= start such that ``**`` may take every segment
    skipped on the way; -1 when there is none.

    Leftmost is exact, because an element matches only segments ``**`` may take or only segments it may
    not (deny globs: ``**`` takes anything; allow globs: an encoded separator is in the segment iff it
    is in the element's literal text, and the newline case -- which a star may take but ``**`` not --
    goes to the DP). If a solution places the run at p' > p (greedy), greedy hands the next ``**``
    the extra segments [p + k, p' + k): those before p' the solution's ``**`` took; each one at or after
    p' the solution matched with some element E_i, and E_i (or E_{i-d}, E_{i-2d}... with d = p' - p,
    matching the same segments where the two placements overlap) matched a segment before p' in
    greedy's placement -- one ``**`` may take, so E_i only matches such segments."""
    last = len(middle) - len(run)
    head = run[0]
    # Jump to candidates: the segment equal to a literal first element, or holding the longest literal
    # part of a starred one (every segment it matches contains that part).
    key = head[0] if len(head) == 1 else max(head, key=len)
    at = start
    while at <= last:
        if len(head) == 1:
            try:
                found = middle.index(key, at, last + 1)
            except ValueError:
                return -1
        elif key:
            offset = joined.find(key, starts[at] + 1)
            found = bisect_right(starts, offset) - 1
            if offset < 0 or found > last:
                return -1
        else:
            found = at
        if guard and not all(globstar_may_take(s, guard) for s in middle[at:found]):
            return -1
        at = found
        if _run_matches(run, middle, at, guard):
            return at + len(run)
        if not globstar_may_take(middle[at], guard):
            return -1
        at += 1
    return -1


def _match_middle_dp(runs: list[list[tuple[str, ...]]], middle: list[str], guard: bool) -> bool:
    """Exact fallback for a newline in an allow-side path (canonical paths never have one): a star may
    take it but ``**`` may not, which breaks greedy's premise. reach[j]: the runs so far can end after
    middle[:j]. O(segments x elements)."""
    m = len(middle)
    ok = [globstar_may_take(s, guard) for s in middle]
    reach = _globstar([True] + [False] * m, ok)
    for run in runs:
        for element in run:
            nxt = [False] * (m + 1)
            for j in range(m):
                if reach[j] and _element_matches(element, middle[j], guard):
                    nxt[j + 1] = True
            reach = nxt
        reach = _globstar(reach, ok)
    return reach[m]


def _globstar(reach: list[bool], ok: list[bool]) -> list[bool]:
    """Extend every reachable position over following segments that ``**`` may take (one pass)."""
    out = reach[:]
    for j, take in enumerate(ok):
        if out[j] and take:
            out[j + 1] = True
    return out
