"""The egress policy's parsing and matching (runtime/egress.py) and what the domain proxy reads
from a connection's first bytes (runtime/container/egress.py): no server, no network."""

from __future__ import annotations

import ssl

import pytest

from aenv.errors import AenvError, ErrorCode
from aenv.runtime.container.egress import apply_commands, clear_commands, http_host, tls_sni
from aenv.runtime.egress import EgressPolicy, parse_policy


def test_parse_normalises_and_splits_domains() -> None:
    p = parse_policy(["1.2.3.4", "10.0.0.0/8", "10.1.0.0/16", "Example.COM.", "*.x.org"],
                     ["0.0.0.0/0", "192.168.1.7/24"])
    assert p.allow == ("1.2.3.4/32", "10.0.0.0/8")  # 10.1/16 merged into 10/8
    assert p.deny == ("0.0.0.0/0",)
    assert p.domains == ("example.com", "*.x.org")
    assert p.active
    assert p.allowed_networks == ("1.2.3.4/32", "8.8.8.8/32", "10.0.0.0/8")  # + DNS: domains
    assert parse_policy(["1.1.1.1"], None).active is False  # no deny: everything allowed
    assert parse_policy(None, None, allow_internet_access=False).deny == ("0.0.0.0/0",)
    assert parse_policy(["a.com"], ["0.0.0.0/0"], dns_servers=[]).allowed_networks == ()


@pytest.mark.parametrize("allow,deny,dns", [
    (["not a domain"], None, None), (["*"], None, None), (["-bad.com"], None, None),
    (None, ["example.com"], None), (None, ["1.2.3.4/33"], None), (None, None, ["dns.google"]),
    (["a.com"] * 257, None, None)])
def test_parse_refuses(allow: list[str] | None, deny: list[str] | None,
                       dns: list[str] | None) -> None:
    with pytest.raises(AenvError) as exc:
        parse_policy(allow, deny, dns)
    assert exc.value.code is ErrorCode.INVALID_ARGUMENT


def test_host_matching() -> None:
    p = EgressPolicy(deny=("0.0.0.0/0",), domains=("example.com", "*.wild.org"))
    assert p.host_allowed("example.com") and p.host_allowed("EXAMPLE.com.")
    assert not p.host_allowed("www.example.com") and not p.host_allowed("example.com.evil")
    assert p.host_allowed("a.wild.org") and p.host_allowed("a.b.wild.org")
    assert not p.host_allowed("wild.org") and not p.host_allowed("xwild.org")
    assert not p.host_allowed("")
    assert EgressPolicy.from_json(p.to_json()) == p


def _client_hello(server_name: str | None) -> bytes:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=server_name)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


def test_sni_and_host_parsing() -> None:
    hello = _client_hello("api.example.com")
    assert tls_sni(hello) == "api.example.com"
    assert tls_sni(hello[:20]) is False  # more bytes needed
    assert tls_sni(_client_hello(None)) is None
    assert tls_sni(b"GET / HTTP/1.1\r\n\r\n") is None
    assert http_host(b"GET / HTTP/1.1\r\nHost: a.b:8080\r\nX: y") == "a.b"
    assert http_host(b"GET / HTTP/1.1\r\nhost: a.b") == "a.b"
    assert http_host(b"GET / HTTP/1.1\r\nX: y") is None
    assert http_host(b"\x16\x03\x01 junk") is None


def test_nft_commands_are_one_transaction_per_change() -> None:
    policy = parse_policy(["1.2.3.4", "a.com"], ["0.0.0.0/0"])
    text = apply_commands(7, "10.88.0.9", policy, subnet="10.88.0.0/16", host_dns=["10.0.0.53"],
                          proxy=("10.88.0.1", 4321))
    assert "flush set ip aenv eg_allow_7" in text and "jump eg_7" in text
    assert "10.0.0.53/32" in text  # the sandbox's resolver is allowed with domains
    assert "dnat to 10.88.0.1:4321" in text
    cleared = clear_commands(7, "10.88.0.9")
    assert cleared.index("delete element") < cleared.index("delete chain ip aenv eg_7")
