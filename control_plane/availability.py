"""Which blocks of one package each worker holds, kept both ways: by worker and by block."""

from collections.abc import Iterable


class Availability:
    """Both maps of one package, kept in step: worker -> blocks held and block -> workers holding it."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.by_worker: dict[str, set[int]] = {}
        self.by_block: list[set[str]] = [set() for _ in range(num_blocks)]

    def add(self, node: str, blocks: Iterable[int]) -> bool:
        """Record verified ``blocks`` on ``node``; True if anything was new."""
        held = self.by_worker.setdefault(node, set())
        before = len(held)
        for block in blocks:
            if block not in held:
                held.add(block)
                self.by_block[block].add(node)
        return len(held) != before

    def remove(self, node: str, blocks: Iterable[int]) -> bool:
        """Forget ``blocks`` on ``node``; True if it held any of them."""
        held = self.by_worker.get(node)
        if not held:
            return False
        before = len(held)
        for block in blocks:
            if block in held:
                held.discard(block)
                self.by_block[block].discard(node)
        if not held:
            del self.by_worker[node]
        return len(held) != before

    def remove_worker(self, node: str) -> bool:
        """Forget everything ``node`` holds; True if it held anything."""
        held = self.by_worker.pop(node, None)
        for block in held or ():
            self.by_block[block].discard(node)
        return bool(held)

    def held(self, node: str) -> frozenset[int]:
        """The blocks ``node`` holds."""
        return frozenset(self.by_worker.get(node, ()))

    def count(self, node: str) -> int:
        """How many blocks ``node`` holds."""
        return len(self.by_worker.get(node, ()))

    def is_complete(self, node: str) -> bool:
        """Whether ``node`` holds every block."""
        return self.count(node) == self.num_blocks

    def complete_holders(self) -> list[str]:
        """Workers holding every block, sorted."""
        return sorted(node for node, held in self.by_worker.items() if len(held) == self.num_blocks)

    def replicas(self) -> int:
        """(worker, block) pairs held."""
        return sum(map(len, self.by_worker.values()))
