"""The identity of a model's weights, for the KV namespace: a changed checkpoint at the same path is a miss.

``weights_identity(model)`` digests what computed the KV beyond the config: for every weight file of the model
(``*.safetensors``, ``*.bin``, ``*.pt``, ``*.gguf``; sorted by name) its name, its size, its first 64 KiB (a
safetensors header: every tensor's name, dtype, shape and offsets) and ``SAMPLES`` chunks of 4 KiB spread evenly
over the rest — the weights' own bytes, so a checkpoint with the same shapes and other values (a fine-tune, a
re-initialisation) gets another identity while a byte-identical copy on another node gets the same one. It reads
about 130 KiB per file, never the whole weights, and is cached per process by (path, size, mtime) of every file.
A Hugging Face id resolves to its local snapshot (``huggingface_hub``'s cache); one that has none is identified by
its id and revision. Who calls it: the connector's worker (``kvpool.connector.worker``), whose layout fingerprint
(``kvpool.connector.layout.model_digest``) takes it, and with it every block key of the model (issue 16, item 4).
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
HEAD_BYTES = 64 << 10
SAMPLE_BYTES = 4 << 10
SAMPLES = 16


def _weight_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def _stamp(files: list[Path]) -> tuple[tuple[str, int, int], ...]:
    out = []
    for p in files:
        st = p.stat()
        out.append((str(p), st.st_size, st.st_mtime_ns))
    return tuple(out)


@functools.lru_cache(maxsize=32)
def _digest(stamp: tuple[tuple[str, int, int], ...]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for path, size, _mtime in stamp:
        h.update(f"{Path(path).name}\0{size}\0".encode())
        with open(path, "rb") as f:
            h.update(f.read(HEAD_BYTES))
            rest = size - HEAD_BYTES
            if rest > 0:
                for i in range(SAMPLES):
                    f.seek(HEAD_BYTES + (rest * i) // SAMPLES)
                    h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def _local_snapshot(model: str, revision: str | None) -> Path | None:
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:  # noqa: BLE001 - not in the cache (or not an id): identified by name below
        return None


def weights_identity(model: str | os.PathLike[str], revision: str | None = None) -> str:
    """Hex digest of the model's weights (see the module doc)."""
    directory = _local_snapshot(str(model), revision)
    if directory is None:
        return "id:" + hashlib.blake2b(f"{model}@{revision or ''}".encode(), digest_size=16).hexdigest()
    files = _weight_files(directory)
    if not files:
        return "none:" + hashlib.blake2b(str(model).encode(), digest_size=16).hexdigest()
    return _digest(_stamp(files))
