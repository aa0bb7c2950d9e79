"""Python sources of a PyPI release, from its wheel, for checks that read code without importing
it (a CUDA-only engine or library on a machine without a GPU): the ``.py`` files and ``METADATA``
unpacked once to ``.venvs/engine-src/<dist>-<version>`` (``ATTNPLUG_ENGINE_SRC`` moves that folder).

The wheel is streamed from the index (PEP 691 JSON at ``PIP_INDEX_URL``, default PyPI) and its
local file entries are read in order as they arrive: only the wanted members touch the disk, the
archive's sha256 (from the index) and each member's CRC are checked before the folder is marked
complete. A vLLM CUDA wheel is ~340 MB and its sources ~60 MB, so a test machine with little disk
left still runs the check. Where the index has no JSON API, the stream breaks, or the wheel's layout
is one this reader does not take (sizes after the data), ``pip download --no-deps`` is the fallback
(the wheel then sits on disk until unpacked); a wrong hash or CRC fails."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import struct
import subprocess
import sys
import urllib.request
import zipfile
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC_CACHE = os.environ.get("ATTNPLUG_ENGINE_SRC", os.path.join(ROOT, ".venvs", "engine-src"))
CHUNK = 1 << 20


def wanted(name: str) -> bool:
    return name.endswith(".py") or name.endswith("METADATA")


def wheel_sources(dist: str, version: str) -> str:
    """Folder with ``dist==version``'s Python sources (and ``METADATA``) from its PyPI wheel."""
    dest = os.path.join(SRC_CACHE, f"{dist}-{version}")
    if os.path.isfile(os.path.join(dest, ".complete")):
        return dest
    tmp = dest + ".download"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        _stream_extract(*wheel_url(dist, version), tmp)
    except (OSError, ValueError, KeyError, _Unhandled) as e:  # no PEP 691 JSON, a cut stream, a layout not read
        print(f"wheel_sources: {dist}=={version} through pip download ({e})")
        shutil.rmtree(tmp)
        os.makedirs(tmp)
        _pip_download(dist, version, tmp)
    shutil.rmtree(dest, ignore_errors=True)
    os.rename(tmp, dest)
    open(os.path.join(dest, ".complete"), "w").close()
    return dest


def wheel_url(dist: str, version: str) -> tuple[str, str | None]:
    """URL and sha256 of ``dist==version``'s wheel on the index: a pure-Python wheel if there is
    one, else the one built for this machine's architecture, else the first listed."""
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    req = urllib.request.Request(f"{index}/{dist}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        files = json.load(r)["files"]
    prefix = f"{dist.replace('-', '_')}-{version}-"
    wheels = [f for f in files if f["filename"].endswith(".whl") and f["filename"].startswith(prefix)]
    assert wheels, f"no wheel of {dist}=={version} on {index}"
    arch = platform.machine()
    best = min(wheels, key=lambda f: (not f["filename"].endswith("-none-any.whl"), arch not in f["filename"]))
    return best["url"], best.get("hashes", {}).get("sha256")


class _Unhandled(Exception):
    """A wheel layout the streaming reader does not handle (pip download takes over)."""


class _Reader:
    """Reads a byte stream exactly, hashing every byte that passes."""

    def __init__(self, stream):
        self.stream, self.sha = stream, hashlib.sha256()

    def read(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            b = self.stream.read(min(n - len(out), CHUNK))
            if not b:
                break
            out += b
        self.sha.update(out)
        return bytes(out)

    def exact(self, n: int) -> bytes:
        b = self.read(n)
        assert len(b) == n, f"wheel stream ended early ({len(b)} of {n} bytes)"
        return b

    def drain(self) -> None:
        while self.read(CHUNK):
            pass


def _member_data(r: _Reader, method: int, csize: int, out) -> tuple[int, int]:
    """Copy one member's ``csize`` bytes of data, decompressed, to ``out`` (None: discard them);
    returns (crc32, size) of what was written."""
    if method not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise _Unhandled(f"zip compression method {method}")
    d = zlib.decompressobj(-15) if method == zipfile.ZIP_DEFLATED else None
    crc, size, left = 0, 0, csize
    while left:
        b = r.exact(min(left, CHUNK))
        left -= len(b)
        if out is not None:
            data = d.decompress(b) if d else b
            crc, size = zlib.crc32(data, crc), size + len(data)
            out.write(data)
    return crc, size


def _stream_extract(url: str, sha256: str | None, dest: str, want=wanted) -> None:
    """Unpack the members of the wheel at ``url`` that ``want(name)`` takes into ``dest`` while it
    downloads."""
    with urllib.request.urlopen(url, timeout=300) as resp:
        r = _Reader(resp)
        n = 0
        while True:
            sig = r.exact(4)
            if sig != b"PK\x03\x04":  # the central directory (or end record) follows the last member
                break
            _, flags, method, _, _, crc, csize, usize, nlen, xlen = struct.unpack("<HHHHHIIIHH", r.exact(26))
            name = r.exact(nlen).decode("utf-8" if flags & 0x800 else "cp437")
            extra = r.exact(xlen)
            if flags & 0x08:
                raise _Unhandled(f"{name}: sizes after the data (data descriptor)")
            if 0xFFFFFFFF in (csize, usize):  # zip64: the sizes are in extra field 0x0001
                i = 0
                while i + 4 <= len(extra):
                    hid, hlen = struct.unpack("<HH", extra[i : i + 4])
                    if hid == 1:
                        vals = list(struct.unpack(f"<{hlen // 8}Q", extra[i + 4 : i + 4 + hlen // 8 * 8]))
                        usize = vals.pop(0) if usize == 0xFFFFFFFF else usize
                        csize = vals.pop(0) if csize == 0xFFFFFFFF else csize
                    i += 4 + hlen
            path = os.path.join(dest, name)
            assert os.path.realpath(path).startswith(os.path.realpath(dest) + os.sep), f"unsafe member {name}"
            if want(name):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as out:
                    got_crc, got_size = _member_data(r, method, csize, out)
                assert (got_crc, got_size) == (crc, usize), f"{name}: CRC or size mismatch"
                n += 1
            else:
                _member_data(r, method, csize, None)
        r.drain()
    assert sha256 is None or r.sha.hexdigest() == sha256, f"{url}: sha256 mismatch"
    assert n, f"{url}: no Python sources in the wheel"


def _pip_download(dist: str, version: str, dest: str) -> None:
    wheel_dir = dest + ".whl"
    shutil.rmtree(wheel_dir, ignore_errors=True)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-cache-dir",
            "-q",
            f"{dist}=={version}",
            "-d",
            wheel_dir,
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    wheels = [f for f in os.listdir(wheel_dir) if f.endswith(".whl")] if os.path.isdir(wheel_dir) else []
    assert r.returncode == 0 and wheels, f"could not download {dist}=={version}: {r.stderr[-2000:]}"
    with zipfile.ZipFile(os.path.join(wheel_dir, wheels[0])) as z:
        z.extractall(dest, [m for m in z.namelist() if wanted(m)])
    shutil.rmtree(wheel_dir)
