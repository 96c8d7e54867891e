import json

import pytest

from core.artifacts import MANIFEST, ArtifactStore, hash_tree


def _write(d, text="hello"):
    (d / "a.txt").write_text(text)
    (d / "sub").mkdir()
    (d / "sub" / "b.bin").write_bytes(b"\x00\x01")


def test_publish_is_content_addressed_and_sealed(tmp_path):
    store = ArtifactStore(tmp_path / "artifacts")
    ref = store.write("thing", _write, meta={"x": 1})
    assert store.exists(ref)
    manifest = json.loads((tmp_path / "artifacts" / "thing" / ref.sha256 / MANIFEST).read_text())
    assert manifest["sha256"] == ref.sha256 and manifest["files"] == ["a.txt", "sub/b.bin"]
    assert manifest["meta"] == {"x": 1}
    again = store.write("thing", _write)
    assert again == ref
    other = store.write("thing", lambda d: _write(d, "other"))
    assert other.sha256 != ref.sha256


def test_crash_inside_writer_publishes_nothing(tmp_path):
    store = ArtifactStore(tmp_path / "artifacts")

    def boom(d):
        _write(d)
        raise RuntimeError("stage crashed")

    with pytest.raises(RuntimeError):
        store.write("thing", boom)
    assert not (tmp_path / "artifacts" / "thing").exists() or not any(
        (tmp_path / "artifacts" / "thing").iterdir()
    )
    assert not any((tmp_path / "artifacts" / ".tmp").iterdir())


def test_folder_without_manifest_does_not_exist(tmp_path):
    store = ArtifactStore(tmp_path / "artifacts")
    ref = store.write("thing", _write)
    (tmp_path / "artifacts" / "thing" / ref.sha256 / MANIFEST).unlink()
    assert not store.exists(ref)
    # republishing the same content repairs it
    assert store.exists(store.write("thing", _write))


def test_hash_ignores_manifest_and_covers_names(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "x").write_text("1")
    (b / "y").write_text("1")
    assert hash_tree(a) != hash_tree(b)
    (a / MANIFEST).write_text("{}")
    (b / "x").write_text("1")
    (b / "y").unlink()
    assert hash_tree(a) == hash_tree(b)


def test_stored_paths_are_relative_and_located_wherever_the_workspace_is(tmp_path):
    """A ref is stored relative to the workspace root; reading it back in a copy of the workspace, or
    reading an absolute path a workspace wrote before paths were relative, gives the copy's folder."""
    import shutil

    from core.artifacts import ArtifactRef

    old = ArtifactStore(tmp_path / "old" / "artifacts")
    ref = old.write("model", lambda d: (d / "w.bin").write_bytes(b"weights"))
    stored = old.stored(ref)
    assert stored == {"kind": "model", "sha256": ref.sha256, "path": f"artifacts/model/{ref.sha256}"}
    shutil.copytree(tmp_path / "old", tmp_path / "new")
    shutil.rmtree(tmp_path / "old")
    new = ArtifactStore(tmp_path / "new" / "artifacts")
    here = str(tmp_path / "new" / "artifacts" / "model" / ref.sha256)
    assert new.locate(stored).path == here and new.exists(stored)
    assert new.locate(ref.to_dict()).path == here  # an absolute path from before the move
    assert new.manifest(ref)["sha256"] == ref.sha256
    outside = ArtifactRef("model", "ab" * 32, str(tmp_path / "models" / "mine"))  # a folder outside any store
    assert new.stored(outside)["path"] == outside.path and new.locate(outside) == outside
    missing = ArtifactRef("model", "cd" * 32, str(tmp_path / "other" / "artifacts" / "model" / ("cd" * 32)))
    assert new.locate(missing) == missing  # not in this store: the path stays as written
