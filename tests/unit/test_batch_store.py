from __future__ import annotations

import io
from pathlib import Path

import pytest

from schemas import SamplingParams
from schemas.batches import BatchDoc, FileDoc, LineError, PreparedLine
from tokenbus.batch.store import BatchStore, NotFound

FILE_ID = "file-01ABCDEFGHJKMNPQRSTVWXYZ01"
BATCH_ID = "batch_01ABCDEFGHJKMNPQRSTVWXYZ01"


def file_doc(tenant: str = "acme", file_id: str = FILE_ID) -> FileDoc:
    return FileDoc(
        id=file_id, bytes=3, created_at=1, filename="in.jsonl", purpose="batch", tenant=tenant
    )


def batch_doc(tenant: str = "acme", batch_id: str = BATCH_ID, created_at: int = 1) -> BatchDoc:
    return BatchDoc(
        id=batch_id,
        endpoint="/v1/completions",
        input_file_id=FILE_ID,
        completion_window="24h",
        status="validating",
        created_at=created_at,
        tenant=tenant,
    )


def test_files_and_batches_round_trip_tenant_first(tmp_path: Path) -> None:
    store = BatchStore(str(tmp_path))
    store.put_file(file_doc(), b"abc")
    store.put_batch(batch_doc())
    assert store.file_bytes("acme", FILE_ID) == b"abc"
    assert store.file_doc("acme", FILE_ID) == file_doc()
    assert store.batch("acme", BATCH_ID) == batch_doc()
    assert (tmp_path / "acme" / "files" / FILE_ID).read_bytes() == b"abc"
    assert (tmp_path / "acme" / "batches" / f"{BATCH_ID}.json").exists()
    assert not list(tmp_path.rglob("*.tmp-*"))  # the temporary names moved into place


def test_another_tenant_finds_nothing(tmp_path: Path) -> None:
    store = BatchStore(str(tmp_path))
    store.put_file(file_doc(), b"abc")
    store.put_batch(batch_doc())
    with pytest.raises(NotFound):
        store.file_bytes("evil", FILE_ID)
    with pytest.raises(NotFound):
        store.file_doc("evil", FILE_ID)
    with pytest.raises(NotFound):
        store.batch("evil", BATCH_ID)
    assert store.batches("evil") == []


@pytest.mark.parametrize(
    ("tenant", "item"),
    [
        ("acme", "../acme/files/" + FILE_ID),
        ("..", FILE_ID),
        ("acme", "file-x/../../y"),
        ("a/b", FILE_ID),
        ("acme", FILE_ID + "/../z"),
        ("acme", "*"),
        ("acme\n", FILE_ID),
        ("acme", FILE_ID + "\n"),
    ],
)
def test_ids_that_are_paths_are_refused(tmp_path: Path, tenant: str, item: str) -> None:
    store = BatchStore(str(tmp_path))
    store.put_file(file_doc(), b"abc")
    with pytest.raises(NotFound):
        store.file_bytes(tenant, item)
    with pytest.raises(NotFound):
        store.batch(tenant, item)


def test_batches_list_newest_first_and_find_by_id(tmp_path: Path) -> None:
    store = BatchStore(str(tmp_path))
    older, newer = "batch_0000000000OLDER", "batch_0000000000NEWER"
    store.put_batch(batch_doc(batch_id=older, created_at=1))
    store.put_batch(batch_doc(batch_id=newer, created_at=2))
    store.put_batch(batch_doc(tenant="other", batch_id="batch_00000000000OTHER"))
    assert [d.id for d in store.batches("acme")] == [newer, older]
    assert store.find_batch("batch_00000000000OTHER").tenant == "other"
    with pytest.raises(NotFound):
        store.find_batch("batch_000000000MISSING")


def test_prepared_lines_and_errors_round_trip(tmp_path: Path) -> None:
    store = BatchStore(str(tmp_path))
    lines = [
        PreparedLine(
            line_no=1, custom_id="a", model="m", prompt="p", sampling=SamplingParams(max_tokens=2)
        )
    ]
    errors = [LineError(line_no=2, custom_id=None, code="invalid_json", message="not JSON")]
    with store.line_writer("acme", BATCH_ID) as write:
        for prepared in lines:
            write(prepared)
        for error in errors:
            write(error)
    assert store.lines("acme", BATCH_ID) == lines
    assert store.line_errors("acme", BATCH_ID) == errors


def test_lines_are_in_place_only_once_all_are_written(tmp_path: Path) -> None:
    store = BatchStore(str(tmp_path))
    line = PreparedLine(
        line_no=1, custom_id="a", model="m", prompt="p", sampling=SamplingParams(max_tokens=2)
    )
    error = LineError(line_no=2, custom_id=None, code="invalid_json", message="not JSON")
    with pytest.raises(RuntimeError), store.line_writer("acme", BATCH_ID) as write:
        write(line)
        write(error)
        raise RuntimeError("the check failed half way")
    assert list((tmp_path / "acme" / "batches").iterdir()) == []  # no half file, no temporary
    with store.line_writer("acme", BATCH_ID) as write:
        write(line)
        write(error)
        assert not (tmp_path / "acme" / "batches" / f"{BATCH_ID}.lines.jsonl").exists()
    assert store.lines("acme", BATCH_ID) == [line]
    assert store.line_errors("acme", BATCH_ID) == [error]
    assert sorted(p.name for p in (tmp_path / "acme" / "batches").iterdir()) == [
        f"{BATCH_ID}.errors.jsonl",
        f"{BATCH_ID}.lines.jsonl",
    ]


def test_a_file_is_written_and_read_a_block_at_a_time(tmp_path: Path) -> None:
    store = BatchStore(str(tmp_path))
    store.put_file_from(file_doc(), io.BytesIO(b"abc"))
    assert (store.file_bytes("acme", FILE_ID), store.file_doc("acme", FILE_ID)) == (
        b"abc",
        file_doc(),
    )
    assert store.file_size("acme", FILE_ID) == 3
    with pytest.raises(NotFound):
        store.file_size("other", FILE_ID)
    with store.open_file("acme", FILE_ID) as f:
        assert (f.read(2), f.read(2), f.read(2)) == (b"ab", b"c", b"")
    with pytest.raises(NotFound), store.open_file("acme", "file-01ABCDEFGHJKMNPQRSTVWXYZ99"):
        pass
    with pytest.raises(NotFound), store.open_file("other", FILE_ID):
        pass


def test_a_url_picks_the_filesystem(tmp_path: Path) -> None:
    store = BatchStore(f"file://{tmp_path}/nested")
    store.put_file(file_doc(), b"abc")
    assert (tmp_path / "nested" / "acme" / "files" / FILE_ID).exists()
    memory = BatchStore("memory://tokenbus-test-store")
    memory.put_batch(batch_doc())
    assert memory.batch("acme", BATCH_ID).id == BATCH_ID
    error = LineError(line_no=1, custom_id=None, code="invalid_json", message="not JSON")
    with memory.line_writer("acme", BATCH_ID) as write:  # under a temporary name, moved
        write(error)
    assert memory.line_errors("acme", BATCH_ID) == [error]
