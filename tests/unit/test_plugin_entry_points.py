"""Entry points of a group are read (with importlib.metadata) only where a package may declare
the group: `may_declare` says no only when no distribution on sys.path can."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import pytest

from client.plugins import load_entry_points, may_declare

GROUP = "gelastic.test_site_group"


def _site(root: Path, group: str = GROUP) -> None:
    """A distribution in `root` whose entry point `checks` of `group` is a module's object."""
    dist = root / "gelastic_test_site-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: gelastic-test-site\nVersion: 1.0\n"
    )
    (dist / "entry_points.txt").write_text(f"[{group}]\nchecks = gelastic_test_site_mod:CHECKS\n")
    (root / "gelastic_test_site_mod.py").write_text("CHECKS = ['site checks']\n")


def test_a_group_a_package_declares_is_found_and_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _site(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert may_declare(GROUP)
    assert load_entry_points(GROUP) == [("gelastic_test_site_mod:CHECKS", ["site checks"])]


def test_a_group_no_package_declares_needs_no_metadata_scan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _site(tmp_path, group="gelastic.test_another_group")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not may_declare(GROUP)
    assert load_entry_points(GROUP) == []


def test_a_zip_on_sys_path_may_declare_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    archive = tmp_path / "site.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("gelastic_test_zip_mod.py", "X = 1\n")
    monkeypatch.syspath_prepend(str(archive))
    assert may_declare(GROUP)


def test_a_path_object_on_sys_path_may_declare_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.path", [*sys.path, tmp_path])
    assert may_declare(GROUP)
