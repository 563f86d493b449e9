"""Data: fetch (with a fake urlopen, never the network), checksum refusal, lookup order, split, batches."""

import hashlib
import io
import urllib.error

import numpy as np
import pytest

from .conftest import data_file
from npllama.train import data

FAKE = b"First Citizen:\nBefore we proceed any further, hear me speak.\n" * 50
FAKE_SHA = hashlib.sha256(FAKE).hexdigest()


class FakeResponse(io.BytesIO):
    """What urlopen returns: a readable context manager; `fail_after` bytes then an error."""

    def __init__(self, payload, fail_after=None):
        super().__init__(payload)
        self.fail_after = fail_after

    def read(self, n=-1):
        if self.fail_after is not None and self.tell() >= self.fail_after:
            raise urllib.error.URLError("connection reset by peer")
        return super().read(n)


@pytest.fixture
def fetch(monkeypatch, tmp_path):
    """Point the cache at tmp_path, unset the data dir, and serve `fetch.payload` for any URL."""
    monkeypatch.setenv(data.CACHE_VAR, str(tmp_path / "cache"))
    monkeypatch.delenv(data.DATA_DIR_VAR, raising=False)
    calls = []

    class Fetch:
        payload = FAKE
        fail_after = None
        error = None

    def fake_urlopen(url, timeout):
        calls.append(url)
        if Fetch.error is not None:
            raise Fetch.error
        return FakeResponse(Fetch.payload, Fetch.fail_after)

    monkeypatch.setattr(data, "urlopen", fake_urlopen)
    Fetch.calls = calls
    return Fetch


def test_download_keeps_a_verified_file(fetch, tmp_path):
    dest = tmp_path / "d" / "x.txt"
    assert data.download("http://example/x", dest, FAKE_SHA) == dest
    assert dest.read_bytes() == FAKE
    assert sorted(p.name for p in dest.parent.iterdir()) == ["x.txt"]     # no temp file left


def test_download_refuses_a_checksum_mismatch_and_keeps_nothing(fetch, tmp_path):
    dest = tmp_path / "x.txt"
    fetch.payload = FAKE + b"tampered"
    with pytest.raises(data.ChecksumError, match=FAKE_SHA):
        data.download("http://example/x", dest, FAKE_SHA)
    assert list(tmp_path.iterdir()) == []
    assert issubclass(data.ChecksumError, ValueError)


def test_interrupted_download_leaves_the_previous_file(fetch, tmp_path):
    dest = tmp_path / "x.txt"
    dest.write_bytes(b"previous good copy")
    fetch.fail_after = 100                       # fail on the second read
    fetch.payload = FAKE * 40
    with pytest.raises(urllib.error.URLError):
        data.download("http://example/x", dest, hashlib.sha256(FAKE * 40).hexdigest())
    assert dest.read_bytes() == b"previous good copy"
    assert [p.name for p in tmp_path.iterdir()] == ["x.txt"]


def test_tinyshakespeare_is_fetched_once_into_the_cache(fetch, monkeypatch, tmp_path):
    monkeypatch.setattr(data, "TINYSHAKESPEARE_SHA256", FAKE_SHA)
    path = data.find_text()
    assert path == tmp_path / "cache" / "tinyshakespeare.txt"
    assert fetch.calls == [data.TINYSHAKESPEARE_URL]
    assert data.load_text() == FAKE.decode()
    assert len(fetch.calls) == 1                        # the second call used the cache


def test_a_corrupt_cached_file_is_replaced(fetch, monkeypatch, tmp_path):
    monkeypatch.setattr(data, "TINYSHAKESPEARE_SHA256", FAKE_SHA)
    cached = tmp_path / "cache" / "tinyshakespeare.txt"
    cached.parent.mkdir()
    cached.write_bytes(FAKE[:100])                      # a truncated earlier download
    assert data.find_text() == cached
    assert cached.read_bytes() == FAKE and len(fetch.calls) == 1


def test_real_checksum_refuses_other_bytes(fetch, tmp_path):
    with pytest.raises(data.ChecksumError, match=data.TINYSHAKESPEARE_SHA256):
        data.find_text()
    assert not (tmp_path / "cache" / "tinyshakespeare.txt").exists()


def test_no_network_and_no_file_is_a_clear_error(fetch, monkeypatch, tmp_path):
    monkeypatch.setenv(data.DATA_DIR_VAR, str(tmp_path / "nowhere"))
    fetch.error = urllib.error.URLError("no route to host")
    with pytest.raises(FileNotFoundError) as e:
        data.find_text()
    msg = str(e.value)
    for needle in ("nowhere", "cache", data.TINYSHAKESPEARE_URL, "no route to host", "--data PATH"):
        assert needle in msg
    with pytest.raises(FileNotFoundError, match="--data PATH"):
        data.find_text(download_ok=False)
    assert len(fetch.calls) == 1


def test_data_dir_file_is_verified(fetch, monkeypatch, tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    (d / "tinyshakespeare.txt").write_bytes(b"not shakespeare")
    monkeypatch.setenv(data.DATA_DIR_VAR, str(d))
    with pytest.raises(data.ChecksumError, match="--data PATH"):
        data.find_text()
    assert fetch.calls == []


def test_explicit_path(fetch, tmp_path):
    f = tmp_path / "mine.txt"
    f.write_text("any text at all, not checksummed")
    assert data.load_text(f) == "any text at all, not checksummed"
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        data.find_text(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="empty"):
        data.load_text(tmp_path / "empty.txt")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match="UTF-8"):
        data.load_text(tmp_path / "latin1.txt")
    assert fetch.calls == []


def test_shared_tinyshakespeare_splits_as_nanogpt(monkeypatch):
    path = data_file("tinyshakespeare.txt")
    monkeypatch.setenv(data.DATA_DIR_VAR, str(path.parent))
    monkeypatch.setattr(data, "urlopen", None)          # must not be needed
    text = data.load_text()
    assert len(text) == 1115394 and len(set(text)) == 65
    chars = sorted(set(text))
    ids = np.array([chars.index(c) for c in text[:1000]] + [0] * (len(text) - 1000), dtype=np.int32)
    train, val = data.split(ids)
    assert (len(train), len(val)) == (1003854, 111540)
    train_text, val_text = data.split_text(text)
    assert (len(train_text), len(val_text)) == (1003854, 111540) and train_text + val_text == text


def test_get_batch_windows_are_contiguous_shifted_and_seeded():
    ids = np.arange(1000, dtype=np.int32) * 3
    x, y = data.get_batch(ids, 16, 20, np.random.default_rng(5))
    assert x.shape == y.shape == (16, 20) and x.dtype == np.int32
    np.testing.assert_array_equal(np.diff(x, axis=1), 3)          # contiguous windows
    np.testing.assert_array_equal(y[:, :-1], x[:, 1:])             # y is x shifted by one
    np.testing.assert_array_equal(y[:, -1], x[:, -1] + 3)
    x2, y2 = data.get_batch(ids, 16, 20, np.random.default_rng(5))
    np.testing.assert_array_equal(x, x2)
    x3, _ = data.get_batch(ids, 16, 20, np.random.default_rng(6))
    assert not np.array_equal(x, x3)
    # every start in [0, N - T) is reachable, and no window runs past the end
    starts = np.concatenate([data.get_batch(np.arange(30), 64, 20, np.random.default_rng(s))[0][:, 0]
                             for s in range(20)])
    assert set(starts.tolist()) == set(range(10))


@pytest.mark.parametrize("kwargs, needle", [
    (dict(ids=np.arange(10)), "seq_len=10"), (dict(ids=np.zeros((4, 40))), "1-D"),
    (dict(batch_size=0), "batch_size"), (dict(seq_len=2.5), "seq_len"),
])
def test_get_batch_refuses_bad_arguments(kwargs, needle):
    kw = dict(ids=np.arange(100), batch_size=2, seq_len=10, rng=np.random.default_rng(0))
    kw.update(kwargs)
    with pytest.raises(ValueError, match=needle):
        data.get_batch(**kw)


def test_split_refuses_bad_fractions():
    for f in (0.0, 1.0, 1.5, "0.9"):
        with pytest.raises(ValueError, match="train_fraction"):
            data.split(np.arange(10), f)
