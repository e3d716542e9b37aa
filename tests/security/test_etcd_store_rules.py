"""An etcd store is refused where it would share another store's keys, or cross the network
in clear text.

Before the fix a prefix such as `x/jobs` was taken: its keys lay inside the `jobs` section of a
coordinator on prefix `x`, which read them as bad job records and moved them aside. And
`--store etcd://10.0.0.1:2379/...` without TLS was used as given: every job spec in full (env
values, result keys) and the etcd password went over the network in clear text, although the
coordinator refuses to do the same with its own token on its own port.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator._store_etcd import parse_etcd_url
from coordinator.server import CoordinatorConfig
from tests._programs import run

# What the store writes directly under its prefix (coordinator/_store_etcd.py's layout).
SECTIONS = ("events", "jobs", "leader", "meta", "nodes", "parts", "quarantine")


@pytest.mark.parametrize("section", SECTIONS)
def test_a_prefix_with_a_section_name_as_a_part_is_refused(section: str) -> None:
    for prefix in (f"x/{section}", f"x/{section}/y", section):
        with pytest.raises(ValueError, match=f"section names .* got '{section}'"):
            parse_etcd_url(f"etcd://127.0.0.1:2379/{prefix}")
        with pytest.raises(ValueError, match="section names"):
            CoordinatorConfig(store=f"etcd://127.0.0.1:2379/{prefix}").validate()


def test_prefixes_that_only_look_alike_are_taken() -> None:
    for prefix in ("x", "x/jobs2", "x/Jobs", "gelastic/prod.jobs", "a/b/c"):
        assert parse_etcd_url(f"etcd://127.0.0.1:2379/{prefix}")[1] == prefix


@pytest.mark.parametrize(
    "endpoints",
    ["10.0.0.1:2379", "127.0.0.1:2379,10.0.0.2:2379", "etcd.example.invalid:2379"],
)
def test_etcd_off_loopback_without_tls_is_refused(endpoints: str, tmp_path: Path) -> None:
    store = f"etcd://{endpoints}/gelastic"
    with pytest.raises(ValueError, match=r"refusing to use etcd at \S+ without TLS"):
        CoordinatorConfig(store=store).validate()
    CoordinatorConfig(store=store, insecure=True).validate()
    ca = tmp_path / "ca.pem"
    ca.write_text("unused here")
    CoordinatorConfig(store=store, etcd_ca=str(ca)).validate()


@pytest.mark.parametrize("endpoints", ["127.0.0.1:2379", "localhost:2379", "[::1]:2379"])
def test_etcd_on_loopback_needs_no_tls(endpoints: str) -> None:
    CoordinatorConfig(store=f"etcd://{endpoints}/gelastic").validate()


def test_coordinator_serve_says_why_it_refuses() -> None:
    done = run("coordinator", "serve", "--port", "0", "--store", "etcd://10.0.0.1:2379/gelastic")
    assert done.returncode == 2, done.stderr
    assert "refusing to use etcd at 10.0.0.1:2379 without TLS" in done.stderr
    assert "--insecure" in done.stderr
    done = run("coordinator", "serve", "--port", "0", "--store", "etcd://127.0.0.1:2379/x/jobs")
    assert done.returncode == 2, done.stderr
    assert "section names" in done.stderr
