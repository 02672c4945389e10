"""Weight versions on the data plane: blobs in the run's object store (or a shared folder) and the
``WeightsPublished`` event that announces them. Bytes only: no torch here.

``publish_weights`` stores the blob, then publishes the event (de-duplicated per version), so a
worker that sees the event can always fetch the blob. ``fetch_weights`` returns the blob after
checking its size and SHA-256 against the event. ``latest_weights`` reads the last event, for a
worker that starts after some versions were published.

Same host, no copies: the trainer first writes each version into a tmpfs folder
(``local_folder``) and announces it with ``announce_local`` (``host`` set, no checksum: the bytes
never leave this machine's memory); a worker on that host loads the folder in place
(``local_copy``), and workers elsewhere wait for the object-store announcement of the version,
which the trainer publishes next, off its training path.

Held in one process: where the only rollout worker shares the trainer's process and its engine
took the version from the trainer's tensors, the trainer announces it with ``announce_held``
(``process://<worker id>``, ``host`` set) and writes no file; the file and its store copy are
made once another worker needs them (``trainer.publisher``).
"""

import asyncio
import functools
import hashlib
import io
import shutil
import socket
import time
from pathlib import Path
from urllib.parse import urlparse

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, ObjectMeta, ObjectMetaOptions
from nats.js.errors import NotFoundError
from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_STREAM_TEMPLATE

from broker import codec
from broker.client import session
from broker.exceptions import WeightsIntegrityError
from broker.messages import WeightsPublished
from broker.permissions import Principal
from broker.retry import TRANSIENT
from broker.subjects import RunNames

OBJSTORE = "objstore"
HELD = "process"
"""The location scheme of a version held in one process only: ``process://<worker id>``."""


KEEP_VERSIONS = 3
"""Blobs kept per run, the new one included: older ones are deleted before a new version is
stored, so the store never holds more than this many (size the store for them)."""


DEFAULT_CHUNK_BYTES = 512 * 1024
"""Object-store chunk size for weight blobs (nats-py's default is 128 KiB). It must stay below the
server's max_payload (1 MB unless configured)."""


PULL_BYTES = 32 * 1024 * 1024
"""About this many bytes of chunks are asked for per pull when fetching a blob."""
PULL_TIMEOUT_S = 30.0


def blob_name(version: int) -> str:
    return f"v{version}.safetensors"


def _blob_version(name: str) -> int | None:
    stem = name.removesuffix(".safetensors")
    if name == stem or not stem.startswith("v") or not stem[1:].isdigit():
        return None
    return int(stem[1:])


async def publish_weights(
    js: JetStreamContext,
    names: RunNames,
    version: int,
    blob: bytes,
    *,
    directory: Path | None = None,
    keep: int = KEEP_VERSIONS,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> WeightsPublished:
    """Delete the blobs older than the newest ``keep`` versions (this one included), store
    ``blob`` (safetensors bytes) as ``version`` and announce it on ``names.weights``.

    ``directory``: write the blob to this shared folder instead of the object store.
    """
    await _prune(js, names, directory, older_than=version - keep + 1)
    if directory is None:
        store = await js.object_store(names.weights_store)
        options = ObjectMetaOptions(max_chunk_size=chunk_bytes)
        await store.put(blob_name(version), blob, meta=ObjectMeta(options=options))
        location = f"{OBJSTORE}://{names.weights_store}/{blob_name(version)}"
    else:
        path = Path(directory) / blob_name(version)
        await asyncio.to_thread(_write_atomic, path, blob)
        location = path.resolve().as_uri()
    event = WeightsPublished(
        version=version,
        location=location,
        sha256=await _sha256(blob),
        size_bytes=len(blob),
        published_at=time.time(),
    )
    await js.publish(
        names.weights, codec.encode(event), headers=codec.headers(msg_id=f"weights-v{version}")
    )
    return event


@functools.cache
def host_id() -> str:
    """This machine as weight copies see it: host name and boot id (a reboot empties tmpfs)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


LOCAL_BLOB = "model.safetensors"


async def run_instance(js: JetStreamContext, names: RunNames) -> str:
    """Which incarnation of the run this broker holds, as a folder name: its weights stream's
    creation time. A run of the same name on another broker, or an earlier one whose host-local
    copies are still on this host, has another: the trainer keeps its copies under it
    (``<local_weights_dir>/<instance>/``), so that no run reads or removes another's."""
    created = (await js.stream_info(names.weights_stream)).created
    return created.strftime("%Y%m%dT%H%M%S.%fZ") if created is not None else "undated"


def local_folder(root: Path, names: RunNames, version: int) -> Path:
    """The folder of ``version``'s host-local copy: ``<root>/<run>/v<version>/``."""
    return Path(root) / names.run / f"v{version}"


async def announce_local(
    js: JetStreamContext, names: RunNames, version: int, folder: Path, *, keep: int = KEEP_VERSIONS
) -> WeightsPublished:
    """Announce the host-local copy in ``folder`` (written complete before this), then delete this
    run's local copies older than the newest ``keep`` versions."""
    blob = Path(folder) / LOCAL_BLOB
    size = (await asyncio.to_thread(blob.stat)).st_size
    event = await _announce_on_host(js, names, version, blob.resolve().as_uri(), size, "local")
    await asyncio.to_thread(_prune_local, Path(folder).parent, version - keep + 1)
    return event


async def announce_held(
    js: JetStreamContext, names: RunNames, version: int, worker_id: str
) -> WeightsPublished:
    """Announce ``version`` as held by ``worker_id``'s engine, in the trainer's own process
    (loaded there from the trainer's tensors): no file, nothing any other worker can load."""
    return await _announce_on_host(js, names, version, f"{HELD}://{worker_id}", 0, "held")


async def _announce_on_host(
    js: JetStreamContext, names: RunNames, version: int, location: str, size: int, kind: str
) -> WeightsPublished:
    """Publish a copy of ``version`` that only this host can reach (``host`` set, no digest),
    deduplicated per version and ``kind``."""
    event = WeightsPublished(
        version=version,
        location=location,
        sha256=None,
        size_bytes=size,
        published_at=time.time(),
        host=host_id(),
    )
    headers = codec.headers(msg_id=f"weights-v{version}-{kind}")
    await js.publish(names.weights, codec.encode(event), headers=headers)
    return event


def _prune_local(run_folder: Path, older_than: int) -> None:
    for path, version in _local_versions(run_folder):
        if version < older_than:
            shutil.rmtree(path, ignore_errors=True)  # a worker loading it keeps its open mapping


def newest_local(root: Path, names: RunNames) -> int:
    """The newest version with a host-local copy of the run under ``root`` (0: none). The
    weights stream keeps one message, which may be an older version's object-store announcement
    that landed after this one's local announcement."""
    return max((v for _, v in _local_versions(Path(root) / names.run)), default=0)


def _local_versions(run_folder: Path) -> list[tuple[Path, int]]:
    found = [(path, _blob_version(path.name + ".safetensors")) for path in run_folder.glob("v*")]
    return [(path, v) for path, v in found if v is not None]


def local_copy(event: WeightsPublished) -> Path | None:
    """The folder to load ``event``'s host-local copy from, or None when it is not readable here
    (another host, gone, or held in one process): then the version's announcement with a file
    follows."""
    url = urlparse(event.location)
    if event.host != host_id() or url.scheme != "file":
        return None
    blob = Path(url.path)
    try:
        if blob.stat().st_size != event.size_bytes:
            return None
    except OSError:
        return None
    return blob.parent


async def _prune(
    js: JetStreamContext, names: RunNames, directory: Path | None, *, older_than: int
) -> None:
    """Delete the blobs of versions below ``older_than``."""
    if directory is None:
        store = await js.object_store(names.weights_store)
        try:
            infos = await store.list(ignore_deletes=True)
        except NotFoundError:  # an empty store
            return
        for info in infos:
            version = _blob_version(info.name)
            if version is not None and version < older_than:
                await store.delete(info.name)
        return
    paths = await asyncio.to_thread(lambda: list(Path(directory).glob("v*.safetensors")))
    for path in paths:
        version = _blob_version(path.name)
        if version is not None and version < older_than:
            await asyncio.to_thread(path.unlink, missing_ok=True)


async def fetch_weights(js: JetStreamContext, event: WeightsPublished) -> bytes:
    """The blob ``event`` announces, checked against its size and SHA-256."""
    if event.host is not None:
        raise WeightsIntegrityError(
            f"weights v{event.version}: {event.location} is a copy local to host {event.host}"
        )
    url = urlparse(event.location)
    try:
        if url.scheme == OBJSTORE:
            blob = await _read_object(js, url.netloc, url.path.lstrip("/"))
        elif url.scheme == "file":
            blob = await asyncio.to_thread(Path(url.path).read_bytes)
        else:
            raise WeightsIntegrityError(
                f"weights v{event.version}: unsupported location {event.location!r} "
                f"(use {OBJSTORE}:// or file://)"
            )
    except TRANSIENT:
        raise  # the broker cannot serve now (an outage, an R3 stream electing): retry it
    except (NatsError, NotFoundError, OSError) as exc:
        raise WeightsIntegrityError(
            f"weights v{event.version}: cannot read {event.location}: {exc!r}"
        ) from exc
    digest = await _sha256(blob)
    if len(blob) != event.size_bytes or digest != event.sha256:
        raise WeightsIntegrityError(
            f"weights v{event.version} at {event.location}: got {len(blob)} bytes with sha256 "
            f"{digest}, the event says {event.size_bytes} bytes with sha256 {event.sha256}"
        )
    return blob


async def fetch_weights_apart(url: str, event: WeightsPublished) -> bytes:
    """``fetch_weights`` in a thread, on a NATS connection and event loop of its own.

    For a process whose event loop is busy (a rollout worker streaming tokens): there, reading a
    100 MB blob took 2.8 s against 0.45 s apart (``bench/weights.py``).
    """

    async def fetch() -> bytes:
        async with session(url, "seamlessflow-weights", principal=Principal.WORKER) as nc:
            return await fetch_weights(nc.jetstream(), event)

    return await asyncio.to_thread(asyncio.run, fetch())


async def _read_object(js: JetStreamContext, bucket: str, name: str) -> bytes:
    """An object's bytes, read through an ephemeral pull consumer on its chunks.

    Not nats-py's ``ObjectStore.get``: its ordered push consumer receives about 20 MB/s here and
    hands each chunk to a thread; batched pulls were 4-13x faster here (``bench/weights.py``).
    """
    info = await (await js.object_store(bucket)).get_info(name)
    if info.is_link() or not info.nuid:
        raise WeightsIntegrityError(f"{bucket}/{name} is a link or has no chunks")
    chunk_bytes = max(1, info.size // max(1, info.chunks))
    batch = max(1, PULL_BYTES // chunk_bytes)
    sub = await js.pull_subscribe(
        OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=info.nuid),
        stream=OBJ_STREAM_TEMPLATE.format(bucket=bucket),
        config=ConsumerConfig(ack_policy=AckPolicy.NONE, mem_storage=True, inactive_threshold=5),
    )
    buffer, received = io.BytesIO(), 0
    try:
        while received < info.chunks:
            msgs = await sub.fetch(min(batch, info.chunks - received), timeout=PULL_TIMEOUT_S)
            for msg in msgs:
                buffer.write(msg.data)
            received += len(msgs)
    finally:
        await sub.unsubscribe()
    return buffer.getvalue()


async def latest_weights(js: JetStreamContext, names: RunNames) -> WeightsPublished | None:
    """The last ``WeightsPublished`` of the run, or None if no version was published yet."""
    try:
        msg = await js.get_last_msg(names.weights_stream, names.weights)
    except NotFoundError:
        return None
    return codec.decode(WeightsPublished, msg.data, content_type=codec.content_type_of(msg.headers))


async def _sha256(blob: bytes) -> str:
    """Hex SHA-256, off the event loop (hundreds of MB take a second)."""
    return await asyncio.to_thread(lambda: hashlib.sha256(blob).hexdigest())


def _write_atomic(path: Path, blob: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    tmp.write_bytes(blob)
    tmp.replace(path)
