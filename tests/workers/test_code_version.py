"""The code version a calibration records: any source edit changes it."""

from workers.code_version import code_version, sources_hash


def test_the_hash_follows_sources_only(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "k").mkdir()
    (tmp_path / "k" / "gemm.c").write_text("int f(void) { return 1; }\n")
    before = sources_hash(tmp_path)
    (tmp_path / "notes.txt").write_text("not a source")
    assert sources_hash(tmp_path) == before
    (tmp_path / "k" / "gemm.c").write_text("int f(void) { return 2; }\n")
    assert sources_hash(tmp_path) != before and len(before) == 12


def test_this_process_has_one_version():
    version = code_version()
    assert version == code_version() and "+" in version
