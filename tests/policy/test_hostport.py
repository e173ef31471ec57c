"""Table tests for `host:port` parsing (policy/canon.py's `split_host_port`, which the gateway uses for
CONNECT targets, absolute-form authorities, Host headers and transparent SNI/Host checks).

Modelled on smokescreen's `hostport` table, row for row where the inputs overlap; the rows marked
"differs" are deliberate: smokescreen accepts them, egressgate refuses them because some parser
between the sandbox and the upstream could read them another way (a zero-padded port read as octal,
a bracketed name, emoji mapped by one IDNA implementation and refused by another). Every accepted
row must also survive `join_host_port` -> `split_host_port` unchanged (canonical output is a fixed
point), so the audit record's text names exactly what was dialed.
"""

from __future__ import annotations

import pytest
from mitmproxy.net.http.http1 import read_request_head

from egressgate.gateway.shared.target import as_sent
from egressgate.policy.canon import CanonError, join_host_port, split_host_port

ACCEPTED: list[tuple[str, int | None, tuple[str, int]]] = [
    # smokescreen rows
    ("127.0.0.1:1234", None, ("127.0.0.1", 1234)),
    ("example.net:1337", None, ("example.net", 1337)),
    ("example.net.:1337", None, ("example.net", 1337)),  # one trailing dot is the same name
    ("[2001:DB8::1337]:1337", None, ("2001:db8::1337", 1337)),
    # defaults: no port means the scheme's port, given by the caller
    ("example.net", 443, ("example.net", 443)),
    ("[::1]", 443, ("::1", 443)),
    # case, spelling and encodings that denote one host
    ("EXAMPLE.Net:80", None, ("example.net", 80)),
    ("[2001:db8:0:0:0:0:0:1]:443", None, ("2001:db8::1", 443)),
    ("[::ffff:7f00:1]:80", None, ("::ffff:127.0.0.1", 80)),
    ("2130706433:80", None, ("127.0.0.1", 80)),
    ("0177.0.0.1:80", None, ("127.0.0.1", 80)),
    ("127.1:80", None, ("127.0.0.1", 80)),
    ("0x7f000001:80", None, ("127.0.0.1", 80)),
    ("b\u00fccher.example:443", None, ("xn--bcher-kva.example", 443)),
    ("\uff45\uff58\uff41\uff4d\uff50\uff4c\uff45.com:443", None, ("example.com", 443)),  # full-width letters
    ("example\u3002com:443", None, ("example.com", 443)),  # ideographic full stop separates labels
    ("_dmarc.example.com:443", None, ("_dmarc.example.com", 443)),
    ("r3---sn-x.googlevideo.com:443", None, ("r3---sn-x.googlevideo.com", 443)),
    ("example.com:1", None, ("example.com", 1)),
    ("example.com:65535", None, ("example.com", 65535)),
]

REFUSED: list[tuple[str, str]] = [
    # smokescreen rows
    ("example.net", "missing_port"),
    ("", "empty_host"),
    (":", "empty_host"),
    ("::", "unbracketed_ipv6"),
    ("2001:DB8::1337", "unbracketed_ipv6"),
    ("[[example.net]]:1337", "bad_authority"),
    ("[2001:DB8::1337]:91337", "port_out_of_range"),
    ("[2001:DB8::1337]:-12", "bad_port"),
    ("[2001:DB8::1337]:https", "bad_port"),
    ("[2001:DB8::1337]:007", "port_leading_zero"),  # differs: smokescreen reads 7; some parsers read octal
    ("[example.net]:1337", "bad_ipv6"),  # differs: brackets are for IPv6 literals only
    ("[127.0.0.1]:1337", "bad_ipv6"),  # differs: likewise
    ("\U0001f510.example.com:123", "idna"),  # differs: IDNA2008 disallows emoji (no guessing a mapping)
    # ports
    ("example.com:0", "port_out_of_range"),
    ("example.com:", "empty_port"),
    ("[::1]:", "empty_port"),
    ("example.com:+443", "bad_port"),
    ("example.com:\uff14\uff14\uff13", "bad_port"),  # full-width digits are not a port
    ("example.com:443/", "bad_port"),
    ("example.com:443:443", "unbracketed_ipv6"),
    # hosts
    ("user@example.com:443", "userinfo"),
    ("example.com@evil.example:443", "userinfo"),
    ("example.com%2e:443", "percent_encoded"),
    ("example..com:443", "empty_label"),
    ("example.com..:443", "empty_label"),
    ("a" * 64 + ".com:443", "label_too_long"),
    (".".join(["a" * 63] * 4) + ":443", "name_too_long"),
    ("exa mple.com:443", "whitespace"),
    ("example.com :443", "whitespace"),
    ("example.com\x00:443", "control_char"),
    ("example.com/x:443", "bad_char"),
    ("1.2.3.4.5:80", "bad_ipv4"),
    ("foo.123:80", "bad_ipv4"),
    ("1.2.3.999:80", "bad_ipv4"),
    ("[fe80::1%25eth0]:443", "zone_id"),
    ("[::1]x:443", "bad_authority"),
]


@pytest.mark.parametrize(("authority", "default", "expected"), ACCEPTED, ids=[r[0] for r in ACCEPTED])
def test_accepted(authority: str, default: int | None, expected: tuple[str, int]) -> None:
    assert split_host_port(authority, default) == expected
    host, port = expected
    assert split_host_port(join_host_port(host, port)) == expected  # canonical text is a fixed point


@pytest.mark.parametrize(("authority", "code"), REFUSED, ids=[ascii(r[0])[1:-1][:40] for r in REFUSED])
def test_refused(authority: str, code: str) -> None:
    with pytest.raises(CanonError) as info:
        split_host_port(authority)
    assert info.value.code == code


def test_no_row_is_listed_twice() -> None:
    inputs = [(row[0], row[1]) for row in ACCEPTED] + [(row[0], None) for row in REFUSED]
    assert len(inputs) == len(set(inputs))


# ------------------------------------------------------------------------ CONNECT targets, end to end
# The gateway's CONNECT path (gateway/pipeline/decision.py `http_connect`): mitmproxy parses the request line,
# `gateway/shared/target.py`'s `as_sent` takes the authority text, `split_host_port` canonicalizes it. Rows
# mitmproxy already refuses are checked against our parser too: if mitmproxy ever loosened its
# request-line parser, the gateway would still refuse them (`ours` is the code our parser gives).
CONNECT_TARGETS: list[tuple[str, tuple[str, int] | None, str | None]] = [
    # (target, canonical (host, port) or None, our parser's error code or None)
    ("Example.COM.:443", ("example.com", 443), None),
    ("[::1]:443", ("::1", 443), None),
    ("[::ffff:127.0.0.1]:8443", ("::ffff:127.0.0.1", 8443), None),
    ("0177.1:443", ("127.0.0.1", 443), None),
    ("2130706433:443", ("127.0.0.1", 443), None),
    ("xn--bcher-kva.example:443", ("xn--bcher-kva.example", 443), None),
    ("example.com:0443", None, "port_leading_zero"),  # mitmproxy reads 443; the text we decide on does not
    ("[fe80::1%25eth0]:443", None, "zone_id"),
    # refused by mitmproxy's request-line parser as well
    ("example.com", None, "missing_port"),
    ("user@example.com:443", None, "userinfo"),
    ("example.com:443:443", None, "unbracketed_ipv6"),
    ("::1:443", None, "unbracketed_ipv6"),
    ("example.com:+443", None, "bad_port"),
    ("example.com:65536", None, "port_out_of_range"),
    ("b%C3%BCcher.example:443", None, "percent_encoded"),
]


@pytest.mark.parametrize(("target", "expected", "ours"), CONNECT_TARGETS, ids=[r[0] for r in CONNECT_TARGETS])
def test_connect_target(target: str, expected: tuple[str, int] | None, ours: str | None) -> None:
    try:
        request = read_request_head([f"CONNECT {target} HTTP/1.1\r\n".encode()])
    except ValueError:
        request = None
    if expected is not None:
        assert request is not None
        assert split_host_port(as_sent(request), request.port) == expected
        return
    text = as_sent(request) if request is not None else target
    with pytest.raises(CanonError) as info:
        split_host_port(text)
    assert info.value.code == ours
