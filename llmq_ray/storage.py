"""Every path a user gives, local or a URI, through one door: ``pyarrow.fs`` (fsspec for schemes it lacks).

``s3://bucket/run/ckpt``, ``gs://...``, ``hdfs://...``, ``file:///abs/path`` and plain local paths all resolve
to a (filesystem, path) pair here, so no other module parses schemes, and nothing is ever written under a local
folder named after a URI (a path that looks like ``s3://...`` is never handed to ``os``). A scheme that neither
pyarrow nor an installed fsspec implementation handles is refused in one sentence naming the flag.

Object-store endpoints and credentials come from the environment, as the cloud SDKs read them
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``, ``GOOGLE_APPLICATION_CREDENTIALS``, ...), or from
the URI's query (``s3://bucket/x?endpoint_override=host:9000&scheme=http``, pyarrow's S3 options); a query is
kept on every URI derived from the one given.

Token shards on an object store are read through a local cache (``fetch``): each node downloads a shard once
into its cache folder (``cache_root``: the node's ``$LLMQ_RAY_CACHE``, else the driver's, else
``~/.cache/llmq_ray``) under ``remote/``, keyed by the URI, its size and its
modification time, written to a temporary name and renamed, then memory-maps it like any local shard. Why a
cache rather than range reads: the data pipeline reads windows at random offsets every step, which on an object
store would be one request per window; one sequential download per shard per node costs less and keeps the exact
same reading code (and so the same order and bit-exact resume) for local and remote data.

What a run writes to a store is written locally first and uploaded whole: checkpoint shards
(llmq_ray/checkpoints/remote.py), the run log (llmq_ray/observe/runlog.py: a staging copy uploaded at every flush)
and the HF export (llmq_ray/model/hf_io.py: a staging folder uploaded with a completion marker last), staged under
``cache_root()/staging`` (``staging_dir``).
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Optional

from llmq_ray.errors import ConfigError, DataError

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")


def _named(what: str, path: str) -> str:
    """How an error sentence names the value: ``--flag='value'``, or just ``'value'`` when ``what`` is empty."""
    return f"{what}={path!r}" if what else repr(path)
_GLOB_CHARS = re.compile(r"[*?\[]")


def scheme_of(path: str) -> Optional[str]:
    """The URI scheme of ``path`` (lower case), or None for a plain local path."""
    m = _SCHEME.match(path)
    return m.group(1).lower() if m else None


def is_remote(path: str) -> bool:
    """True for a URI other than ``file://`` (an object store or a distributed file system)."""
    s = scheme_of(path)
    return s is not None and s != "file"


def _split_query(uri: str) -> tuple[str, str]:
    base, sep, query = uri.partition("?")
    return base, (sep + query) if sep else ""


def split_query(path: str) -> tuple[str, str]:
    """(``path`` without its query, the query with its "?" or ""); a local path comes back whole."""
    return _split_query(path) if is_remote(path) else (path, "")


def filesystem(path: str, what: str = "path"):
    """(pyarrow filesystem, path inside it) for a local path or a URI. ConfigError naming ``what`` (the flag)
    when no filesystem handles the scheme."""
    import pyarrow.fs as pafs

    s = scheme_of(path)
    if s is None:
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path))
    try:
        return pafs.FileSystem.from_uri(path)
    except Exception as exc:  # ArrowInvalid: an unknown scheme or a malformed URI; OSError: the store's endpoint
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "Unrecognized filesystem type" not in first:
            if isinstance(exc, OSError):  # e.g. the bucket's region lookup failed: endpoint or network
                raise ConfigError(f"{_named(what, path)}: cannot reach it ({first}).") from None
            raise ConfigError(f"{_named(what, path)} is not a valid {s}:// URI ({first}).") from None
    try:
        import fsspec
        from pyarrow.fs import FSSpecHandler, PyFileSystem

        fs = fsspec.filesystem(s)
    except (ImportError, ValueError):
        raise ConfigError(f"{_named(what, path)}: no filesystem handles {s}:// (pyarrow knows file, s3, gs and hdfs; "
                          f"other schemes need fsspec and its {s} package installed).") from None
    return PyFileSystem(FSSpecHandler(fs)), fs._strip_protocol(_split_query(path)[0])


def join(base: str, *parts: str) -> str:
    """``base``/``parts`` for a local path or a URI (a URI's query stays at the end)."""
    if scheme_of(base) is None:
        return os.path.join(base, *parts)
    root, query = _split_query(base)
    return "/".join([root.rstrip("/"), *(p.strip("/") for p in parts)]) + query


def _uri(template: str, inner: str) -> str:
    """The URI of ``inner`` (a path inside the filesystem of URI ``template``), with the template's query."""
    root, query = _split_query(template)
    return f"{scheme_of(root)}://{inner.lstrip('/')}{query}"


PROBE_RETRY_S = 15  # how long the check before a run retries a Google Cloud Storage call (gs:// URIs)


def _probe_uri(uri: str) -> str:
    """``uri`` for a quick check: pyarrow's GCS filesystem retries a failing call for 15 minutes by default (e.g.
    no credentials: it keeps asking the metadata server of a machine outside Google Cloud), which would hang the
    check before a run; the check gives up after ``PROBE_RETRY_S`` unless the URI sets ``retry_limit_seconds``
    itself. The run's own calls keep the default, which rides out a store's short outages."""
    if scheme_of(uri) not in ("gs", "gcs") or "retry_limit_seconds=" in uri:
        return uri
    base, query = _split_query(uri)
    return f"{base}{query or '?'}{'&' if query else ''}retry_limit_seconds={PROBE_RETRY_S}"


def check_reachable(path: str, what: str = "path") -> None:
    """One ConfigError sentence when the filesystem behind ``path`` cannot be reached (a wrong endpoint, no
    credentials) within a bounded time (``_probe_uri``); nothing is written. ``path`` may be a glob (the
    literal path is looked up: a missing one is fine, an unreachable store is not)."""
    fs, inner = filesystem(_probe_uri(path), what)
    try:
        fs.get_file_info(inner)
    except OSError as exc:
        raise ConfigError(f"{_named(what, path)}: cannot reach it ({str(exc).splitlines()[0]}).") from None


def glob(pattern: str, what: str = "path") -> list[str]:
    """The files a glob matches on any filesystem, sorted: plain paths for local patterns, URIs (with the
    pattern's query) for URI patterns. ``**`` matches across folders, as in ``glob.glob(recursive=True)``."""
    import pyarrow.fs as pafs

    if scheme_of(pattern) in (None, "file"):
        import glob as _glob

        local = filesystem(pattern, what)[1] if scheme_of(pattern) == "file" else os.path.expanduser(pattern)
        return sorted(os.path.abspath(m) for m in _glob.glob(local, recursive=True) if os.path.isfile(m))
    fs, inner = filesystem(pattern, what)
    parts = inner.split("/")
    fixed = []
    for p in parts:
        if _GLOB_CHARS.search(p):
            break
        fixed.append(p)
    base = "/".join(fixed)
    if len(fixed) == len(parts):  # no wildcard: the path itself, if it is a file
        info = fs.get_file_info(inner)
        return [_uri(pattern, inner)] if info.type == pafs.FileType.File else []
    rest = "/".join(parts[len(fixed):])
    try:
        infos = fs.get_file_info(pafs.FileSelector(base, recursive="**" in rest or "/" in rest, allow_not_found=True))
    except OSError as exc:
        raise DataError(f"cannot list {_uri(pattern, base)} ({str(exc).splitlines()[0]}).") from None
    regex = re.compile(_glob_regex(rest))
    out = [_uri(pattern, i.path) for i in infos
           if i.type == pafs.FileType.File and regex.fullmatch(i.path[len(base):].lstrip("/"))]
    return sorted(out)


def _glob_regex(pattern: str) -> str:
    """A regular expression for a path glob: ``*`` and ``?`` stay inside one folder, ``**/`` spans folders,
    ``[...]`` is a character class."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 2:]:
            j = pattern.index("]", i + 2)
            body = pattern[i + 1:j]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            i = j + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return "".join(out)


# the driver's LLMQ_RAY_CACHE, as the actors receive it (llmq_ray/train/trainer.py ``forwarded_env``)
DRIVER_CACHE_ENV = "LLMQ_RAY_DRIVER_CACHE"


def cache_root() -> str:
    """Where remote files are cached and uploads staged on this node: the node's own ``$LLMQ_RAY_CACHE`` (in the
    environment its Ray was started with), else the driver's (forwarded as ``$LLMQ_RAY_DRIVER_CACHE``), else
    ``~/.cache/llmq_ray``. The node's own setting wins because the cache is a folder on the node's disk: a path
    that exists on the driver's machine need not exist, or be fast, on another."""
    return (os.environ.get("LLMQ_RAY_CACHE") or os.environ.get(DRIVER_CACHE_ENV)
            or os.path.join(os.path.expanduser("~"), ".cache", "llmq_ray"))


def fetch(uri: str, what: str = "path") -> str:
    """A local copy of the remote file ``uri`` (module docstring): downloaded once per node into the cache
    (temporary name, then rename: never a half file under the final name), reused while the object's size and
    modification time are unchanged. Returns its local path."""
    import pyarrow.fs as pafs

    fs, inner = filesystem(uri, what)
    info = fs.get_file_info(inner)
    if info.type != pafs.FileType.File:
        raise DataError(f"{uri} is not a file.")
    stamp = f"{_split_query(uri)[0]}|{info.size}|{info.mtime_ns}"
    key = hashlib.sha256(stamp.encode()).hexdigest()[:20]
    folder = os.path.join(cache_root(), "remote")
    os.makedirs(folder, exist_ok=True)
    local = os.path.join(folder, f"{key}-{os.path.basename(inner)}")
    if os.path.isfile(local) and os.path.getsize(local) == info.size:
        return local
    try:
        download(uri, local)
    except OSError as exc:
        raise DataError(f"cannot download {uri} ({str(exc).splitlines()[0]}).") from None
    return local


# ---------------------------------------------------------------------------------------------------- small verbs
def read_bytes(uri: str) -> bytes:
    fs, inner = filesystem(uri)
    with fs.open_input_stream(inner) as f:
        return f.read()


def write_bytes(uri: str, data: bytes) -> None:
    """One object written whole (object stores publish it only when the upload completes)."""
    fs, inner = filesystem(uri)
    with fs.open_output_stream(inner) as f:
        f.write(data)


def upload(local_path: str, uri: str) -> None:
    """Copy a local file to ``uri`` (streamed, 16 MiB at a time)."""
    fs, inner = filesystem(uri)
    with open(local_path, "rb") as src, fs.open_output_stream(inner) as dst:
        while True:
            chunk = src.read(16 << 20)
            if not chunk:
                break
            dst.write(chunk)


def download(uri: str, local_path: str) -> None:
    """Copy ``uri`` to ``local_path`` through a temporary name and a rename (never a half file there)."""
    fs, inner = filesystem(uri)
    tmp = f"{local_path}.partial-{os.getpid()}"
    try:
        with fs.open_input_stream(inner) as src, open(tmp, "wb") as dst:
            while True:
                chunk = src.read(16 << 20)
                if not chunk:
                    break
                dst.write(chunk)
        os.replace(tmp, local_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def size_of(uri: str) -> Optional[int]:
    """The size of the file at ``uri`` (None when there is none)."""
    import pyarrow.fs as pafs

    fs, inner = filesystem(uri)
    info = fs.get_file_info(inner)
    return info.size if info.type == pafs.FileType.File else None


def list_names(uri: str) -> list[str]:
    """The names directly under ``uri`` (files and "folders", i.e. common prefixes), sorted; [] when none."""
    import pyarrow.fs as pafs

    fs, inner = filesystem(uri)
    infos = fs.get_file_info(pafs.FileSelector(inner, recursive=False, allow_not_found=True))
    return sorted(i.base_name for i in infos)


def exists(uri: str) -> bool:
    """Something is at ``uri``: a file, or a folder (on an object store: a prefix with objects under it)."""
    import pyarrow.fs as pafs

    fs, inner = filesystem(uri)
    return fs.get_file_info(inner).type != pafs.FileType.NotFound


def copy_file(src: str, dst: str) -> None:
    """Copy one file from ``src`` to ``dst`` (URIs or local paths): inside one store a server-side copy, else
    (another store, or a store that refuses the copy, e.g. an S3 object above 5 GB) streamed through here."""
    fs, inner = filesystem(src)
    dfs, dinner = filesystem(dst)
    if scheme_of(src) == scheme_of(dst) and _split_query(src)[1] == _split_query(dst)[1]:
        try:
            fs.copy_file(inner, dinner)
            return
        except OSError:
            pass
    with fs.open_input_stream(inner) as a, dfs.open_output_stream(dinner) as b:
        while True:
            chunk = a.read(16 << 20)
            if not chunk:
                break
            b.write(chunk)


def list_files(uri: str) -> list[str]:
    """The files under ``uri`` (every depth), as paths relative to it, sorted; [] when there is nothing."""
    import pyarrow.fs as pafs

    fs, inner = filesystem(uri)
    infos = fs.get_file_info(pafs.FileSelector(inner, recursive=True, allow_not_found=True))
    base = inner.rstrip("/") + "/"
    return sorted(i.path[len(base):] for i in infos if i.type == pafs.FileType.File and i.path.startswith(base))


def staging_dir(kind: str) -> str:
    """A new empty local folder under this node's cache (``cache_root()/staging``) for a file or folder that is
    written here and then uploaded to a URI (the run log, an export). The caller removes it."""
    import tempfile

    base = os.path.join(cache_root(), "staging")
    os.makedirs(base, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"{kind}-", dir=base)


def delete_tree(uri: str) -> None:
    """Remove ``uri`` and everything under it (no error when it is absent)."""
    import pyarrow.fs as pafs

    fs, inner = filesystem(uri)
    info = fs.get_file_info(inner)
    if info.type == pafs.FileType.Directory:
        fs.delete_dir(inner)
    elif info.type == pafs.FileType.File:
        fs.delete_file(inner)
