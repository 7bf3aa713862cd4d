"""What is installed, as versions a zygote and a snapshot are checked against
(preloadd/install.py): ours changes with the worker code, the packages' with any package
installed, upgraded or removed on the interpreter's path."""

from __future__ import annotations

import sys

from preload.preloadd.install import packages_version


def test_the_packages_version_changes_when_a_package_is_installed_upgraded_or_removed(tmp_path, monkeypatch):
    site = tmp_path / "site-packages"
    site.mkdir()
    monkeypatch.setattr(sys, "path", [*sys.path, str(site)])
    before = packages_version()
    assert packages_version() == before  # (nothing changed: the same)
    (site / "somepkg-1.0.dist-info").mkdir()
    installed = packages_version()
    assert installed != before
    (site / "somepkg-1.0.dist-info").rename(site / "somepkg-1.1.dist-info")
    upgraded = packages_version()
    assert upgraded not in (before, installed)
    (site / "somepkg-1.1.dist-info").rmdir()
    assert packages_version() == before


def test_the_folder_the_command_ran_from_does_not_count(tmp_path, monkeypatch):
    here = tmp_path / "cwd"
    here.mkdir()
    (here / "stray-0.1.dist-info").mkdir()
    before = packages_version()
    monkeypatch.setattr(sys, "path", [str(here), *sys.path[1:]])
    assert packages_version() == before
