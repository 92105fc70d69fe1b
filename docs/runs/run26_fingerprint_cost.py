"""Run 26 probe (issue 27): what the build fingerprint costs at install().

In a fresh interpreter: `sage_package.load()` twice (the first hashes every file, the second finds
each file's sha256 in the per-(path, size, mtime) cache), then `sage_qual.install()` as an app calls
it. Prints one JSON object: the seconds of each, the digest, the origin and the files hashed."""

import json
import time
from pathlib import Path

start = time.perf_counter()
import torch  # noqa: E402  (timed apart from the fingerprint)

import_s = time.perf_counter() - start
torch.cuda.init()
from sage_qual.kernels import sage_package  # noqa: E402

times = []
for _ in range(2):
    start = time.perf_counter()
    package = sage_package.load()
    times.append(time.perf_counter() - start)
start = time.perf_counter()
digest = sage_package.source_digest(package.module, [__import__(f"sageattention.{name}", fromlist=["_"])
                                                     for name in sorted(package.extensions)])
digest_warm_s = time.perf_counter() - start
sage_package._file_digest.cache_clear()
start = time.perf_counter()
sage_package.source_digest(package.module, [__import__(f"sageattention.{name}", fromlist=["_"])
                                            for name in sorted(package.extensions)])
digest_cold_s = time.perf_counter() - start

import sage_qual  # noqa: E402

start = time.perf_counter()
status = sage_qual.install()
install_s = time.perf_counter() - start
files = sorted(Path(package.module.__file__).parent.rglob("*.so"))
print(json.dumps({
    "torch_import_s": round(import_s, 3), "load_first_s": round(times[0], 4),
    "load_second_s": round(times[1], 4), "digest_cold_s": round(digest_cold_s, 4),
    "digest_warm_s": round(digest_warm_s, 5), "install_s": round(install_s, 4),
    "digest": package.source, "digest_again": digest, "origin": package.origin,
    "extensions": sorted(package.extensions), "enabled": status.enabled,
    "so_files": {p.name: p.stat().st_size for p in files},
}, indent=1))
