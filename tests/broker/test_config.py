"""Capability schema: strict, typo-proof, and safe header/format choices."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter, ValidationError

from egressgate.broker.config import (
    BasicPlacement,
    BrokerConfig,
    Capability,
    HeaderPlacement,
    QueryPlacement,
    StaticCapability,
)

CAP = TypeAdapter(Capability)
KV = {"vault": {"path": "egressgate/openai", "field": "api_key"}}


def test_valid_shapes() -> None:
    c = CAP.validate_python(
        {
            "type": "static",
            "source": KV,
            "placement": {"header": "x-api-key"},
            "mode": "phantom",
            "phantom_env": "OPENAI_API_KEY",
        }
    )
    assert isinstance(c, StaticCapability) and isinstance(c.placement, HeaderPlacement)
    assert c.placement.render("abc") == "abc"
    j = CAP.validate_python({"type": "jwt"})
    assert j.placement.render("t") == "Bearer t" and j.ttl_seconds == 300
    b = CAP.validate_python({"type": "static", "source": {"file": "/s"}, "placement": {"basic": {"username": "u"}}})
    assert isinstance(b.placement, BasicPlacement)
    q = CAP.validate_python({"type": "static", "source": {"file": "/s"}, "placement": {"query": "key"}})
    assert isinstance(q.placement, QueryPlacement)
    assert CAP.validate_python({"type": "vault_oidc", "role": "sbx-api"}).role == "sbx-api"
    assert hash(c) == hash(CAP.validate_python(c.model_dump()))  # usable as a cache key


def test_braces_in_value_are_not_reinterpreted() -> None:
    p = HeaderPlacement(header="Authorization", format="Token {value}")
    assert p.render("{value}{0}}{") == "Token {value}{0}}{"


@pytest.mark.parametrize(
    "bad",
    [
        {"type": "jwt", "heder": "x"},  # typo
        {"type": "jwt", "placement": {"header": "Host"}},
        {"type": "jwt", "placement": {"header": "Proxy-Authorization"}},
        {"type": "jwt", "placement": {"header": "Content-Length"}},
        {"type": "jwt", "placement": {"header": "X-Key\r\nInjected: 1"}},
        {"type": "jwt", "placement": {"header": "X-Key\n"}},
        {"type": "jwt", "mode": "phantom", "phantom_env": "OPENAI_KEY\n"},
        {"type": "jwt", "placement": {"header": "X", "format": "Bearer"}},
        {"type": "jwt", "placement": {"header": "X", "format": "{value}{value}"}},
        {"type": "jwt", "placement": {"header": "X", "format": "{value} {other}"}},
        {"type": "jwt", "placement": {"header": "X", "format": "a\r\n{value}"}},
        {"type": "jwt", "placement": {"basic": {"username": "a:b"}}},
        {"type": "jwt", "placement": {"query": "a&b"}},
        {"type": "jwt", "placement": {"header": "X", "query": "y"}},
        {"type": "jwt", "mode": "phantom"},  # no phantom_env
        {"type": "jwt", "phantom_env": "X"},  # phantom_env without phantom mode
        {"type": "jwt", "mode": "phantom", "phantom_env": "K", "placement": {"query": "k"}},
        {"type": "jwt", "ttl_seconds": 0},
        {"type": "jwt", "ttl_seconds": "300"},  # strict: no string coercion
        {"type": "static"},  # no source
        {"type": "static", "source": {"vault": {"path": "../x", "field": "f"}}},
        {"type": "static", "source": {"vault": {"path": "/abs", "field": "f"}}},
        {"type": "static", "source": {"file": "/a", "vault": KV["vault"]}},
        {"type": "vault_oidc"},
        {"type": "oauth"},
    ],
)
def test_rejected(bad: dict) -> None:
    with pytest.raises(ValidationError):
        CAP.validate_python(bad)


def test_broker_config() -> None:
    assert BrokerConfig().backend == "local"
    with pytest.raises(ValidationError, match="vault_addr"):
        BrokerConfig(backend="vault")
    cfg = BrokerConfig(backend="vault", vault_addr="http://127.0.0.1:1", secret_id="topsecret-id")
    assert "topsecret-id" not in repr(cfg) and "topsecret-id" not in str(cfg.model_dump())
    with pytest.raises(ValidationError):
        BrokerConfig(backend="vault", vault_addr="http://x", bogus=1)
    with pytest.raises(ValidationError):
        BrokerConfig(backend="vault", vault_addr="127.0.0.1:8200")  # scheme required
