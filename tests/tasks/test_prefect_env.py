"""A fresh workspace's Prefect database comes from the migrated template; nothing else is touched."""

import sqlite3

import pytest

from tasks import prefect_env


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LAMINAR_CACHE_DIR", str(tmp_path / "cache"))
    for var in (*prefect_env.DB_URL_VARS, "PREFECT_API_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("LAMINAR_PREFECT_TEMPLATE", raising=False)
    return tmp_path / "cache"


def _fake_template(cache):
    path = prefect_env.template_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE alembic_version (version_num TEXT)")
    con.execute("INSERT INTO alembic_version VALUES ('head')")
    con.commit()
    con.close()
    return path


def test_fresh_home_gets_a_copy_of_the_template(cache, tmp_path):
    template = _fake_template(cache)
    home = tmp_path / "ws" / "prefect"
    assert prefect_env.seed_database(home)
    assert (home / "prefect.db").read_bytes() == template.read_bytes()
    assert [p.name for p in home.iterdir()] == ["prefect.db"]  # no temporary file left


def test_an_existing_database_or_another_database_url_is_left_alone(cache, tmp_path, monkeypatch):
    _fake_template(cache)
    home = tmp_path / "prefect"
    home.mkdir()
    (home / "prefect.db").write_bytes(b"the workspace's own runs")
    assert not prefect_env.seed_database(home)
    assert (home / "prefect.db").read_bytes() == b"the workspace's own runs"
    other = tmp_path / "other"
    monkeypatch.setenv("PREFECT_API_DATABASE_CONNECTION_URL", "postgresql+asyncpg://localhost/prefect")
    assert not prefect_env.seed_database(other)
    assert not other.exists()
    monkeypatch.delenv("PREFECT_API_DATABASE_CONNECTION_URL")
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")  # a server keeps its own database
    assert not prefect_env.seed_database(other)
    assert not other.exists()


def test_a_failed_template_build_falls_back_to_prefect(cache, tmp_path, monkeypatch):
    def fail(path, timeout_s=300.0):
        raise OSError("read-only cache")

    monkeypatch.setattr(prefect_env, "make_template", fail)
    home = tmp_path / "prefect"
    assert not prefect_env.seed_database(home)
    assert not (home / "prefect.db").exists()


@pytest.mark.slow
def test_the_template_is_a_migrated_prefect_database(cache):
    path = prefect_env.make_template(prefect_env.template_path())
    con = sqlite3.connect(path)
    tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"alembic_version", "flow_run", "task_run"} <= tables
