"""The compile cache can be trusted (CPU, no GPU needed).

- A cache directory that is not the user's own, is writable by group or others, or is a symlink is
  refused: the cubin is compiled and kept in memory, one warning names the directory, and nothing
  in it is ever loaded (a planted entry with a valid checksum included).
- An entry that is a symlink, not a regular file, not the user's own or writable by group/others
  is never loaded; an entry copied from another program's name is refused by its checksum.
- The directory is created 0700, entries 0600 through unpredictable temporary names.
- Any OSError reading or writing an entry is a miss: the cubin is kept in memory, so a second
  load in the same process does not compile again.
- 4 threads and 4 processes filling one entry at once all get the right cubin; the entry ends valid.

The NVRTC compile is replaced by a fake that returns deterministic bytes and counts its calls
(the real compile is covered by test_integrity_cpu.py and the `compile` tests).
"""
from __future__ import annotations

import errno
import hashlib
import multiprocessing
import os
import pathlib
import shutil
import stat
import threading
import time
import warnings

import pytest

from dispatch import registry

PROGRAM = "moe_ar_oneshot_bf16_ws2_plain"
OTHER = "moe_ar_oneshot_bf16_ws4_plain"
TARGET = "sm_90a"
EVIL = b"\x7fELF planted cubin" * 16


def good_cubin(source: str, name: str, target: str) -> bytes:
    """What the fake compile returns: a function of everything compiled."""
    return b"\x7fELF" + hashlib.sha256(f"{name}\0{target}\0{source}".encode()).digest() * 4096  # 128 KiB


class FakeCompile:
    """Stands in for registry.compile_cubin: counts calls; `payload` overrides what it returns."""

    def __init__(self, delay_s: float = 0.0):
        self.calls = 0
        self.payload = None
        self.delay_s = delay_s
        self._lock = threading.Lock()

    def __call__(self, source: str, name: str, target: str):
        with self._lock:
            self.calls += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        return (self.payload if self.payload is not None else good_cubin(source, name, target)), "fake ptxas log"


@pytest.fixture
def fake(monkeypatch):
    f = FakeCompile()
    monkeypatch.setattr(registry, "compile_cubin", f)
    # per-process state of the cache, fresh for every test
    monkeypatch.setattr(registry, "_memory_cubins", {}, raising=False)
    monkeypatch.setattr(registry, "_warned_dirs", set(), raising=False)
    return f


def expected(name: str = PROGRAM) -> bytes:
    ps = registry.program_set()
    return good_cubin(registry._manifest.source_for(ps.manifest, ps.dir, name), name, TARGET)


def use_dir(monkeypatch, path) -> pathlib.Path:
    monkeypatch.setenv("MOE_AR_CACHE_DIR", str(path))
    return pathlib.Path(path)


def valid_entry(tmp_path, monkeypatch, fake, cubin: bytes = EVIL, name: str = PROGRAM) -> pathlib.Path:
    """An entry for `name` holding `cubin` with a valid checksum, written by the cache itself into a
    private directory of its own (what an attacker can produce: the checksum is recomputable)."""
    use_dir(monkeypatch, tmp_path / f"planted-{name}")
    fake.payload, calls = cubin, fake.calls
    got, info = registry.cached_cubin(name, TARGET)
    assert got == cubin and info["source"] == "compiled"
    fake.payload, fake.calls = None, calls
    registry._memory_cubins.clear()
    (entry,) = (tmp_path / f"planted-{name}").glob("*.cubin")
    return entry


def listing(d: pathlib.Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def calls_warning(fn):
    """(result of fn(), the cache warnings it emitted), every emission counted."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [w for w in caught if "cache" in str(w.message)]


def load_twice_refused(d: pathlib.Path, fake, why: str):
    """Two loads from a refused directory: compiled once, then from memory; one warning naming the
    directory and `why`; nothing in the directory is read or written."""
    before = {p.name: p.read_bytes() for p in d.iterdir()} if d.is_dir() else None
    (cubin, info), warned = calls_warning(lambda: registry.cached_cubin(PROGRAM, TARGET))
    assert cubin == expected() and info["source"] == "compiled" and fake.calls == 1
    assert len(warned) == 1, [str(w.message) for w in warned]
    msg = str(warned[0].message)
    assert str(d) in msg and why in msg, msg
    (again, info), warned = calls_warning(lambda: registry.cached_cubin(PROGRAM, TARGET))
    assert again == cubin and info["source"] == "memory" and fake.calls == 1
    assert warned == []  # once per process
    # another program in the same directory: compiled, no second warning
    (other, _), warned = calls_warning(lambda: registry.cached_cubin(OTHER, TARGET))
    assert other == expected(OTHER) and fake.calls == 2 and warned == []
    if before is not None:
        assert {p.name: p.read_bytes() for p in d.iterdir()} == before  # never written


# ---- the directory ------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["chown", "euid"])
def test_planted_entry_in_foreign_directory_is_never_loaded(tmp_path, monkeypatch, fake, how):
    entry = valid_entry(tmp_path, monkeypatch, fake)
    d = use_dir(monkeypatch, tmp_path / "foreign")
    d.mkdir(mode=0o700)
    shutil.copy2(entry, d / entry.name)
    if how == "chown":
        if os.geteuid() != 0:
            pytest.skip("giving the directory to another user needs root")
        os.chown(d, 4242, 4242)
        os.chown(d / entry.name, 4242, 4242)
    else:  # the directory and its entry are ours; the process runs as someone else
        euid = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: euid + 1)
    load_twice_refused(d, fake, "owned")


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777, 0o720, 0o702], ids=oct)
def test_planted_entry_in_group_or_world_writable_directory_is_never_loaded(tmp_path, monkeypatch, fake, mode):
    entry = valid_entry(tmp_path, monkeypatch, fake)
    d = use_dir(monkeypatch, tmp_path / "shared")
    d.mkdir()
    os.chmod(d, mode)
    shutil.copy2(entry, d / entry.name)
    load_twice_refused(d, fake, "writable")


def test_symlinked_cache_directory_is_refused(tmp_path, monkeypatch, fake):
    entry = valid_entry(tmp_path, monkeypatch, fake)
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    shutil.copy2(entry, real / entry.name)
    d = use_dir(monkeypatch, tmp_path / "link")
    d.symlink_to(real, target_is_directory=True)
    load_twice_refused(d, fake, "symlink")
    assert listing(real) == [entry.name] and (real / entry.name).read_bytes() == entry.read_bytes()


def test_cache_path_that_is_a_file_is_refused(tmp_path, monkeypatch, fake):
    d = use_dir(monkeypatch, tmp_path / "file")
    d.write_bytes(b"not a directory")
    load_twice_refused(d, fake, "directory")


def test_uncreatable_cache_directory_is_a_miss(tmp_path, monkeypatch, fake):
    (tmp_path / "file").write_bytes(b"")
    d = use_dir(monkeypatch, tmp_path / "file" / "cache")  # a parent is a file: mkdir raises
    load_twice_refused(d, fake, "")


def test_created_directory_is_private_and_entries_are_0600(tmp_path, monkeypatch, fake):
    d = use_dir(monkeypatch, tmp_path / "a" / "b" / "cache")
    replaced = []
    real_replace = os.replace

    def spy(src, dst, *a, **k):
        replaced.append((os.fspath(src), stat.S_IMODE(os.lstat(src).st_mode)))
        return real_replace(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", spy)
    old = os.umask(0)  # the modes must not come from the umask
    try:
        (cubin, info), warned = calls_warning(lambda: registry.cached_cubin(PROGRAM, TARGET))
        registry.cached_cubin(OTHER, TARGET)
    finally:
        os.umask(old)
    assert cubin == expected() and info["source"] == "compiled" and warned == []
    st = os.lstat(d)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    entries = listing(d)
    assert len(entries) == 2 and all(e.endswith(".cubin") for e in entries), entries  # no temporary left
    for e in entries:
        assert stat.S_IMODE(os.lstat(d / e).st_mode) == 0o600
    # written through temporary files in the directory, private from the start, with unpredictable names
    assert len(replaced) == 2
    names = [os.path.basename(src) for src, _ in replaced]
    for src, mode in replaced:
        assert os.path.dirname(src) == str(d) and mode == 0o600
    assert names[0] != names[1] and not any(str(os.getpid()) in n for n in names)
    again, info = registry.cached_cubin(PROGRAM, TARGET)
    assert again == cubin and info["source"] == "cache" and fake.calls == 2


def test_existing_private_directory_is_used(tmp_path, monkeypatch, fake):
    d = use_dir(monkeypatch, tmp_path / "cache")
    d.mkdir()
    os.chmod(d, 0o755)  # readable by others is fine: only writing makes a directory untrusted
    (_, info), warned = calls_warning(lambda: registry.cached_cubin(PROGRAM, TARGET))
    assert info["source"] == "compiled" and warned == []
    assert registry.cached_cubin(PROGRAM, TARGET)[1]["source"] == "cache" and fake.calls == 1


# ---- the entries --------------------------------------------------------------------------------

def test_symlinked_entry_is_never_followed(tmp_path, monkeypatch, fake):
    planted = valid_entry(tmp_path, monkeypatch, fake)  # valid, in a trusted directory of its own
    planted_bytes = planted.read_bytes()
    d = use_dir(monkeypatch, tmp_path / "cache")
    d.mkdir(mode=0o700)
    (d / planted.name).symlink_to(planted)
    (cubin, info), warned = calls_warning(lambda: registry.cached_cubin(PROGRAM, TARGET))
    assert cubin == expected() and info["source"] == "compiled" and fake.calls == 1
    # replaced by a regular entry of its own; the link's target neither loaded nor written
    entry = d / planted.name
    assert not entry.is_symlink() and stat.S_ISREG(os.lstat(entry).st_mode)
    assert planted.read_bytes() == planted_bytes
    again, info = registry.cached_cubin(PROGRAM, TARGET)
    assert again == cubin and info["source"] == "cache" and fake.calls == 1


@pytest.mark.parametrize("how", ["group-writable", "world-writable", "foreign"])
def test_untrusted_entry_file_is_never_loaded(tmp_path, monkeypatch, fake, how):
    planted = valid_entry(tmp_path, monkeypatch, fake)
    d = use_dir(monkeypatch, tmp_path / "cache")
    d.mkdir(mode=0o700)
    entry = d / planted.name
    shutil.copy2(planted, entry)
    if how == "foreign":
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(entry, 4242, 4242)
    else:
        os.chmod(entry, 0o620 if how == "group-writable" else 0o602)
    cubin, info = registry.cached_cubin(PROGRAM, TARGET)
    assert cubin == expected() and info["source"] == "compiled" and fake.calls == 1
    st = os.lstat(entry)  # replaced by a trusted one
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o600
    again, info = registry.cached_cubin(PROGRAM, TARGET)
    assert again == cubin and info["source"] == "cache" and fake.calls == 1


def test_entry_copied_from_another_program_is_refused(tmp_path, monkeypatch, fake):
    # A valid entry of OTHER under PROGRAM's name (same directory, same owner): its checksum binds
    # it to the key it was written for.
    d = use_dir(monkeypatch, tmp_path / "cache")
    registry.cached_cubin(PROGRAM, TARGET)
    registry.cached_cubin(OTHER, TARGET)
    (mine,) = d.glob(f"{PROGRAM}-*.cubin")
    (theirs,) = d.glob(f"{OTHER}-*.cubin")
    shutil.copy2(theirs, mine)
    cubin, info = registry.cached_cubin(PROGRAM, TARGET)
    assert cubin == expected() and info["source"] == "compiled" and info.get("cache_corrupt") is True


def test_entry_that_is_a_directory_is_a_miss_kept_in_memory(tmp_path, monkeypatch, fake):
    # Neither readable as an entry nor replaceable (os.replace raises IsADirectoryError): a real OSError.
    d = use_dir(monkeypatch, tmp_path / "cache")
    registry.cached_cubin(PROGRAM, TARGET)
    (entry,) = d.glob("*.cubin")
    entry.unlink()
    (entry / "x").mkdir(parents=True)
    registry._memory_cubins.clear()
    fake.calls = 0
    cubin, info = registry.cached_cubin(PROGRAM, TARGET)
    assert cubin == expected() and info["source"] == "compiled" and fake.calls == 1
    again, info = registry.cached_cubin(PROGRAM, TARGET)
    assert again == cubin and info["source"] == "memory" and fake.calls == 1
    assert listing(d) == [entry.name]  # no temporary left


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS, errno.EACCES])
def test_write_error_is_a_miss_kept_in_memory(tmp_path, monkeypatch, fake, err):
    d = use_dir(monkeypatch, tmp_path / "cache")

    def fail(*a, **k):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(os, "replace", fail)
    cubin, info = registry.cached_cubin(PROGRAM, TARGET)
    assert cubin == expected() and info["source"] == "compiled" and fake.calls == 1
    assert listing(d) == []  # the temporary was removed
    again, info = registry.cached_cubin(PROGRAM, TARGET)
    assert again == cubin and info["source"] == "memory" and fake.calls == 1


def test_temporary_file_error_is_a_miss_kept_in_memory(tmp_path, monkeypatch, fake):
    import tempfile
    use_dir(monkeypatch, tmp_path / "cache")

    def fail(*a, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "mkstemp", fail)
    cubin, info = registry.cached_cubin(PROGRAM, TARGET)
    assert cubin == expected() and info["source"] == "compiled" and fake.calls == 1
    again, info = registry.cached_cubin(PROGRAM, TARGET)
    assert again == cubin and info["source"] == "memory" and fake.calls == 1


@pytest.mark.parametrize("err", [errno.EACCES, errno.EIO])
def test_read_error_is_a_miss_kept_in_memory(tmp_path, monkeypatch, fake, err):
    d = use_dir(monkeypatch, tmp_path / "cache")
    registry.cached_cubin(PROGRAM, TARGET)  # a valid entry on disk
    assert len(list(d.glob("*.cubin"))) == 1
    real_open = os.open

    def failing_open(path, flags, *a, **k):
        if os.fspath(path).endswith(".cubin") and not flags & os.O_CREAT:
            raise OSError(err, os.strerror(err))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", failing_open)
    fake.calls = 0
    cubin, info = registry.cached_cubin(PROGRAM, TARGET)
    assert cubin == expected() and info["source"] == "compiled" and fake.calls == 1
    again, info = registry.cached_cubin(PROGRAM, TARGET)
    assert again == cubin and info["source"] == "memory" and fake.calls == 1


# ---- concurrent fills -----------------------------------------------------------------------------

def _fill_in_process(barrier, results):
    barrier.wait()
    cubin, info = registry.cached_cubin(PROGRAM, TARGET)
    results.put((hashlib.sha256(cubin).hexdigest(), info["source"]))


def _entry_ends_valid(d: pathlib.Path, fake):
    entries = listing(d)
    assert len(entries) == 1 and entries[0].endswith(".cubin"), entries  # no temporary left
    assert stat.S_IMODE(os.lstat(d / entries[0]).st_mode) == 0o600
    registry._memory_cubins.clear()
    calls = fake.calls
    cubin, info = registry.cached_cubin(PROGRAM, TARGET)
    assert cubin == expected() and info["source"] == "cache" and fake.calls == calls


def test_four_threads_fill_one_entry(tmp_path, monkeypatch, fake):
    # Several rounds from an empty directory: the writes of one round overlap (a temporary name
    # shared by the threads of one process would lose some of them).
    d = use_dir(monkeypatch, tmp_path / "cache")
    fake.delay_s = 0.01
    for _ in range(10):
        for p in d.glob("*"):
            p.unlink()
        registry._memory_cubins.clear()
        barrier = threading.Barrier(4)
        got, errors = [], []

        def fill():
            try:
                barrier.wait()
                got.append(registry.cached_cubin(PROGRAM, TARGET)[0])
            except BaseException as e:  # reported below, not lost in the thread
                errors.append(e)

        threads = [threading.Thread(target=fill) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == [] and len(got) == 4 and all(c == expected() for c in got)
        _entry_ends_valid(d, fake)


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
def test_four_processes_fill_one_entry(tmp_path, monkeypatch, fake):
    # fork: the children inherit the fake compile (and the cache directory from the environment)
    d = use_dir(monkeypatch, tmp_path / "cache")
    fake.delay_s = 0.2
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_fill_in_process, args=(barrier, results)) for _ in range(4)]
    for p in procs:
        p.start()
    got = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    want = hashlib.sha256(expected()).hexdigest()
    assert all(h == want for h, _ in got), got
    _entry_ends_valid(d, fake)


def test_a_shape_build_is_an_entry_of_its_own(tmp_path, monkeypatch, fake):
    """World size 1's latency program built with shape constants (dispatch/shape_constants.py): the
    defines go first in the source the key hashes, so the build and the plain program are two entries,
    each compiled once and each served from the cache after."""
    from dispatch import shape_constants
    use_dir(monkeypatch, tmp_path / "cache")
    name = "moe_ar_local_bf16_ws1_plain"
    prefix = shape_constants.defines(7168, 8, 1, 2, 448)
    plain, plain_info = registry.cached_cubin(name, TARGET)
    built, built_info = registry.cached_cubin(name, TARGET, prefix)
    assert plain != built and plain_info["cache"] != built_info["cache"] and fake.calls == 2
    ps = registry.program_set()
    assert built == good_cubin(prefix + registry._manifest.source_for(ps.manifest, ps.dir, name), name, TARGET)
    assert registry.cached_cubin(name, TARGET, prefix)[1]["source"] == "cache"
    assert registry.cached_cubin(name, TARGET)[1]["source"] == "cache" and fake.calls == 2
