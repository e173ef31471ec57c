"""Issue 9 item 6: a deny rule's paths fail closed against every plausible server reading.

With `deny /admin/**`, `//admin/users`, `/admin;x/users`, `/Admin/users`, `/admin%2Fusers`, `/admin./users`
and `/admin%20/users` reached the upstream: the rule was matched on the canonical path only, while nginx
merges slashes, Tomcat strips `;params`, IIS folds case and drops trailing dots and spaces, and many
servers decode `%2F`. Each bypass string and its siblings is listed with its positive controls: the
canonical form of the same path IS denied, and an unrelated path on the same host IS allowed (so the
deny is the rule's doing, not a blanket refusal). Allow rules are never widened by the readings.
"""

from __future__ import annotations

import re
import textwrap
import time
import unicodedata
from urllib.parse import unquote

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from egressgate.policy.canon import CanonError
from egressgate.policy.decide import decide
from egressgate.policy.facts import SandboxState
from egressgate.policy.loader import parse_policy
from egressgate.policy.messages import AMBIGUOUS_PATH_HINTS as HINTS
from egressgate.policy.readings import MAX_READINGS, AmbiguousPath, server_readings
from egressgate.policy.reasons import Reason
from egressgate.policy.target import parse_target

POLICY = parse_policy(textwrap.dedent("""
    sandbox: {name: deny-paths}
    network:
      https:
        deny:
          - {id: no-admin, host: api.example.com, paths: ["/admin/**"]}
          - {id: no-raw, host: api.example.com, methods: [POST], paths: ["/repos/*/raw"]}
          - {id: no-internal, host: api.example.com, paths: ["/v1/Internal/*"]}
          - {id: no-cafe, host: api.example.com, paths: ["/caf%C3%A9/*/raw"]}
        allow:
          - {id: api, host: api.example.com}
          - {id: files, host: files.example.com, paths: ["/public/**"]}
"""), "deny-paths.yaml")
STATE = SandboxState("sbx", 0.0)


def decide_path(path: str, method: str = "GET", host: str = "api.example.com"):
    return decide(POLICY, parse_target(f"{method} https://{host}{path}", ()), STATE, 1.0)


# (bypass as sent, what it is) -- every one must be refused by `no-admin`.
ADMIN_BYPASSES = [
    # the strings
    ("//admin/users", "merged slashes (nginx merge_slashes)"),
    ("/admin;x/users", ";params stripped (Tomcat, Spring)"),
    ("/Admin/users", "case-folded (IIS, Windows)"),
    ("/admin%2Fusers", "decoded %2F"),
    ("/admin./users", "trailing dot dropped (Windows)"),
    ("/admin%20/users", "trailing space dropped (Windows)"),
    # siblings
    ("///admin/users", "three slashes"),
    ("/admin//users", "doubled inner slash"),
    ("/./admin/users", "dot segment"),
    ("/x/../admin/users", "parent segment"),
    ("/ADMIN", "upper case, bare prefix"),
    ("/aDmIn/users", "mixed case"),
    ("/admin;jsessionid=1", ";params on the bare prefix"),
    ("/admin;/users", "empty ;param"),
    ("/admin;x=1;y=2/users", "two ;params"),
    ("/%41dmin/users", "escaped unreserved letter (decoded by canon)"),
    ("/admin%2fusers", "lower-case %2f"),
    ("/admin%5Cusers", "decoded %5C as separator (IIS, some Java)"),
    ("/admin%5cusers", "lower-case %5c"),
    ("/admin%252Fusers", "double-encoded slash (decoded twice)"),
    ("/admin%255Cusers", "double-encoded backslash"),
    ("/%2561dmin/users", "double-encoded letter"),
    ("/admin%3B/users", "encoded ';' decoded before params are stripped"),
    ("/admin%3bx/users", "encoded ';x'"),
    ("/admin../users", "two trailing dots"),
    ("/admin.%20./users", "trailing dot-space-dot"),
    ("/admin%20%20/users", "two trailing spaces"),
    ("/Admin./users", "case and trailing dot"),
    ("/ADMIN;x/users", "case and ;params"),
    ("//Admin%2Fusers", "every trick at once"),
    ("/%EF%BD%81dmin/users", "fullwidth 'a' (NFKC)"),
    ("/%EF%BC%A1DMIN/users", "fullwidth 'A'"),
    ("/admin%EF%BC%8Fusers", "fullwidth solidus (NFKC '/')"),
    ("/admin%E2%88%95users", "division slash (best-fit '/')"),
    ("/admin%C2%A5users", "yen sign (cp932 best-fit '\\')"),
    ("/adm%C4%B1n/users", "dotless i (upper-cases to 'I')"),
    ("/adm%C3%ACn/users", "i with grave accent (best-fit 'i')"),
    ("/admin%3Fx", "decoded '?' re-read as the query"),
    ("/admin%23x", "decoded '#' re-read as a fragment"),
    ("/admin%C2%A0/users", "trailing no-break space (NFKC space, then dropped)"),
    ("/admin%E3%80%80/users", "trailing ideographic space"),
    ("/admin.json", "Spring suffix-pattern match"),
    ("/Admin.html", "suffix and case"),
    ("/admin::$DATA", "NTFS default stream (IIS)"),
    ("/admin::$data/users", "NTFS stream on a directory segment"),
    ("/ADM%C4%B0N/users", "capital I with dot above (lower-cases to i + combining dot)"),
    ("/%E2%84%AAadmin/../admin", "Kelvin sign segment, then traversal"),
    ("/%EF%BC%8561dmin/users", "fullwidth percent sign: NFKC '%61' then decoded 'a'"),
    ("/admin%E2%81%84users", "fraction slash"),
    ("/admin%EF%BC%BCusers", "fullwidth reverse solidus"),
]


@pytest.mark.parametrize(("path", "what"), ADMIN_BYPASSES, ids=[p for p, _ in ADMIN_BYPASSES])
def test_bypass_spellings_are_denied(path: str, what: str) -> None:
    decision = decide_path(path)
    assert (decision.reason, decision.rule_id) == (Reason.DENIED_BY_RULE, "no-admin"), (what, decision)


# Paths with a reading that cannot be modelled: refused (path_ambiguous) where a path deny rule applies.
AMBIGUOUS = [
    ("/adm%FFin/users", "invalid_utf8"),  # Latin-1? a code page? best-fit?
    ("/x%25FF", "invalid_utf8"),  # invalid once decoded twice
    ("/admin%2500/users", "control_char"),  # NUL once decoded twice: C servers truncate there
    ("/admin%09/users", "control_char"),
    ("/admin%0A", "control_char"),
    ("/x%7F", "control_char"),
    ("/ADMINI~1/users", "short_name"),  # Windows 8.3 short name of /administrator
    ("/x/SECRET~2.TXT", "short_name"),
]


@pytest.mark.parametrize(("path", "code"), AMBIGUOUS)
def test_unmodellable_paths_are_refused_on_hosts_with_path_deny_rules(path: str, code: str) -> None:
    decision = decide_path(path)
    assert (decision.reason, decision.detail, decision.rule_id) == (Reason.PATH_AMBIGUOUS, code, "no-admin")
    assert "no-admin" in decision.message and HINTS[code] in decision.message
    # positive control: a host without path deny rules is not affected by the refusal
    decision = decide_path(path.replace("admin", "public").replace("ADMIN", "PUBLIC"), host="files.example.com")
    assert decision.reason is not Reason.PATH_AMBIGUOUS


def test_ambiguity_applies_only_where_the_deny_rule_would_apply() -> None:
    # `no-raw` only covers POST: a GET with an unmodellable path passes no-raw, but no-admin applies.
    assert decide_path("/repos/x/raw%FF").reason is Reason.PATH_AMBIGUOUS
    post = parse_policy(textwrap.dedent("""
        sandbox: {name: post-only}
        network:
          https:
            deny: [{id: no-raw, host: api.example.com, methods: [POST], paths: ["/raw/**"]}]
            allow: [{id: api, host: api.example.com}]
    """), "post-only.yaml")
    facts = parse_target("GET https://api.example.com/raw%FF", ())
    assert decide(post, facts, STATE, 1.0).reason is Reason.RULE_MATCHED
    facts = parse_target("POST https://api.example.com/raw%FF", ())
    assert decide(post, facts, STATE, 1.0).reason is Reason.PATH_AMBIGUOUS


@pytest.mark.parametrize(
    "path", ["/admin", "/admin/", "/admin/users", "/admin/a/b/c"]
)
def test_positive_control_canonical_admin_paths_are_denied(path: str) -> None:
    decision = decide_path(path)
    assert (decision.reason, decision.rule_id) == (Reason.DENIED_BY_RULE, "no-admin")


@pytest.mark.parametrize(
    "path",
    [
        "/", "/users", "/administrator", "/admins/x", "/x/admin", "/v1/admin", "/public/admin%2Fx",
        "/Repos/Owner/Repo", "/search%20results", "/file.", "/a;b", "/caf%C3%A9", "/ad%C3%ADmin",
        "/compare/main...dev", "/v1/internal-docs/x", "/100%25", "/~user/x", "/x/v~beta", "/admins.json",
    ],
)
def test_positive_control_unrelated_paths_on_the_same_host_are_allowed(path: str) -> None:
    decision = decide_path(path)
    assert (decision.reason, decision.rule_id) == (Reason.RULE_MATCHED, "api"), decision


@pytest.mark.parametrize(
    ("method", "path", "rule"),
    [
        ("POST", "/repos/x/raw/", "no-raw"),  # Spring trailing-slash match
        ("POST", "/repos/x/raw.json", "no-raw"),  # Spring suffix-pattern match
        ("POST", "/repos/x/raw", "no-raw"),
        ("POST", "/repos/x%2Fy/raw", "no-raw"),  # '*' crosses an encoded slash a server keeps as data
        ("POST", "/repos/x/RAW", "no-raw"),
        ("POST", "/repos//x/raw", "no-raw"),
        ("POST", "/repos/x;v=1/raw;x", "no-raw"),
        ("GET", "/v1/internal/x", "no-internal"),  # rule text is folded too: /v1/Internal/*
        ("GET", "/V1/INTERNAL/x", "no-internal"),
        ("GET", "/v1/Internal/x%2Fy", "no-internal"),
        # only the reading that decodes everything but %2F, then folds, meets the rule: É -> é, x%2Fy one segment
        ("GET", "/caf%C3%89/x%2Fy/raw", "no-cafe"),
        ("GET", "/CAF%C3%A9/x/raw", "no-cafe"),
    ],
)
def test_wildcards_and_rule_case_fail_closed(method: str, path: str, rule: str) -> None:
    decision = decide_path(path, method)
    assert (decision.reason, decision.rule_id) == (Reason.DENIED_BY_RULE, rule), decision


def test_readings_of_a_mixed_path() -> None:
    readings = server_readings("/caf%C3%89/x%2Fy/raw")
    assert "/cafe/x%2fy/raw" in readings  # decoded but for the separator, folded (best-fit é -> e)
    assert "/cafe/x/y/raw" in readings  # everything decoded
    assert "/caf%C3%89/x%2Fy/raw" in readings  # the canonical path itself


def test_positive_control_other_methods_and_depths_still_allowed() -> None:
    assert decide_path("/caf%C3%A9/x/y/raw").reason is Reason.RULE_MATCHED
    assert decide_path("/repos/x/raw", "GET").reason is Reason.RULE_MATCHED
    assert decide_path("/repos/x/y/raw", "POST").reason is Reason.RULE_MATCHED
    assert decide_path("/v1/internal", "GET").reason is Reason.RULE_MATCHED


@pytest.mark.parametrize("path", ["//public/x", "/Public/x", "/public;x", "/PUBLIC/x", "/public%2Fx", "/public."])
def test_allow_rules_are_not_widened_by_readings(path: str) -> None:
    decision = decide_path(path, host="files.example.com")
    assert decision.reason is Reason.PATH_NOT_ALLOWED, decision
    assert decide_path("/public/x", host="files.example.com").reason is Reason.RULE_MATCHED  # control


@pytest.mark.parametrize(
    "path",
    ["/public/..%20/secret", "/public/.../secret", "/public/.%20./secret", "/public/%EF%BC%8E%EF%BC%8E/secret",
     "/public/%E2%80%A5/secret", "/public/..%C2%A5secret", "/public/..%EF%BC%8Fsecret"],
)
def test_allow_scoped_paths_cannot_be_left_through_windows_or_nfkc_dot_segments(path: str) -> None:
    """The sibling on the allow side: `/public/**` must not reach `/secret` on a Windows or NFKC-folding
    server. Canonicalization refuses these spellings outright (invalid_request at the gateway)."""
    with pytest.raises(CanonError):
        decide_path(path, host="files.example.com")
    assert decide_path("/public/..x/secret", host="files.example.com").reason is Reason.RULE_MATCHED  # control


@pytest.mark.parametrize(
    ("path", "code"),
    [
        ("/Ab;c/%25252525252525252541%20./x//y%3F%5C", "too_many_readings"),  # nested encodings
        ("/A%20" + "/b" * 1100, "too_long"),  # bounds the CPU one request can cost
    ],
)
def test_reading_explosion_is_refused(path: str, code: str) -> None:
    with pytest.raises(AmbiguousPath) as exc:
        server_readings(path)
    assert exc.value.code == code
    decision = decide_path(path)
    assert (decision.reason, decision.detail) == (Reason.PATH_AMBIGUOUS, code)
    # positive control: the same length in plain form has one reading and is allowed
    assert decide_path("/a" + "/b" * 1100).reason is Reason.RULE_MATCHED


def test_plain_paths_have_one_reading_and_stay_fast() -> None:
    assert server_readings("/repos/acme/widgets/issues") == frozenset({"/repos/acme/widgets/issues"})
    facts = parse_target("GET https://api.example.com/Repos/Acme/Widgets;v=1/Issues%20x", ())
    start = time.perf_counter()
    for _ in range(200):
        decide(POLICY, facts, STATE, 1.0)
    per_call = (time.perf_counter() - start) / 200
    assert per_call < 0.002, per_call  # generous: a shared 2-core machine; typically ~100 us


# ------------------------------------------------------------------------------- independent servers
# Simple, separately written models of how real servers map a request target to a resource. If ANY of
# them reads a path as inside /admin, the gateway must refuse it (deny, ambiguity or canon error).


def _resolve(path: str) -> str:
    out: list[str] = []
    for seg in path.split("/")[1:]:
        if seg == "..":
            if out:
                out.pop()
        elif seg != ".":
            out.append(seg)
    return "/" + "/".join(out)


def _nginx(raw: str) -> str:  # decode, merge slashes, resolve
    return _resolve(re.sub("/+", "/", unquote(raw)))


def _tomcat(raw: str) -> str:  # strip ;params per segment, then decode (not %2F), resolve
    stripped = re.sub(";[^/]*", "", raw)
    return _resolve(unquote(re.sub("%2[fF]", "\x00", stripped)).replace("\x00", "%2F"))


def _iis(raw: str) -> str:  # decode twice, backslash, NFKC + lower, drop trailing dots/spaces, resolve
    text = unquote(unquote(raw)).replace("\\", "/")
    text = unicodedata.normalize("NFKC", text).lower()
    segs = [s if s in (".", "..") else s.rstrip(". ") for s in text.split("/")]
    return _resolve(re.sub("/+", "/", "/".join(segs)))


def _truncating(raw: str) -> str:  # everything after the first ';' ignored, then decoded and resolved
    return _nginx(raw.split(";", 1)[0] or "/")


def _spring(raw: str) -> str:  # Tomcat's reading, then trailing-slash and suffix-pattern matching
    path = _tomcat(raw)
    path = path.rstrip("/") or "/"
    head, _, last = path.rpartition("/")
    return f"{head}/{last.split('.', 1)[0] if '.' in last[1:] else last}"


def _under_admin(reading: str) -> bool:
    return reading == "/admin" or reading.startswith("/admin/")


_ATOMS = ["/", "//", "admin", "Admin", "ADMIN", "users", ";x", ";", "%2F", "%2f", "%5C", "%252F", "%20",
          ".", "..", "%2e", "%3B", "%EF%BC%8F", "x", ".json", "%3F"]


@settings(max_examples=3000, deadline=None)
@given(st.lists(st.sampled_from(_ATOMS), min_size=1, max_size=8).map(lambda atoms: "/" + "".join(atoms)))
@example("//admin/users")
@example("/admin%2F..%2Fx")
@example("/x/..%20/admin")
@example("/admin%2Fadmin/..")  # found by this test: '..' resolved before a server decodes %2F
@example("/admin;x/../y")
@example("/admin.json")
def test_no_server_model_reads_an_allowed_path_as_admin(raw: str) -> None:
    try:
        decision = decide_path(raw)
    except CanonError:
        return  # refused as an invalid request before any rule
    if any(_under_admin(model(raw)) for model in (_nginx, _tomcat, _iis, _truncating, _spring)):
        assert decision.reason in (Reason.DENIED_BY_RULE, Reason.PATH_AMBIGUOUS), (raw, decision)


def test_max_readings_is_a_real_bound() -> None:
    assert 16 < MAX_READINGS <= 1024


_GLOB_ATOMS = ["a", "B", "*", "x%2Fy", "caf%C3%A9", ";v", "."]
_PATH_ATOMS = ["a", "A", "b", "B", "x%2Fy", "X%2fY", "caf%C3%A9", ";v", ".", "%20", "", "json"]


@settings(max_examples=500, deadline=None)
@given(
    st.lists(st.lists(st.sampled_from(_GLOB_ATOMS), min_size=1, max_size=3), min_size=1, max_size=3),
    st.booleans(),
    st.lists(st.lists(st.sampled_from(_PATH_ATOMS), max_size=3), min_size=1, max_size=4),
)
def test_a_deny_rule_refuses_everything_its_glob_matches(glob_segs, deep, path_segs) -> None:
    """Fail closed: whatever the allow-rule reading of a glob (canonical, strict wildcards) matches, the
    same glob in a deny rule refuses."""
    from egressgate.policy.canon import canon_path
    from egressgate.policy.globs import GlobError, parse_path_glob

    raw_glob = "/" + "/".join("".join(seg) for seg in glob_segs) + ("/**" if deep else "")
    try:
        glob = parse_path_glob(raw_glob)
    except GlobError:
        return
    try:
        path = canon_path("/" + "/".join("".join(seg) for seg in path_segs))
    except CanonError:
        return
    if not glob.matches(path):
        return
    policy = parse_policy(textwrap.dedent(f"""
        sandbox: {{name: prop}}
        network:
          https:
            deny: [{{id: d, host: h.example, paths: ["{raw_glob}"]}}]
            allow: [{{id: a, host: h.example}}]
    """), "prop.yaml")
    decision = decide(policy, parse_target(f"GET https://h.example{path}", ()), STATE, 1.0)
    assert decision.reason in (Reason.DENIED_BY_RULE, Reason.PATH_AMBIGUOUS), (raw_glob, path, decision)
