"""Hashing a byte stream into a whole-stream digest plus fixed-size chunk digests, in one pass."""

from packager.digest import new_hasher


class ChunkHasher:
    """Feed bytes in any pieces; get the digest of everything and of each ``chunk_bytes`` chunk."""

    def __init__(self, chunk_bytes: int):
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be positive")
        self.chunk_bytes = chunk_bytes
        self._whole = new_hasher()
        self._chunk = new_hasher()
        self._in_chunk = 0
        self.chunk_digests: list[str] = []
        self.total = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        self._whole.update(view)
        self.total += len(view)
        while view:
            take = min(len(view), self.chunk_bytes - self._in_chunk)
            self._chunk.update(view[:take])
            self._in_chunk += take
            view = view[take:]
            if self._in_chunk == self.chunk_bytes:
                self._close_chunk()

    def _close_chunk(self) -> None:
        self.chunk_digests.append(self._chunk.hexdigest())
        self._chunk = new_hasher()
        self._in_chunk = 0

    def finish(self) -> str:
        """Close the last partial chunk; return the whole-stream digest."""
        if self._in_chunk:
            self._close_chunk()
        return self._whole.hexdigest()
