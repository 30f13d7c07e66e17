"""The codec timings run in several threads at once (an evacuation samples its
domains side by side): python-zstandard's compressors are not thread-safe, and one
shared by two threads crashed the process. Run in a child so that a crash fails the
test instead of ending pytest."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import os, threading
from livemig.policy import encoding
pages = [os.urandom(2048) + bytes(2048) for _ in range(256)]
def work():
    for _ in range(20):
        encoding.measure_codecs(pages, frozenset({"zstd", "lz4"}))
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("ok")
"""


def test_codecs_are_timed_in_many_threads_at_once() -> None:
    p = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "ok", (p.returncode, p.stderr[-500:])
