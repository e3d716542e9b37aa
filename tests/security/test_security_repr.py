"""A Security's repr and str never show the token, only whether one is set.

Before the fix Security was a plain dataclass whose generated repr printed `token='...'`, so any
log line or traceback that showed the settings leaked the shared secret.
"""

from __future__ import annotations

from client.security import Security

SECRET = "s3cret-token-that-must-not-leak-0123456789"


def test_repr_and_str_say_a_token_is_set_without_showing_it() -> None:
    sec = Security(token=SECRET, tls_ca="/etc/ca.pem")
    for text in (repr(sec), str(sec), f"{sec}", repr([sec]), repr({"s": sec})):
        assert SECRET not in text
        assert "token_set=True" in text
        assert "/etc/ca.pem" in text


def test_repr_says_when_no_token_is_set() -> None:
    assert "token_set=False" in repr(Security())


def test_the_token_is_still_sent() -> None:
    assert Security(token=SECRET).metadata == (("authorization", f"Bearer {SECRET}"),)
