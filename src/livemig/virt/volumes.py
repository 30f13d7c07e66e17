"""A copied disk's two images compared through libvirt's storage API, on any hosts.

After a ``--storage copy`` migration with ``VIR_MIGRATE_PAUSED`` both images are
quiescent: the source QEMU is gone and the destination domain is held paused. Each
daemon streams its own image (``virStorageVolDownload`` with the sparse flag: holes
cross the wire as a length and read as zeros) and livemig digests it per 1 MiB as it
arrives (``chunks.ChunkHasher``), both sides at once, one thread each: nothing is
held in memory or written to disk but the digest lists. On a difference the first
differing chunk is read again from both (a ranged download of 1 MiB) to name the
first differing byte.

The image must be a volume of a storage pool on its host (``storageVolLookupByPath``
after refreshing the pools over its directory): a disk outside every pool is
skipped with what to define. Only raw images are compared: a qcow2 file is a
container whose bytes differ between two correct copies.
"""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from livemig.errors import LivemigError
from livemig.virt.chunks import (
    CHUNK,
    ChunkDiff,
    ChunkHasher,
    Digests,
    chunk_range,
    diff_chunks,
    first_differing_byte,
)
from livemig.virt.conn import libvirt_module, message

METHOD = "libvirt volume stream (virStorageVolDownload, sparse, SHA-256 per 1 MiB)"
MAX_LISTED = 16  # differing chunks named in the report
GIB = 1 << 30


class Skipped(Exception):
    """The disk cannot be compared this way (one line: why)."""


def _host(conn: Any) -> str:
    with contextlib.suppress(Exception):
        return str(conn.getHostname())
    return "the host"


def _refresh_pools_over(conn: Any, directory: str) -> int:
    """Refresh the active pools whose target is ``directory`` (a file created since
    the last refresh is unknown to its pool); how many there were."""
    import xml.etree.ElementTree as ET

    lv = libvirt_module()
    n = 0
    for pool in conn.listAllStoragePools(lv.VIR_CONNECT_LIST_STORAGE_POOLS_ACTIVE):
        with contextlib.suppress(lv.libvirtError, ET.ParseError):
            target = ET.fromstring(pool.XMLDesc(0)).findtext("./target/path") or ""
            if os.path.normpath(target) == directory:
                n += 1
                pool.refresh(0)
    return n


def volume(conn: Any, path: str) -> Any:
    """The storage volume of ``path`` on ``conn``'s host, or Skipped saying why."""
    lv = libvirt_module()
    directory = os.path.dirname(os.path.normpath(path))
    try:
        pools = _refresh_pools_over(conn, directory)
    except lv.libvirtError as e:
        raise Skipped(f"{_host(conn)}: cannot list its storage pools: {message(e)}") from None
    try:
        return conn.storageVolLookupByPath(path)
    except lv.libvirtError as e:
        if pools:
            raise Skipped(f"{path} on {_host(conn)}: {message(e)}") from None
        raise Skipped(f"{path} is in no storage pool on {_host(conn)}: define a dir pool "
                      f"over {directory} (virsh pool-define-as NAME dir --target "
                      f"{directory}; virsh pool-start NAME)") from None


def digest_volume(conn: Any, vol: Any) -> tuple[Digests, float]:
    """The volume's per-chunk digests, streamed; and the seconds it took."""
    lv = libvirt_module()
    t0 = time.monotonic()
    h = ChunkHasher(CHUNK)
    stream = conn.newStream(0)
    try:
        vol.download(stream, 0, 0, lv.VIR_STORAGE_VOL_DOWNLOAD_SPARSE_STREAM)
        stream.sparseRecvAll(lambda _s, buf, _o: h.data(buf),
                             lambda _s, length, _o: h.hole(length), None)
        stream.finish()
    except BaseException:
        with contextlib.suppress(Exception):
            stream.abort()
        raise
    return h.finish(), time.monotonic() - t0


def read_range(conn: Any, vol: Any, offset: int, length: int) -> bytes:
    """``length`` bytes of the volume from ``offset`` (short at its end)."""
    if length <= 0:
        return b""  # a download of length 0 would mean "to the end"
    buf = bytearray()
    stream = conn.newStream(0)
    try:
        vol.download(stream, offset, length, 0)
        stream.recvAll(lambda _s, data, _o: buf.extend(data), None)
        stream.finish()
    except BaseException:
        with contextlib.suppress(Exception):
            stream.abort()
        raise
    return bytes(buf[:length])


def flip_byte(conn: Any, vol: Any, offset: int) -> None:
    """Testing only: invert one byte of the volume through libvirt (upload)."""
    size = int(vol.info()[1])
    if not 0 <= offset < size:
        raise LivemigError(f"--inject-fault disk-byte@{offset:#x} is beyond the "
                           f"destination's image ({size} bytes)")
    old = read_range(conn, vol, offset, 1)
    stream = conn.newStream(0)
    try:
        vol.upload(stream, offset, 1, 0)
        stream.send(bytes([old[0] ^ 0xFF]))
        stream.finish()
    except BaseException:
        with contextlib.suppress(Exception):
            stream.abort()
        raise


def compare_volume(src_conn: Any, dst_conn: Any, path: str,
                   fault: int | None = None) -> dict[str, Any]:
    """One copied disk: ``ok`` or ``mismatch`` with the first differing chunk and
    byte, its size and what it cost; Skipped when it cannot be read this way."""
    lv = libvirt_module()
    src_vol, dst_vol = volume(src_conn, path), volume(dst_conn, path)
    try:
        if fault is not None:
            flip_byte(dst_conn, dst_vol, fault)
        t0 = time.monotonic()
        with ThreadPoolExecutor(2, thread_name_prefix="disk-digest") as ex:
            a = ex.submit(digest_volume, src_conn, src_vol)
            b = ex.submit(digest_volume, dst_conn, dst_vol)
            (da, ta), (db, tb) = a.result(), b.result()
        res = cost(da.size, ta, tb, time.monotonic() - t0)
        diff = diff_chunks(da, db)
        if diff.equal:
            return {"result": "ok", **res}
        return {"result": "mismatch", **res,
                **drill_down(src_conn, src_vol, dst_conn, dst_vol, diff)}
    except lv.libvirtError as e:
        raise Skipped(f"{path}: reading it through libvirt failed: {message(e)}") from None
    except (RuntimeError, ValueError, TypeError) as e:  # the binding's stream loop
        raise Skipped(f"{path}: reading it through libvirt failed: {e}") from None


def cost(size: int, src_s: float, dst_s: float, wall_s: float,
         method: str = METHOD) -> dict[str, Any]:
    """What reading both copies took, per side and per GiB (every copied-disk method)."""
    gib = size / GIB
    return {"method": method, "bytes": size, "chunk_size": CHUNK,
            "source_s": round(src_s, 3), "destination_s": round(dst_s, 3),
            "wall_s": round(wall_s, 3),
            "cost_s_per_gib": {"source": round(src_s / gib, 3) if gib else None,
                               "destination": round(dst_s / gib, 3) if gib else None}}


def drill_down(src_conn: Any, src_vol: Any, dst_conn: Any, dst_vol: Any,
               diff: ChunkDiff) -> dict[str, Any]:
    """Name the differing chunks and the first differing byte (re-reading the first
    differing chunk from both)."""
    size_a, size_b = diff.sizes
    out: dict[str, Any] = {
        "chunks": diff.chunks, "mismatched_chunks": len(diff.differing),
        "first_mismatched_chunks": [f"{i * CHUNK:#x}" for i in diff.differing[:MAX_LISTED]],
    }
    if size_a != size_b:
        out["sizes"] = {"source": size_a, "destination": size_b}
    first = diff.first
    if first is None:  # equal digests, different sizes: they differ where one ends
        out["first_differing_byte"] = f"{min(size_a, size_b):#x}"
        return out
    start, end = chunk_range(first, CHUNK, max(size_a, size_b))
    a = read_range(src_conn, src_vol, start, min(end, size_a) - start)
    b = read_range(dst_conn, dst_vol, start, min(end, size_b) - start)
    byte = first_differing_byte(a, b)
    out["first_differing_chunk"] = {"index": first, "range": [f"{start:#x}", f"{end:#x}"]}
    # None: the chunk read back equal (it changed since it was digested)
    out["first_differing_byte"] = None if byte is None else f"{start + byte:#x}"
    return out
