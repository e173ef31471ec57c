"""Path globs are matched in time linear-ish in path length x glob size (issue 9: a finding is a class).

Found by attacking the gateway: globs compiled to backtracking regexes cost O(n^k) for k wildcards, so a
2,000-character request path took ~9 s against `/**/a/**/a/**/a/b` and a 16 kB path ~1.6 s against
`/**/a/**/b`, blocking the event loop for every sandbox. The request path is the sandbox's to choose.

Two kinds of test:
* differential: the segment-wise matcher (policy.pathmatch) accepts exactly what the old regexes
  (kept below verbatim as the oracle; fine on short inputs) accepted, for allow globs and for both
  patterns of a deny glob (canonical, and server reading with decoded/folded literal text);
* adversarial timing through the public engine (`decide`, allow and deny rules): 16 kB paths against
  globs with 1-5 `**` and many `*` finish within a bound the old code misses by orders of magnitude.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable
from urllib.parse import unquote

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from egressgate.policy.canon import CanonError, canon_path
from egressgate.policy.decide import decide
from egressgate.policy.facts import SandboxState
from egressgate.policy.globs import GlobError, deny_glob, parse_path_glob
from egressgate.policy.loader import parse_policy
from egressgate.policy.readings import AmbiguousPath, fold_separators, server_readings
from egressgate.policy.reasons import Effect, Reason
from egressgate.policy.target import parse_target

# --- the oracle: the regexes globs.py compiled before (verbatim) -------------------------------------

_NO_ENCODED_SEP = r"(?!%2F|%5C)"
_SEGMENT_CHARS = rf"(?:{_NO_ENCODED_SEP}[^/])*"
_ANY_CHARS = rf"(?:{_NO_ENCODED_SEP}.)*"


def _old_allow_regex(segments: list[str]) -> str:
    out = ""
    for segment in segments:
        if segment == "**":
            out += f"(?:/{_ANY_CHARS})?"
            continue
        parts = [re.escape(p) for p in segment.split("*")]
        out += "/" + _SEGMENT_CHARS.join(parts)
    return out


def _old_deny_regex(segments: list[str], literal: Callable[[str], str]) -> str:
    out = ""
    for segment in segments:
        if segment == "**":
            out += "(?:/.*)?"
            continue
        out += "/" + "[^/]*".join(literal(p) for p in segment.split("*"))
    return out


def _old_decode_literal(text: str) -> str:
    return unquote(text, errors="surrogateescape") if "%" in text else text


# Each test compiles only the patterns it compares (a compile costs more than the comparisons it serves).
def _old_allow(raw_glob: str) -> re.Pattern[str]:
    return re.compile(_old_allow_regex(raw_glob.split("/")[1:]))


def _old_canonical(raw_glob: str) -> re.Pattern[str]:
    return re.compile(_old_deny_regex(raw_glob.split("/")[1:], re.escape), re.IGNORECASE | re.DOTALL)


def _old_reading(raw_glob: str) -> re.Pattern[str]:
    literal = lambda text: re.escape(fold_separators(_old_decode_literal(text)))  # noqa: E731
    return re.compile(_old_deny_regex(raw_glob.split("/")[1:], literal), re.DOTALL)


# --- differential tests ------------------------------------------------------------------------------

# Glob atoms: literals that collide with encoded separators ("2F", "%25" then "2F"), escapes that decode
# to '/', '\\', '*', '%' or fold (fullwidth solidus, 'A'), and wildcards. '**' is appended as a whole
# segment. Non-canonical combinations are refused by parse_path_glob and skipped.
_GLOB_ATOMS = ["a", "b", "A", "*", "2F", "%2F", "%5C", "%25", "%2A", "%EF%BC%8F", "a%2Fb", ";", "."]
# Path atoms: the same collisions, lower-case escapes (not canonical, but the oracle still answers),
# a newline ('.' in the old allow regex excluded it), and empty segments.
_PATH_ATOMS = ["a", "b", "A", "B", "2F", "%", "%2", "%2F", "%2f", "%5C", "%25", "F", "*", "\n", ";", "."]
_READING_CHARS = "ab/*%2F\\;\n"


def _random_readings(rnd: random.Random) -> list[str]:
    return ["".join(_random_list(rnd, list(_READING_CHARS), 14)) for _ in range(rnd.randint(1, 6))]


def _glob_strategy() -> st.SearchStrategy[str]:
    segment = st.one_of(
        st.just("**"),
        st.lists(st.sampled_from(_GLOB_ATOMS), min_size=0, max_size=4).map("".join),
    )
    return st.lists(segment, min_size=1, max_size=6).map(lambda segs: "/" + "/".join(segs))


def _path_strategy() -> st.SearchStrategy[str]:
    segment = st.lists(st.sampled_from(_PATH_ATOMS), max_size=4).map("".join)
    return st.lists(segment, min_size=0, max_size=7).map(lambda segs: "/" + "/".join(segs))


# The subjects of the differential tests come from a seed Hypothesis draws (one choice), expanded by
# random.Random into the same shapes _path_strategy and friends describe (same atoms, same size bounds, a
# size drawn uniformly): Hypothesis spent ~85 % of these tests' CPU drawing the ~100 choices of each list of
# paths one by one, the comparison itself ~15 %. The globs -- the structure under test -- stay Hypothesis's
# own draws; a failing example still prints its glob and its subjects.
def _seeded(build: Callable[[random.Random], list]) -> st.SearchStrategy[list]:
    return st.integers(min_value=0, max_value=2**64 - 1).map(lambda seed: build(random.Random(seed)))


def _random_list(rnd: random.Random, atoms: list[str], max_size: int) -> list[str]:
    return [rnd.choice(atoms) for _ in range(rnd.randint(0, max_size))]


def _random_path(rnd: random.Random) -> str:
    """A path as _path_strategy draws it: 0-7 segments of 0-4 _PATH_ATOMS."""
    return "/" + "/".join("".join(_random_list(rnd, _PATH_ATOMS, 4)) for _ in range(rnd.randint(0, 7)))


def _random_paths(rnd: random.Random) -> list[str]:
    return [_random_path(rnd) for _ in range(rnd.randint(1, 6))]


def _random_glob(rnd: random.Random) -> str:
    """A glob as _glob_strategy draws it: 1-6 segments, each '**' or 0-4 _GLOB_ATOMS; redrawn until
    parse_path_glob accepts it (~9 % are refused), so that every glob of a batch is compared."""
    while True:
        segments = [
            "**" if rnd.random() < 0.5 else "".join(_random_list(rnd, _GLOB_ATOMS, 4)) for _ in range(rnd.randint(1, 6))
        ]
        raw_glob = "/" + "/".join(segments)
        if _parse(raw_glob) is not None:
            return raw_glob


# Each example also compares a batch of BATCH seeded globs with their own subjects (the same shapes): the
# Hypothesis engine's own work per example (drawing, mutating, replaying) cost ~80 % of these tests' CPU, the
# comparisons ~20 %; a batch spreads that cost over BATCH + 1 globs. Hypothesis still draws a glob of its own
# in every example (its edge cases: empty and repeated segments, the shortest lists), and the @example cases
# run as before (with an empty batch).
BATCH = 6


def _batch(
    subjects: Callable[[random.Random], list], glob: Callable[[random.Random], object] = _random_glob
) -> Callable[[random.Random], list]:
    return lambda rnd: [(glob(rnd), subjects(rnd)) for _ in range(BATCH)]


def _parse(raw_glob: str):
    try:
        return parse_path_glob(raw_glob)
    except GlobError:
        return None


_DIFF = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])


@_DIFF
@given(_glob_strategy(), _seeded(_random_paths), _seeded(_batch(_random_paths)))
@example("/**/a/**/a/**/a/b", ["/a/a/a/b", "/a/a/b", "/x/a/y/a/z/a/b", "/a/a/a/b/"], [])
@example("/v1/**", ["/v1", "/v1/", "/v1/x%2Fy", "/v1/x/y", "/v1x", "/v1/a\nb"], [])
@example("/*2F", ["/%2F", "/x2F", "/2F"], [])
@example("/*a%2F*", ["/a%2Fa%2F", "/xa%2F", "/a%2Fx%2F", "/%2Fa%2F"], [])
@example("/**/**", ["", "/", "//", "/%2F"], [])
@example("/**/*b/**", ["/%2F/xb", "/a/xb", "/%2Fb/xb", "/x%2Fb"], [])  # '**' cannot skip an encoded separator
@example("/**/*/**/y", ["/a/\n/y", "/\n/y", "/a/b/y"], [])  # a star may take a newline, '**' may not
@example("/**/a/a/b/**/c", ["/a/a/a/b/c", "/a/%2F/a/a/b/c", "/a/a/a/a/b/x/c"], [])  # overlapping runs
def test_allow_and_canonical_deny_match_exactly_what_the_old_regexes_matched(raw_glob, paths, batch) -> None:
    cases = [(raw_glob, paths), *batch]  # the drawn glob first
    for raw_glob, paths in cases:
        glob = _parse(raw_glob)
        if glob is None:
            continue
        allow, canonical = _old_allow(raw_glob), _old_canonical(raw_glob)
        deny = deny_glob(glob)
        for path in paths:
            assert glob.matches(path) == (allow.fullmatch(path) is not None), (raw_glob, path, "allow")
            assert deny.canonical.matches(path) == (canonical.fullmatch(path) is not None), (raw_glob, path)


_DENSE_GLOB_SEGMENTS = ["**", "**", "a", "b", "*", "a*", "*a", "*a*", "%2F", "*%2F*", "a%2Fb"]
_DENSE_PATH_SEGMENTS = ["a", "a", "b", "", "ab", "ba", "aa", "%2F", "a%2F", "a%2Fb", "\n"]


def _dense_paths(rnd: random.Random) -> list[list[str]]:
    return [_random_list(rnd, _DENSE_PATH_SEGMENTS, 7) for _ in range(rnd.randint(1, 6))]


@_DIFF
@given(
    st.lists(st.sampled_from(_DENSE_GLOB_SEGMENTS), min_size=1, max_size=6),
    _seeded(_dense_paths),
    _seeded(_batch(_dense_paths, lambda rnd: [rnd.choice(_DENSE_GLOB_SEGMENTS) for _ in range(rnd.randint(1, 6))])),
)
@example(["**", "a*", "**"], [["a"], ["a", "b"], ["ba"]], [])
@example(["**", "a", "a", "**", "a", "**"], [["a", "a"], ["a", "a", "a"]], [])
@example(["**", "a", "%2F", "**"], [["a", "%2F"], ["b", "a", "%2F"]], [])
def test_dense_globs_of_stars_and_globstars_match_as_before(glob_segments, paths, batch) -> None:
    """Few symbols, many of them wildcards: every way runs between '**' can overlap, repeat or skip
    a segment holding an encoded separator is tried."""
    cases = [(glob_segments, paths), *batch]  # the drawn glob first
    for glob_segments, paths in cases:
        raw_glob = "/" + "/".join(glob_segments)
        glob = _parse(raw_glob)
        if glob is None:
            continue
        allow, canonical, reading = _old_allow(raw_glob), _old_canonical(raw_glob), _old_reading(raw_glob)
        deny = deny_glob(glob)
        for segments in paths:
            path = "/" + "/".join(segments)
            assert glob.matches(path) == (allow.fullmatch(path) is not None), (raw_glob, path, "allow")
            assert deny.canonical.matches(path) == (canonical.fullmatch(path) is not None), (raw_glob, path)
            assert deny.reading.matches(path) == (reading.fullmatch(path) is not None), (raw_glob, path)


@_DIFF
@given(
    _glob_strategy(),
    _seeded(_random_readings),
    _seeded(_batch(_random_readings)),
)
@example("/a%2Fb/*", ["/a/b/x", "/a/b", "/a%2Fb/x"], [])
@example("/%2Fa/**", ["//a", "/a", "//a/x"], [])
@example("/%2A*/**", ["/*", "/*x/y", "/x"], [])
@example("/**", ["", "/", "x"], [])
def test_reading_deny_pattern_matches_exactly_what_the_old_regex_matched(raw_glob, readings, batch) -> None:
    """Reading space: literal text decoded and folded, so a literal may hold '/' (more segments) or '*'
    (a literal star, not a wildcard); subjects are arbitrary strings, not only paths."""
    cases = [(raw_glob, readings), *batch]  # the drawn glob first
    for raw_glob, readings in cases:
        glob = _parse(raw_glob)
        if glob is None:
            continue
        reading = _old_reading(raw_glob)
        deny = deny_glob(glob)
        for text in readings:
            assert deny.reading.matches(text) == (reading.fullmatch(text) is not None), (raw_glob, text)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(_glob_strategy(), _path_strategy())
def test_server_readings_of_real_paths_match_as_before(raw_glob, raw_path) -> None:
    """The readings decide.py actually matches: those of a canonical path."""
    glob = _parse(raw_glob)
    if glob is None:
        return
    try:
        readings = server_readings(canon_path(raw_path))
    except (CanonError, AmbiguousPath):
        return
    reading = _old_reading(raw_glob)
    deny = deny_glob(glob)
    for text in readings:
        assert deny.reading.matches(text) == (reading.fullmatch(text) is not None), (raw_glob, text)


# --- adversarial timing ------------------------------------------------------------------------------

# Generous bound for one decision on a 16 kB path: the new matcher takes ~1-3 ms on a loaded 2-core box;
# the old regexes took from 0.7 s to hours on at least one hostile path for each of the first seven globs
# (> 3 s on most), so each of their test cases fails on the old code.
BOUND_S = 0.5

# Globs with 1-5 '**' and many '*' that almost match the hostile paths below: a backtracking regex tries
# every way to split the path between the wildcards before it gives up (O(n^k) for k wildcards).
HOSTILE_GLOBS = [
    "/**/*a*a*a*a*b",
    "/**/a/**/b",
    "/**/a/**/a/**/a/b",
    "/**/a/**/a/**/a/**/a/**/c",
    "/**/*a*a*a*a*b/**/a/**/*a*/**/*a*c",
    "/*a*a*a*a*a*a*a*a*b",
    "/a/*/**/*a*/**/*a*a*/**/a/**/*a*a*a*/b",
    # the new matcher's own worst cases (the old regexes happen to be quick on these): head and tail
    # match, so every segment of the middle is a candidate
    "/**/*c*/**/a",
    "/**/a/a/a/a/a/a/a/c/**/a",
]
_N = 16 * 1024
HOSTILE_PATHS = {
    "segments": "/" + "a/" * (_N // 2 - 1) + "a",  # plain: one server reading
    "one segment": "/" + "a" * _N,
    "upper case": "/" + "A/" * (_N // 2 - 1) + "A",  # not plain and > 2 kB: matched canonically
    "fat segments": "/" + "/".join(["aaaaaaaaaaaaaaa"] * (_N // 16)),
}


def _policy(effect: Effect, raw_glob: str):
    rule = f'{{id: r, host: h.example, paths: ["{raw_glob}"]}}'
    if effect is Effect.DENY:
        body = f"deny: [{rule}]\n    allow: [{{id: open, host: h.example}}]"
    else:
        body = f"allow: [{rule}]"
    return parse_policy(f"sandbox: {{name: t}}\nnetwork:\n  https:\n    {body}\n", "t.yaml")


STATE = SandboxState(sandbox_id="s", admitted_at=0.0)


@pytest.mark.parametrize("effect", [Effect.ALLOW, Effect.DENY], ids=["allow", "deny"])
@pytest.mark.parametrize("raw_glob", HOSTILE_GLOBS)
def test_a_hostile_16kb_path_is_decided_quickly(effect: Effect, raw_glob: str) -> None:
    policy = _policy(effect, raw_glob)
    for name, path in HOSTILE_PATHS.items():
        facts = parse_target(f"GET https://h.example{path}", ())
        start = time.perf_counter()
        decision = decide(policy, facts, STATE, 1.0)
        elapsed = time.perf_counter() - start
        assert elapsed < BOUND_S, (raw_glob, name, f"{elapsed:.3f} s")
        # control: the path genuinely nearly matches, and the rule decides (no blanket refusal)
        if effect is Effect.ALLOW:
            assert decision.reason is Reason.PATH_NOT_ALLOWED, (raw_glob, name, decision)
        elif name == "upper case":  # too long for readings: matched canonically, then refused as such
            assert decision.reason is Reason.PATH_AMBIGUOUS, (raw_glob, name, decision)
        else:
            assert decision.effect is Effect.ALLOW, (raw_glob, name, decision)


# For each hostile glob, a 16 kB path that matches it: the hostile bulk given the head and tail it asks for.
_BULK = "/a" * (_N // 2)
_MATCHING = {
    "/**/*a*a*a*a*b": _BULK + "/aaaab",
    "/**/a/**/b": _BULK + "/b",
    "/**/a/**/a/**/a/b": _BULK + "/b",
    "/**/a/**/a/**/a/**/a/**/c": _BULK + "/c",
    "/**/*a*a*a*a*b/**/a/**/*a*/**/*a*c": "/aaaab" + _BULK + "/ac",
    "/*a*a*a*a*a*a*a*a*b": "/" + "a" * _N + "b",
    "/a/*/**/*a*/**/*a*a*/**/a/**/*a*a*a*/b": "/a/x/a/aa" + _BULK + "/aaa/b",
    "/**/*c*/**/a": _BULK + "/c/a",
    "/**/a/a/a/a/a/a/a/c/**/a": _BULK + "/c/a",
}


@pytest.mark.parametrize("raw_glob", HOSTILE_GLOBS)
def test_the_same_globs_still_match_a_matching_hostile_path(raw_glob: str) -> None:
    """Positive control for the timing test: with the head and tail each glob asks for, the allow rule
    allows and the deny rule denies -- the quick answers above are answers, not early give-ups."""
    facts = parse_target(f"GET https://h.example{_MATCHING[raw_glob]}", ())
    for effect in (Effect.ALLOW, Effect.DENY):
        start = time.perf_counter()
        decision = decide(_policy(effect, raw_glob), facts, STATE, 1.0)
        assert time.perf_counter() - start < BOUND_S
        assert decision.effect is effect, (raw_glob, decision)


def test_deny_rules_on_every_reading_of_a_2kb_path_stay_bounded() -> None:
    """The deny side's multiplier: up to 64 server readings x every path glob of every deny rule. A
    2 kB path (the longest whose readings are computed) with many readings against five hostile deny
    rules is still one quick decision."""
    deny = ", ".join(f'{{id: d{i}, host: h.example, paths: ["{g}"]}}' for i, g in enumerate(HOSTILE_GLOBS[:5]))
    policy = parse_policy(
        f"sandbox: {{name: t}}\nnetwork:\n  https:\n    deny: [{deny}]\n    allow: [{{id: open, host: h.example}}]\n",
        "t.yaml",
    )
    path = "/A;x/a%2F" + "a/" * 1000 + "a./x.json/"
    readings = server_readings(canon_path(path))
    assert len(readings) >= 16
    facts = parse_target(f"GET https://h.example{path}", ())
    start = time.perf_counter()
    decision = decide(policy, facts, STATE, 1.0)
    assert time.perf_counter() - start < BOUND_S
    assert decision.effect is Effect.ALLOW, decision  # control: no rule matches any reading
