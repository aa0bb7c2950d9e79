"""``tests/wheel_sources.py`` reads a wheel as it streams: the wanted members come out equal to
``zipfile``'s own extraction, the rest never reach the disk, a wrong sha256 or a corrupted member
fails, and a layout it does not handle is reported (so pip download takes over)."""

from __future__ import annotations

import hashlib
import io
import os
import sys
import zipfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import wheel_sources as ws  # noqa: E402

MEMBERS = {
    "pkg/__init__.py": b"x = 1\n" * 5000,
    "pkg/big.so": os.urandom(3 << 20),  # larger than one read chunk, not wanted
    "pkg/sub/mod.py": os.urandom(200) + b"def f(): pass\n" * 3000,
    "pkg-1.0.dist-info/METADATA": b"Name: pkg\nVersion: 1.0\n",
    "pkg-1.0.dist-info/RECORD": b"",
}


def _wheel(path, stream=False):
    raw = open(path, "wb")

    class Unseekable(io.RawIOBase):  # zipfile then writes data descriptors (flag 0x08)
        def writable(self):
            return True

        def write(self, b):
            return raw.write(b)

    with zipfile.ZipFile(Unseekable() if stream else raw, "w") as z:
        for i, (name, data) in enumerate(MEMBERS.items()):
            z.writestr(name, data, zipfile.ZIP_STORED if i % 2 == 0 else zipfile.ZIP_DEFLATED)
    raw.close()
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_stream_extract_writes_the_wanted_members_only(tmp_path):
    sha = _wheel(tmp_path / "w.whl")
    out = tmp_path / "out"
    out.mkdir()
    ws._stream_extract((tmp_path / "w.whl").as_uri(), sha, str(out))
    got = {
        os.path.relpath(os.path.join(d, f), out): open(os.path.join(d, f), "rb").read()
        for d, _, fs in os.walk(out)
        for f in fs
    }
    assert got == {k: v for k, v in MEMBERS.items() if ws.wanted(k)}
    assert len(got) == 3


def test_stream_extract_checks_the_archive_hash_and_each_member(tmp_path):
    _wheel(tmp_path / "w.whl")
    with pytest.raises(AssertionError, match="sha256 mismatch"):
        ws._stream_extract((tmp_path / "w.whl").as_uri(), "0" * 64, str(tmp_path))
    data = bytearray(open(tmp_path / "w.whl", "rb").read())
    i = data.index(b"def f(): pass")  # a stored member's bytes
    data[i] ^= 1
    open(tmp_path / "bad.whl", "wb").write(bytes(data))
    with pytest.raises(AssertionError, match="CRC or size mismatch"):
        ws._stream_extract((tmp_path / "bad.whl").as_uri(), None, str(tmp_path / "bad"))


def test_data_descriptors_are_reported_not_misread(tmp_path):
    _wheel(tmp_path / "s.whl", stream=True)
    with pytest.raises(ws._Unhandled, match="data descriptor"):
        ws._stream_extract((tmp_path / "s.whl").as_uri(), None, str(tmp_path / "o"))


def _index_reachable() -> bool:
    import socket
    import urllib.parse

    url = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple")
    try:
        socket.create_connection((urllib.parse.urlparse(url).hostname, 443), timeout=5).close()
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _index_reachable(), reason="needs the package index (this machine has no network: the GPU one)")
def test_pip_download_is_the_fallback_without_a_json_api(tmp_path, monkeypatch):
    """An index without PEP 691 JSON (``wheel_url`` raises an ``OSError``): ``pip download`` fetches the
    wheel and the same members are written (a small real wheel from the index)."""

    def no_json(dist, version):
        raise OSError("HTTP Error 404: no JSON API here")

    monkeypatch.setattr(ws, "wheel_url", no_json)
    monkeypatch.setattr(ws, "SRC_CACHE", str(tmp_path))
    dest = ws.wheel_sources("six", "1.16.0")
    assert os.path.isfile(os.path.join(dest, "six.py")) and os.path.isfile(os.path.join(dest, ".complete"))
    assert os.path.isfile(os.path.join(dest, "six-1.16.0.dist-info", "METADATA"))
    assert not any(f.endswith(".whl") for _, _, fs in os.walk(tmp_path) for f in fs)  # the wheel is not kept
